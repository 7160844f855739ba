"""Fixed device costs outside the tensors a step allocates, from evidence: each number comes from a
table of measurements (public ones with their address, and this project's own), and the default and
its range are computed from those rows, never typed in.

What a training process holds on the GPU outside the caching allocator (what nvidia-smi shows minus
torch.cuda.memory_reserved()):

    CUDA context     driver state + the kernels loaded at start-up         CONTEXTS (by GPU generation)
    libraries        cuBLAS/cuBLASLt (every step with a linear layer),     LIBRARY_RUNS: whole training
                     cuDNN (convolutions, batch norm, RNNs)                processes minus their context
    NCCL             per communicator the rank opens (world size > 1)      nccl.py: NCCL_RUNS, communicator_count

Each is a Spread: low / expected / high. The expected context is the median of the measurements for
the GPU generation being modelled (all generations' median where none exists); low and high are the
smallest and largest measurement of any generation for the same loading mode, so the range covers
the GPUs, drivers and CUDA versions the evidence spans. Defaults are replaced by `memest calibrate`
measurements (calibration.py); a calibrated value has no spread.
"""

from __future__ import annotations

import os
import re
import statistics
from dataclasses import asdict, dataclass

from memest.device.measured_runs import H100_STACK, MEASURED_RUNS, PROBE_SOURCE, PROBE_STAGES, VALIDATION_SOURCE, Run
from memest.device.nccl import NCCL_BUFFSIZE_DEFAULT, NCCL_CHANNELS_DEFAULT, RING_PEERS, nccl_cost
from memest.spec.parallel_dims import ParallelDims
from memest.units import MiB

# name: (bytes, source)
CONSTANTS: dict[str, tuple[int, str]] = {
    # cuBLAS workspace per (handle, stream), allocated through the caching allocator.
    "cublas_workspace_default": (
        4096 * 1024 * 2 + 16 * 1024 * 8,
        'CUBLAS_WORKSPACE_CONFIG default ":4096:2:16:8" (aten/src/ATen/cuda/CublasHandlePool.cpp, parseChosenWorkspaceSize)',
    ),
    "cublas_workspace_sm90": (
        4096 * 8 * 1024,
        "32 MiB default on Hopper and Blackwell, major 9/10/12 (CublasHandlePool.cpp, parseChosenWorkspaceSize)",
    ),
    "cublaslt_workspace": (
        1024 * 1024,
        "CUBLASLT_WORKSPACE_SIZE default 1024 KiB (#73328); shared with the cuBLAS workspace unless "
        "TORCH_CUBLASLT_UNIFIED_WORKSPACE=0 (CublasHandlePool.cpp, unified_cublas_and_lt_workspaces)",
    ),
    # NCCL: per channel, per peer, for each of its protocols' buffers.
    "nccl_buffsize": (NCCL_BUFFSIZE_DEFAULT, "NCCL_BUFFSIZE default 4 MiB (NCCL environment-variable docs)"),
}
# NCCL_CHANNELS_DEFAULT (nccl.py), 16: an assumption: NCCL picks 2-32 channels by topology; NCCL_MAX_NCHANNELS
# caps it, NCCL_MIN_NCHANNELS raises it (NCCL environment-variable docs); memory is linear in channels (nccl#864)
CUBLAS_HANDLES_IN_TRAINING = 2  # the forward thread and autograd's device thread each reserve a handle

LAZY, EAGER = "lazy", "eager"


# ------------------------------------------------------------------------------------ evidence


@dataclass(frozen=True)
class Measurement:
    """One measured CUDA context: bytes the process held on the GPU outside torch's allocator."""

    loading: str  # lazy (CUDA >= 11.7 default, PyTorch >= 1.13) | eager (all kernels at start-up)
    bytes: int
    gpu: str
    compute_capability: tuple[int, int] | None  # None: the source does not name the GPU
    stack: str  # torch / CUDA / driver as the source gives them
    source: str  # address of the measurement
    measured: str  # what was measured, and any arithmetic applied to it here
    # the process already held cuBLAS/cuDNN kernels: eager loading of a torch build that linked them
    # statically into libtorch_cuda (pip wheels before torch 1.13, see STATIC_LIBRARIES), so "context"
    # here is context + libraries and nothing more loads on the first GEMM or convolution
    libraries_loaded: bool = False

    @property
    def mib(self) -> float:
        return self.bytes / MiB


_H100 = (9, 0)

# Why a pre-1.13 eager context already holds the libraries: before CUDA 11.7 every kernel of a library
# was loaded into the context when the library initialised, and torch's pip wheels linked cuBLAS (and
# cuDNN) statically into libtorch_cuda, so they initialised with torch's own CUDA runtime, at the first
# CUDA call. Today's wheels load them dynamically (nvidia-* packages), at their first use.
STATIC_LIBRARIES = (
    "ptrblck in https://github.com/pytorch/pytorch/issues/107667: 'Before CUDA 11.7, *all* kernels were loaded "
    "into the context once the library was loaded, which took >1000MB'; cuBLAS static linking of the wheels "
    "removed in https://github.com/pytorch/pytorch/pull/79280 (June 2022, torch 1.13); cuDNN moved to dynamic "
    "loading in https://github.com/pytorch/builder/pull/952 (Feb 2022; 'statically linked 8.2 cudnn')"
)
_PROBE_INIT = {mode: stages["init"][0] - stages["init"][1] for mode, stages in PROBE_STAGES.items()}

# Bare CUDA contexts (the first CUDA call of a torch process, nothing else loaded), by loading mode.
CONTEXTS: tuple[Measurement, ...] = (
    Measurement(LAZY, 287_047_680 - 20 * MiB, "not named", None, "torch 1.13 release branch, CUDA 11.7",
                "https://github.com/pytorch/pytorch/pull/86509",
                "cudaMemGetInfo total-free = 287,047,680 B after one 6.4 MB tensor; minus the 20 MiB allocator "
                "segment that tensor occupies (1-10 MiB requests get a 20 MiB segment)"),
    Measurement(LAZY, 256 * MiB, "RTX 3090", (8, 6), "torch 2.7.1+cu128, driver 610.43.03",
                "https://github.com/invoke-ai/InvokeAI/issues/9413",
                "nvidia-smi per-process use of an idle process holding only a CUDA context: 256 MiB"),
    Measurement(LAZY, 300 * MiB, "not named", None, "CUDA >= 11.7, PyTorch 2.0 era",
                "https://github.com/pytorch/pytorch/issues/107667",
                "ptrblck: 'the currently used ~300MB' for the CUDA context with lazy loading (approximate, as stated)"),
    Measurement(LAZY, 400 * MiB, "not named", None, "CUDA >= 11.7, PyTorch 2.0 era",
                "https://github.com/pytorch/pytorch/issues/109888",
                "ptrblck: the CUDA context 'uses around 400MB if CUDA >= 11.7 is used and lazy module loading "
                "enabled' (approximate, as stated)"),
    Measurement(LAZY, 426 * MiB, "RTX 6000 Ada", (8, 9), "torch 2.10.0+cu130",
                "https://github.com/unslothai/unsloth-zoo/pull/1053",
                "nvidia-smi after torch.cuda.mem_get_info(0) created the context, torch allocated/reserved 0: 426 MiB"),
    Measurement(LAZY, _PROBE_INIT[LAZY], "H100 80GB HBM3", _H100, H100_STACK, PROBE_SOURCE,
                "NVML used by the process minus torch's reserved after torch.empty(1, device='cuda')"),
    Measurement(EAGER, 666_632_192 - 20 * MiB, "not named", None, "torch 1.13 release branch, CUDA 11.7",
                "https://github.com/pytorch/pytorch/pull/86509",
                "CUDA_MODULE_LOADING=DEFAULT (eager): total-free = 666,632,192 B after one 6.4 MB tensor; minus its "
                "20 MiB allocator segment"),
    Measurement(EAGER, 721 * MiB - 2 * MiB, "GTX 1080", (6, 1), "torch 1.8.2+cu101",
                "https://github.com/pytorch/pytorch/issues/55277",
                "721 MiB after torch.Tensor(1).cuda(); minus the 2 MiB small-pool segment of that tensor",
                libraries_loaded=True),
    Measurement(EAGER, 1687 * MiB - 2 * MiB, "RTX 3090", (8, 6), "torch 1.8.2+cu111",
                "https://github.com/pytorch/pytorch/issues/55277",
                "1687 MiB after torch.Tensor(1).cuda(); minus the 2 MiB small-pool segment of that tensor",
                libraries_loaded=True),
    Measurement(EAGER, 1343 * MiB - 2 * MiB, "Tesla V100-SXM2 16GB", (7, 0),
                "driver 460.91.03 (CUDA 11.2), Jan 2022 (torch <= 1.10: 1.11 was released in March 2022)",
                "https://github.com/huggingface/transformers/blob/main/docs/source/en/model_memory_anatomy.md",
                "NVML device used 1343 MB after torch.ones((1, 1)).to('cuda') on an empty GPU; minus the 2 MiB "
                "small-pool segment of that tensor (device-wide: it includes the driver's reservation outside any "
                "process, ~112 MiB on a V100 at driver 440, device/reservation.py)",
                libraries_loaded=True),
    Measurement(EAGER, _PROBE_INIT[EAGER], "H100 80GB HBM3", _H100, H100_STACK, PROBE_SOURCE,
                "CUDA_MODULE_LOADING=EAGER: NVML used minus torch's reserved after torch.empty(1, device='cuda')"),
)

# Reports kept for the record but not counted: a bound or a range, not a measurement.
NOT_COUNTED: tuple[tuple[str, str], ...] = (
    ("https://github.com/pytorch/pytorch/issues/107667", "before CUDA 11.7 all kernels loaded: '>1000MB' (a bound)"),
    ("https://github.com/pytorch/pytorch/issues/20532", "V100 (AWS p3.8xlarge), torch 1.1: 'around 300MB to 400MB'"),
    ("https://github.com/pytorch/pytorch/issues/28113", "Tesla K40c, torch 1.3, CUDA 10.1: '200+mb to 700+mb' by machine"),
)


@dataclass(frozen=True)
class Spread:
    """A fixed cost from evidence: the expected value and the range the evidence spans."""

    low: int
    expected: int
    high: int
    basis: str  # which rows and which rule, in words (shown in the report)

    def __post_init__(self) -> None:
        assert self.low <= self.expected <= self.high, self

    @classmethod
    def exact(cls, nbytes: int, basis: str) -> Spread:
        return cls(nbytes, nbytes, nbytes, basis)

    def __add__(self, other: Spread) -> Spread:
        return Spread(self.low + other.low, self.expected + other.expected, self.high + other.high,
                      f"{self.basis}; {other.basis}")


def _median(values: list[int]) -> int:
    return int(statistics.median(values))


def _mib(n: int) -> str:
    return f"{n / MiB:.0f}"


def context_spread(compute_capability: tuple[int, int], loading: str,
                   rows: tuple[Measurement, ...] = CONTEXTS) -> Spread:
    """Expected: the median of this generation's measurements (all generations' where there is none);
    low / high: the smallest and largest measurement of the loading mode, any generation."""
    rows = tuple(r for r in rows if r.loading == loading)
    if not rows:
        raise ValueError(f"no context measurement for loading mode {loading!r}")
    same = [r.bytes for r in rows if r.compute_capability == tuple(compute_capability)]
    values = [r.bytes for r in rows]
    expected = _median(same) if same else _median(values)
    which = (f"median of {len(same)} sm{''.join(map(str, compute_capability))} measurement(s)" if same
             else f"median of all {len(values)}")
    return Spread(min(values), expected, max(values),
                  f"CUDA context ({loading} loading): {which}; range {_mib(min(values))}-{_mib(max(values))} MiB over "
                  f"{len(values)} public and measured contexts (overheads.CONTEXTS)")


def library_increments(runs: tuple[Run, ...] = MEASURED_RUNS, context: int = _PROBE_INIT[LAZY]) -> list[tuple[Run, int]]:
    """What each real training process held outside the allocator beyond its bare CUDA context: the
    libraries a step loads (cuBLAS/cuBLASLt, cuDNN where used) with lazy loading."""
    return [(run, run.process_overhead - context) for run in runs]


def _probe_delta(loading: str, stage: str, since: str) -> int:
    nvml, reserved = PROBE_STAGES[loading][stage]
    nvml0, reserved0 = PROBE_STAGES[loading][since]
    return (nvml - reserved) - (nvml0 - reserved0)


def library_spread(loading: str, cudnn: bool, runs: tuple[Run, ...] = MEASURED_RUNS,
                   compute_capability: tuple[int, int] | None = None,
                   contexts: tuple[Measurement, ...] = CONTEXTS) -> Spread:
    """cuBLAS/cuBLASLt (+ cuDNN) loaded by a training step, outside the allocator, beyond the context.

    lazy: from whole training processes (NVML peak - max reserved - the same GPU's bare context);
    expected: the median over runs of the same kind (with / without cuDNN kernels), range over all.
    eager: the probe's stages (first GEMMs; + convolution forward/backward), one measurement each, for
    a stack that loads the libraries at their first use; nothing for one whose context measurement
    already held them (``Measurement.libraries_loaded``: torch builds that linked them statically).
    Per eager context row of the modelled generation (all generations' where there is none) the
    libraries cost 0 or the probe's value; expected is the median, the range 0 to the probe's value."""
    if loading == EAGER:
        cublas = _probe_delta(EAGER, "cublaslt_bf16", "init")
        value = cublas + (_probe_delta(EAGER, "cudnn_conv", "cublaslt_bf16") if cudnn else 0)
        what = "cuBLAS/cuBLASLt + cuDNN" if cudnn else "cuBLAS/cuBLASLt"
        rows = [r for r in contexts if r.loading == EAGER]
        same = [r for r in rows if compute_capability is not None and r.compute_capability == tuple(compute_capability)]
        basis = same or rows
        per_row = [0 if r.libraries_loaded else value for r in basis]
        low = 0 if any(r.libraries_loaded for r in rows) else value
        high = value if any(not r.libraries_loaded for r in rows) or not rows else 0
        expected = _median(per_row) if per_row else value
        loaded = sum(r.libraries_loaded for r in basis)
        which = (f"sm{''.join(map(str, compute_capability))}" if same else "all") + " eager context rows"
        return Spread(min(low, expected), expected, max(high, expected),
                      f"libraries (eager): {what} {_mib(value)} MiB at first use (stages of the H100 probe, one "
                      f"measurement, {PROBE_SOURCE}), or 0 where the context measurement already held them "
                      f"(statically linked, pre-1.13 torch: {STATIC_LIBRARIES}); {loaded} of {len(basis)} {which} "
                      "held them: expected is the median of 0 / the probe's value over those rows")
    rows = library_increments(runs)
    if not rows:
        raise ValueError("no training-process measurement to derive library costs from")
    values = [v for _, v in rows]
    kind = [v for run, v in rows if run.cudnn == cudnn] or values
    what = "cuBLAS/cuBLASLt + cuDNN" if cudnn else "cuBLAS/cuBLASLt"
    return Spread(min(values), _median(kind), max(values),
                  f"libraries ({what}): median of {len(kind)} real training processes "
                  f"{'with' if cudnn else 'without'} cuDNN kernels, range {_mib(min(values))}-{_mib(max(values))} MiB "
                  f"over {len(values)} (NVML peak - max reserved - bare context; {VALIDATION_SOURCE}; measured on "
                  "H100 only)")


# ------------------------------------------------------------------------------------ fixed costs


@dataclass
class FixedCost:
    name: str
    bytes: int  # the expected value
    source: str
    calibrated: bool = False
    in_allocator: bool = False  # allocated through the caching allocator (part of reserved memory)
    bytes_low: int | None = None  # the evidence's range (None: no spread, equal to bytes)
    bytes_high: int | None = None

    @property
    def low(self) -> int:
        return self.bytes if self.bytes_low is None else self.bytes_low

    @property
    def high(self) -> int:
        return self.bytes if self.bytes_high is None else self.bytes_high

    @classmethod
    def from_spread(cls, name: str, spread: Spread) -> FixedCost:
        return cls(name, spread.expected, spread.basis, bytes_low=spread.low, bytes_high=spread.high)

    def to_dict(self) -> dict:
        return asdict(self)


def cublas_workspace_bytes(compute_capability: tuple[int, int], env: dict | None = None) -> int:
    env = os.environ if env is None else env
    config = env.get("CUBLAS_WORKSPACE_CONFIG")
    if config:
        pairs = re.findall(r":([0-9]+):([0-9]+)", config)
        if pairs:
            return sum(int(size) * 1024 * int(count) for size, count in pairs)
    key = "cublas_workspace_sm90" if compute_capability[0] in (9, 10, 12) else "cublas_workspace_default"
    return CONSTANTS[key][0]


def loading_mode(env: dict | None = None) -> str:
    env = os.environ if env is None else env
    return EAGER if env.get("CUDA_MODULE_LOADING", "LAZY").upper() == "EAGER" else LAZY


def _calibrated(cal: dict, key: str, name: str, what: str) -> FixedCost | None:
    if cal.get(key) is None:
        return None
    source = f"{what} measured by {cal.get('source', 'memest calibrate')}"
    if cal.get("gpu_name"):
        source += f" on {cal['gpu_name']} (driver {cal.get('driver', '?')}, torch {cal.get('torch_version', '?')})"
    return FixedCost(name, int(cal[key]), source, calibrated=True)


def fixed_costs(
    compute_capability: tuple[int, int],
    world_size: int = 1,
    training: bool = True,
    calibration: dict | None = None,
    env: dict | None = None,
    *,
    cudnn: bool = False,
    evidence_runs: tuple[Run, ...] | None = None,
    dims: ParallelDims | None = None,
) -> list[FixedCost]:
    """The fixed costs of one process: ``cudnn``: the step runs cuDNN kernels (convolutions, batch
    norm, RNNs). A calibration's measured values replace the evidence defaults, component by component.
    ``evidence_runs``: the measured training processes to derive library costs from (default: all of
    measured_runs.MEASURED_RUNS; benchmarks leave a run out to test on it). ``dims``: the layout whose NCCL
    communicators the rank opens (default: ``world_size`` data-parallel ranks, DDP's one world group)."""
    env = os.environ if env is None else env
    cal = calibration or {}
    loading = loading_mode(env)
    costs = []
    calibrated_loading = str(cal.get("module_loading", LAZY)).lower()
    use_cal = bool(cal) and calibrated_loading == loading
    context = use_cal and _calibrated(cal, "context_bytes", "cuda_context", "CUDA context")
    costs.append(context or FixedCost.from_spread("cuda_context", context_spread(compute_capability, loading)))

    libraries = None
    if use_cal and cal.get("cublas_library_bytes") is not None and (not cudnn or cal.get("cudnn_library_bytes") is not None):
        total = int(cal["cublas_library_bytes"]) + (int(cal["cudnn_library_bytes"]) if cudnn else 0)
        libraries = _calibrated({**cal, "libraries": total}, "libraries", "cuda_libraries",
                                "cuBLAS/cuBLASLt" + (" + cuDNN" if cudnn else ""))
    runs = MEASURED_RUNS if evidence_runs is None else evidence_runs
    costs.append(libraries or FixedCost.from_spread(
        "cuda_libraries", library_spread(loading, cudnn, runs, compute_capability)))

    handles = CUBLAS_HANDLES_IN_TRAINING if training else 1
    if cal.get("cublas_workspace_bytes") is not None:
        ws, src, calibrated = int(cal["cublas_workspace_bytes"]), cal.get("source", "memest calibrate"), True
    else:
        ws = cublas_workspace_bytes(compute_capability, env)
        src = CONSTANTS["cublas_workspace_sm90" if compute_capability[0] in (9, 10, 12) else "cublas_workspace_default"][1]
        calibrated = False
    costs.append(
        FixedCost(
            "cublas_workspaces", ws * handles, f"{handles} handle(s) x {ws} B: {src}", calibrated, in_allocator=True
        )
    )
    if env.get("TORCH_CUBLASLT_UNIFIED_WORKSPACE", "1") in ("0", "false", "False"):
        lt = int(env.get("CUBLASLT_WORKSPACE_SIZE", 1024)) * 1024
        costs.append(FixedCost("cublaslt_workspaces", lt * handles, CONSTANTS["cublaslt_workspace"][1], in_allocator=True))
    if world_size > 1:
        costs += nccl_costs(compute_capability, dims or ParallelDims(world_size), cal if use_cal else {}, env)
    return costs


def nccl_channels(env: dict) -> int:
    """Channels per communicator: NCCL_MAX_NCHANNELS caps the assumed default, NCCL_MIN_NCHANNELS raises it."""
    channels = int(env.get("NCCL_MAX_NCHANNELS", NCCL_CHANNELS_DEFAULT))
    return max(channels, int(env.get("NCCL_MIN_NCHANNELS", 0)))


def nccl_costs(compute_capability: tuple[int, int], dims: ParallelDims, cal: dict, env: dict) -> list[FixedCost]:
    """Per communicator the rank opens (nccl.communicator_count): its measured cost (nccl.NCCL_RUNS, or the
    calibration's one communicator) and its ring buffers: NCCL_BUFFSIZE x channels x 2 peers."""
    low, expected, high, basis, count = nccl_cost(dims, compute_capability, env)
    costs = []
    if count.expected == 0 and count.high == 0:
        return costs
    if cal.get("nccl_library_bytes") is not None:
        one = _calibrated(cal, "nccl_library_bytes", "nccl_communicator", "NCCL communicator")
        costs.append(FixedCost("nccl_communicator", one.bytes * count.expected, f"{count.describe()} x {one.source}",
                               calibrated=True, bytes_low=one.bytes * count.low, bytes_high=one.bytes * count.high))
    else:
        costs.append(FixedCost("nccl_communicator", expected, basis, bytes_low=low, bytes_high=high))
    buff = int(env.get("NCCL_BUFFSIZE", CONSTANTS["nccl_buffsize"][0]))
    channels = nccl_channels(env)
    peers = RING_PEERS  # ring: previous and next rank
    one = buff * channels * peers
    costs.append(
        FixedCost(
            "nccl_buffers",
            one * count.expected,
            f"{count.expected} communicator(s) x {buff} B x {channels} channels x {peers} peers; "
            f"{CONSTANTS['nccl_buffsize'][1]}; {channels} channels is an assumption (NCCL_MAX_NCHANNELS / "
            "NCCL_MIN_NCHANNELS override it)",
            bytes_low=one * count.low, bytes_high=one * count.high,
        )
    )
    return costs


def outside_allocator(costs: list[FixedCost]) -> Spread:
    """The process's memory outside the caching allocator: the sum of those costs, low to high."""
    outside = [c for c in costs if not c.in_allocator]
    return Spread(sum(c.low for c in outside), sum(c.bytes for c in outside), sum(c.high for c in outside),
                  "; ".join(f"{c.name}: {c.source}" for c in outside))

"""NCCL outside the caching allocator, per process group: how many communicators a rank opens, what
each costs (from measurements, each with its address), and the range the evidence spans.

What NCCL holds is not torch's: its buffers, channels and kernels are cudaMalloc'd / cuMem-mapped by
NCCL itself, so torch.cuda.memory_reserved() never sees them (fairscale PR
https://github.com/facebookresearch/fairscale/pull/678: 'the NCCL buffers are not allocated through the
PyTorch caching allocator'). NCCL's maintainer on what grows it
(https://github.com/NVIDIA/nccl/issues/864#issuecomment-1573800780, quoted in
https://github.com/NVIDIA/nccl/issues/986): more communicators use more memory (unless split with shared
resources); memory is linear in the number of channels; Ring keeps 2 connections at any scale while
CollNet/direct all-to-all connect to every peer; send/receive adds connections; growth stops beyond 2
nodes. More IB HCAs use more memory (https://github.com/NVIDIA/nccl/issues/818).

Communicators a rank opens (``communicator_count``): torch's ProcessGroupNCCL creates a communicator
lazily, on a group's first collective (eagerly only when init_process_group is given a device_id).
DeviceMesh creates one process group per mesh dimension, and reuses the default (world) group for a 1-D
mesh over every rank (torch/distributed/device_mesh.py, _init_process_groups). So a rank holds one
communicator per mesh dimension of size > 1 that it communicates on (dp: FSDP2 / DDP gradients; tp; cp;
ep and efsdp for experts), DDP's world group where no mesh is built, and, with --pp, the pipeline's
send/recv: torch.distributed.pipelining's _batch_p2p (schedules.py) sends an all-send or all-receive batch as
single isend/irecv ops, and each single send/recv initialises a 2-rank communicator for the pair of ranks
(distributed_c10d.send_object_list's use_batch note: batching 'avoids initializing 2-rank communicators and
uses existing entire group communicators'): one per neighbouring stage, plus the pp group's own where a batch
mixes sends and receives (batch_isend_irecv; high end). The world group of a multi-dimensional mesh costs a
communicator only if a collective runs on it (a barrier, a checkpoint) or init_process_group was given a
device_id (eager init; DeviceMesh then splits each dimension from it with ncclCommSplit): the high end.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from memest.device.measured_runs import H100_STACK, PROBE_SOURCE, PROBE_STAGES
from memest.spec.parallel_dims import ParallelDims
from memest.units import MiB

GB = 10**9  # the sources write decimal GB

ALL_REDUCE, ALL_TO_ALL = "all_reduce", "all_to_all"

# The ring buffers overheads.py adds per communicator at the defaults: NCCL_BUFFSIZE (4 MiB, NCCL's
# environment-variable docs) x 16 channels (an assumption: NCCL picks 2-32 by topology) x 2 ring peers.
NCCL_BUFFSIZE_DEFAULT = 4 * MiB
NCCL_CHANNELS_DEFAULT = 16
RING_PEERS = 2
DEFAULT_RING_BUFFERS = NCCL_BUFFSIZE_DEFAULT * NCCL_CHANNELS_DEFAULT * RING_PEERS


@dataclass(frozen=True)
class NcclMeasurement:
    """One measured NCCL communicator on one rank: device memory outside torch's allocator."""

    bytes: int  # per communicator
    gpu: str
    compute_capability: tuple[int, int] | None  # None: the source does not name the GPU
    nccl: str  # NCCL (or the torch build that bundles it) as the source gives it
    ranks: str  # ranks in the communicator
    communicators: int  # communicators the measurement spans (bytes is the total divided by this)
    collective: str  # ALL_REDUCE: the communicator after its first all-reduce; ALL_TO_ALL: the extra an all-to-all connects
    source: str
    measured: str  # what was measured, and the arithmetic applied here
    peers: bool = True  # the communicator had other ranks, so the measurement holds its ring buffers too

    @property
    def state_bytes(self) -> int:
        """The communicator without its ring buffers (added apart, scaled by NCCL_BUFFSIZE and the channels):
        a measurement with peers less DEFAULT_RING_BUFFERS; one without (a world of one) as measured."""
        return max(self.bytes - DEFAULT_RING_BUFFERS, 0) if self.peers else self.bytes


_PROBE_NCCL = ((PROBE_STAGES["lazy"]["nccl"][0] - PROBE_STAGES["lazy"]["nccl"][1])
               - (PROBE_STAGES["lazy"]["sdpa_flash"][0] - PROBE_STAGES["lazy"]["sdpa_flash"][1]))

NCCL_RUNS: tuple[NcclMeasurement, ...] = (
    NcclMeasurement(_PROBE_NCCL, "H100 80GB HBM3", (9, 0), f"bundled with {H100_STACK}", "1 (world of one)", 1,
                    ALL_REDUCE, PROBE_SOURCE,
                    "NVML used by the process minus torch's reserved, after init_process_group('nccl') and one "
                    "all_reduce, minus the same before (a world of one: no peer connections)", peers=False),
    NcclMeasurement(544 * MiB, "A100 (4 x A100, NVLink)", (8, 0), "not stated (PyTorch, Aug 2023)", "2", 1,
                    ALL_REDUCE, "https://github.com/NVIDIA/nccl/issues/964",
                    "GPU memory each 2-rank process group required after a 4 MB all_reduce: 544 MB (read as MiB, "
                    "nvidia-smi's unit)"),
    NcclMeasurement(688 * MiB, "A100 (4 x A100, NVLink)", (8, 0), "not stated (PyTorch, Aug 2023)", "3-4", 1,
                    ALL_REDUCE, "https://github.com/NVIDIA/nccl/issues/964",
                    "GPU memory each process group of more than 2 ranks required after a 4 MB all_reduce: 688 MB "
                    "(read as MiB)"),
    NcclMeasurement(int(1.6 * GB), "not named", None, "not stated (June 2023)", "not stated", 1, ALL_REDUCE,
                    "https://github.com/NVIDIA/nccl/issues/864",
                    "'when an NCCL communicator is established and allreduce communication is performed, the memory "
                    "occupies about 1.6GB' (approximate, as stated; the issue does not say whether the CUDA context "
                    "is included, so this row may overstate one communicator)"),
    NcclMeasurement(6 * GB // 3, "not named", None, "not stated (June 2023)", "not stated", 3, ALL_REDUCE,
                    "https://github.com/NVIDIA/nccl/issues/864",
                    "'when multiple NCCL communicators (>=3) are established, the memory occupies about 6GB': 6 GB / 3 "
                    "(at least 3 communicators, so at most this per communicator)"),
    NcclMeasurement(int(4.34 * GB) - int(1.06 * GB), "8 x H100 (NVLink)", (9, 0), "not stated (April 2025)", "8", 1,
                    ALL_TO_ALL, "https://github.com/NVIDIA/nccl/issues/1685",
                    "NVML (PyTorch's memory excluded) 1.06 GB before and 4.34 GB after the first all_to_all_single on "
                    "an initialised communicator: 32 channels connected to each peer"),
)

# Reports kept for the record but not counted: not a per-communicator measurement.
NOT_COUNTED: tuple[tuple[str, str], ...] = (
    ("https://github.com/NVIDIA/nccl/issues/2363",
     "NCCL 2.28.9, 8 x B300: a single-rank communicator's NET shared P2P buffer, one 536,870,912 B cudaCalloc "
     "(an allocation that failed, not the communicator's total)"),
    ("https://github.com/THUDM/slime/pull/955", "offloading SGLang's NCCL process group 'could save around 1.5GB' "
     "for GLM-355B (several communicators, count not stated)"),
    ("https://github.com/THUDM/slime/pull/669", "'Fix NCCL out-of-memory error even when there is memory': NCCL "
     "failed to allocate while torch's cache held the memory; slime PR #1086 emptied the cache before "
     "finalize_model_grads, replaced by a 1 GB --train-memory-margin-bytes default (slime PR #1088)"),
    ("https://github.com/NVIDIA/nccl/pull/2060", "Megatron-LM workload: 3.47 GB of NCCL memory left after suspend, "
     "1.59 GB with channel suspend (communicator count not stated)"),
)


@dataclass(frozen=True)
class CommunicatorCount:
    """Communicators one rank opens, low / expected / high, and what each is for."""

    low: int
    expected: int
    high: int
    parts: tuple[str, ...]  # one line per communicator of the expected count
    extra: tuple[str, ...] = ()  # what only the high end counts
    all_to_all: int = 0  # of the expected, communicators that run all-to-all (expert parallel)
    sizes: tuple[int, ...] = ()  # ranks in each expected communicator

    def describe(self) -> str:
        text = f"{self.expected} NCCL communicator(s) per rank: " + ", ".join(self.parts)
        if self.high != self.expected or self.low != self.expected:
            text += f" (range {self.low}-{self.high}" + (f": {'; '.join(self.extra)}" if self.extra else "") + ")"
        return text


def communicator_count(dims: ParallelDims) -> CommunicatorCount:
    """The communicators the traced rank opens, from its layout (module docstring: the rules and sources)."""
    if dims.world_size <= 1:
        return CommunicatorCount(0, 0, 0, ())
    parts: list[str] = []
    sizes: list[int] = []
    extra: list[str] = []
    low_less = 0
    mesh = [(name, size) for name, size in dims.mesh_dims if size > 1 and name != "pp"]
    if not dims.mesh_dims:
        if dims.pp_enabled and dims.world_size == dims.pp:
            pass  # one rank per stage: only the pipeline's send/recv
        else:
            parts.append("world (DDP / ZeRO gradient all-reduce on the default group)")
            sizes.append(dims.world_size)
    for name, size in mesh:
        parts.append(f"{name} mesh dimension ({size} ranks)")
        sizes.append(size)
    multi = len(dims.mesh_dims) > 1 or (dims.pp_enabled and bool(dims.mesh_dims))
    if multi:
        extra.append("+1 the world group, if a collective runs on it (barrier, checkpoint)")
    if dims.pp_enabled:
        stage = dims.pp_stage
        neighbours = (stage > 0) + (stage < dims.pp - 1)
        for i in range(neighbours):
            parts.append("pipeline send/recv to the " + ("previous" if stage > 0 and i == 0 else "next") + " stage")
            sizes.append(2)
        low_less += neighbours - 1  # every batch mixed: the pp group's one communicator only
        extra.append("+1 the pp group's communicator where a batch mixes sends and receives (batch_isend_irecv)")
    a2a = 0
    for name, size in dims.expert_mesh_dims:
        if name == "pp" or size <= 1:
            continue
        parts.append(f"{name} expert mesh dimension ({size} ranks)")
        sizes.append(size)
        a2a += name == "ep"
    expected = len(parts)
    high = expected + (1 if multi else 0) + (1 if dims.pp_enabled else 0)
    return CommunicatorCount(expected - low_less, expected, high, tuple(parts), tuple(extra), a2a, tuple(sizes))


@dataclass(frozen=True)
class CommSpread:
    low: int
    expected: int
    high: int
    basis: str


def _mib(n: int) -> str:
    return f"{n / MiB:.0f}"


def communicator_spread(compute_capability: tuple[int, int],
                        rows: tuple[NcclMeasurement, ...] = NCCL_RUNS) -> CommSpread:
    """One communicator after its first all-reduce, without its ring buffers (``state_bytes``; overheads.py
    adds those per communicator): expected = the median of this GPU generation's rows (all rows' where there
    is none); low / high = the smallest and largest row of any GPU."""
    rows = tuple(r for r in rows if r.collective == ALL_REDUCE)
    if not rows:
        raise ValueError("no NCCL communicator measurement")
    values = [r.state_bytes for r in rows]
    same = [r.state_bytes for r in rows if r.compute_capability == tuple(compute_capability)]
    expected = int(statistics.median(same if same else values))
    which = (f"median of {len(same)} sm{''.join(map(str, compute_capability))} measurement(s)" if same
             else f"median of all {len(values)}")
    sources = sorted({r.source for r in rows})
    return CommSpread(min(values), expected, max(values),
                      f"per communicator {which}, range {_mib(min(values))}-{_mib(max(values))} MiB over "
                      f"{len(values)} measurements less the default ring buffers ({_mib(DEFAULT_RING_BUFFERS)} MiB, "
                      f"added apart) where the communicator had peers ({', '.join(sources)}; nccl.NCCL_RUNS)")


def all_to_all_extra(peers: int, rows: tuple[NcclMeasurement, ...] = NCCL_RUNS) -> tuple[int, str]:
    """The extra an all-to-all's direct connections add on a communicator with ``peers`` other ranks (the high
    end only): the largest measured extra per connected peer (a row's ranks - 1) x ``peers``."""
    rows = tuple(r for r in rows if r.collective == ALL_TO_ALL)
    if not rows or peers <= 0:
        return 0, ""
    top = max(rows, key=lambda r: r.bytes // (int(r.ranks) - 1))
    per_peer = top.bytes // (int(top.ranks) - 1)
    return per_peer * peers, (f"all-to-all connections {_mib(per_peer)} MiB per peer x {peers} peer(s) "
                              f"({_mib(top.bytes)} MiB over {int(top.ranks) - 1} peers in {top.source})")


# NVLink SHARP (NVLS): NCCL's own log of its NVLS buffers on 8 x H200 (vLLM's measurement of NVLS):
# 'NVLS comm ... nHeads 8 buffSize 4194304 memSize 2097152 nvlsPerRankSize 301989888 nvlsTotalSize 2415919104';
# NVLS was only enabled for more than 2 GPUs, on H100 and later with NVSwitch.
NVLS_PER_RANK = (301_989_888, "NVLS buffers 288 MiB per rank per communicator of more than 2 ranks (NCCL's "
                 "nvlsPerRankSize on 8 x H200, https://github.com/vllm-project/vllm/issues/9699; H100 and later "
                 "with NVSwitch only)")


def nvls_communicators(count: CommunicatorCount, compute_capability: tuple[int, int]) -> int:
    """Communicators that may hold NVLS buffers: more than 2 ranks, on sm90 or later."""
    return sum(size > 2 for size in count.sizes) if compute_capability[0] >= 9 else 0


def nccl_cost(dims: ParallelDims, compute_capability: tuple[int, int], env: dict | None = None,
              rows: tuple[NcclMeasurement, ...] = NCCL_RUNS) -> tuple[int, int, int, str, CommunicatorCount]:
    """(low, expected, high, basis, count): the communicators' cost outside the allocator for one rank.
    low = low count x the smallest row; expected = expected count x this generation's median; high = high
    count x the largest row, + the all-to-all extra of the expert-parallel communicator's peers, + NVLS
    buffers per communicator of more than 2 ranks on sm90+ (NVSwitch systems only, so the expected value
    holds them only when NCCL_NVLS_ENABLE=1 asks for them; NCCL_NVLS_ENABLE=0 removes them)."""
    env = env or {}
    count = communicator_count(dims)
    per = communicator_spread(compute_capability, rows)
    extra, extra_basis = all_to_all_extra(dims.ep - 1, rows) if count.all_to_all else (0, "")
    nvls_setting = str(env.get("NCCL_NVLS_ENABLE", "")).strip()
    nvls = 0 if nvls_setting == "0" else nvls_communicators(count, compute_capability) * NVLS_PER_RANK[0]
    expected = count.expected * per.expected + (nvls if nvls_setting == "1" else 0)
    high = count.high * per.high + extra + nvls
    basis = f"{count.describe()}; {per.basis}" + (f"; {extra_basis}" if extra_basis else "")
    if nvls:
        basis += f"; {NVLS_PER_RANK[1]}" + (" (NCCL_NVLS_ENABLE=1: expected)" if nvls_setting == "1" else
                                             ": high end only, NCCL_NVLS_ENABLE=0 removes it")
    return count.low * per.low, expected, high, basis, count


"""From a trace to what the GPU will show: the caching allocator's reserved memory plus fixed costs.

    allocated (torch.cuda.max_memory_allocated) = the trace's blocks, 512 B-rounded, + cuBLAS workspaces
    reserved  (torch.cuda.max_memory_reserved)  = the caching-allocator replay of those blocks
    device    (nvidia-smi for the process)      = reserved + CUDA context + libraries (cuBLAS, cuDNN)
                                                  (+ NCCL)
    min budget (what the step needs)            = the smallest device budget under which the replay, with
                                                  the allocator's OOM recovery, completes + the same costs
Reserved and device are unconstrained: what a GPU with room to spare shows. On a smaller one the allocator
frees its cache and retries before raising OOM, so a step can run in less: the min budget.

Both come as low / expected / high: the fixed costs' evidence spread (overheads.py) plus the replay's
measured error band on reserved memory (slack.py). ``device_bytes`` and ``min_budget_bytes`` are the
expected values; the verdict against a budget (device/fit.py) uses the needed range and its floor.

The low ends of the needed range and of max_memory_reserved reach down to the allocator floor
(allocator.allocator_floor: the live blocks in whole segments / pages, no fragmentation): the replay
follows one event order and the allocator's choices on it, and a real run near its card (another order,
cached blocks freed before an OOM, expandable segments) can fragment less; it cannot hold less than the
floor. The expected values assume the allocator settings torch reads (PYTORCH_CUDA_ALLOC_CONF, then
PYTORCH_HIP_ALLOC_CONF, then PYTORCH_ALLOC_CONF), said in ``range_basis`` with the replay's need under
expandable_segments:True. The trace holds two steps (trace/step.py): the second reuses the first's
cache, and a third replays as the second did (tests/test_allocator_pressure.py).

One pool per CUDA stream: "Allocations are associated with a stream. Once freed, blocks can be
re-allocated on the same stream, but not on any other stream" (the header comment of
c10/cuda/CUDACachingAllocator.cpp; expandable segments too: "one segment (per stream)"). The trace records
the stream each storage was allocated on (trace/tracker.py: FSDP2 selects its FSDPCommContext streams with
``torch.cpu.stream`` on the trace's "cpu" mesh exactly where it selects CUDA streams on a GPU: the
all-gather output on the copy-in stream, the reduce-scatter output, which the sharded gradients are views
of, on the reduce-scatter stream; torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py), and the
replay keeps each stream's freed blocks for that stream (``streams_basis`` says how much that adds).
record_stream'ed blocks, whose free waits for the other stream's work: FSDP1's (parallel/fsdp1.py records each
``_no_dispatch_record_stream`` and its rate limiter's free events and syncs) are in the HIGH end of reserved and of
the needed range: the replay keeps each such block pending until the CPU waits on a free event recorded after it
(torch/distributed/fsdp/_runtime_utils.py ``_unshard``/``_reshard``, _limiter_utils.py: 2 all-gathers in flight),
an OOM retry or the step's end (allocator.py's docstring), the worst case of a GPU far behind the CPU. FSDP1's wrap
with sync_module_states (``trace.load_marks``): each flattened broadcast bucket, which ProcessGroupNCCL record_stream'd
on its stream in torch until spring 2025 (parallel/fsdp1.py's docstring, 2.), stays pending until rank 0's next blocking
copy or the step's first wait. The expected value and the low end free at once (a GPU keeping up), so the verdict
is no harsher. NCCL's on DDP buckets are not modelled.

Kernel workspaces whose size the library picks at run time (cuDNN convolution and RNN workspaces,
targets/cuda/) are in the trace at their expected size; ``workspaces`` replays the trace with each at its
low and at its high bound (high None: cuDNN's benchmark search may take all free device memory).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field

from memest.device.allocator import (
    EMPTY_CACHE,
    MIB,
    RESET_PEAK,
    alloc_conf_from_env,
    alloc_conf_text,
    allocator_floor,
    min_device_limit,
    parse_alloc_conf,
    replay,
)
from memest.device.nccl import communicator_count
from memest.device.overheads import FixedCost, fixed_costs, outside_allocator
from memest.device.reservation import reservation_spread
from memest.device.slack import slack_band
from memest.errors import MemestError
from memest.spec.parallel_dims import ParallelDims
from memest.trace.events import EmptyCache, Phase, Trace

_EXPANDABLE = "expandable_segments:True"
_WORKSPACE_IDS = (-1, -2)  # synthetic storage ids for the cuBLAS workspaces (forward and backward threads)


@dataclass
class WorkspaceRange:
    """The unconstrained allocated / reserved peaks with every run-time-sized workspace at its low and at
    its high bound (the expected ones are DeviceUsage's own numbers). High None: unbounded, a cuDNN
    benchmark search takes up to the free device memory."""

    calls: int  # kernel calls with a run-time-sized workspace
    low_allocated_bytes: int
    low_reserved_bytes: int
    high_allocated_bytes: int | None
    high_reserved_bytes: int | None
    unbounded: list[str] = field(default_factory=list)  # what makes high unbounded (one line each)
    source: str = (
        "cuDNN picks convolution and RNN algorithms, and their workspace, at run time: expected sizes and bounds "
        "measured on an H100 (docs/cuda-kernels.md, benchmarks/gpu-kernels.json)"
    )


@dataclass
class DeviceUsage:
    tensor_peak_bytes: int
    allocated_peak_bytes: int  # unconstrained max_memory_allocated
    reserved_peak_bytes: int  # unconstrained max_memory_reserved
    device_bytes: int  # unconstrained: reserved peak + costs outside the allocator (nvidia-smi, room to spare)
    # The smallest device budget under which the step runs (the allocator replay with that limit
    # completes): min_allocator_limit_bytes + costs outside the allocator. Fits: min_budget_bytes <= budget.
    min_budget_bytes: int
    min_allocator_limit_bytes: int  # the caching allocator's part (allocator.min_device_limit)
    fixed_costs: list[FixedCost] = field(default_factory=list)
    allocator_config: str = ""
    calibrated: bool = False
    # The ranges (expected = device_bytes / min_budget_bytes): the evidence spread of the fixed costs
    # outside the allocator plus the allocator replay's measured band on reserved memory.
    bytes_low: int = 0  # unconstrained device use (nvidia-smi with room to spare), low / expected / high
    bytes_expected: int = 0
    bytes_high: int | None = 0  # None: unbounded (cuDNN benchmark search may take all free memory)
    needed_bytes_low: int = 0  # the smallest budget the step runs in, low / expected / high
    needed_bytes_expected: int = 0
    needed_bytes_high: int | None = 0
    reserved_bytes_low: int = 0  # max_memory_reserved's low end: down to the allocator floor (near capacity)
    reserved_bytes_high: int | None = 0
    cudnn_kernels: bool = False  # the step runs cuDNN kernels (convolution, batch norm, RNN)
    range_basis: list[str] = field(default_factory=list)  # what the range rests on, one line per part
    # The allocator floor (allocator.allocator_floor): the smallest allocator budget any run of the step's
    # blocks fits, allocated blocks in whole segments / pages, no fragmentation. The low ends of the reserved
    # and needed ranges are no higher; the verdict says does-not-fit only below needed_bytes_low.
    allocator_floor_bytes: int = 0
    # the floor + the costs outside the allocator (expected): the verdict's does-not-fit line (device/fit.py)
    needed_bytes_floor: int = 0
    # min_allocator_limit_bytes with expandable_segments:True (None: the run already sets it)
    expandable_limit_bytes: int | None = None
    workspaces: WorkspaceRange | None = None  # cuDNN workspaces at their low / high bounds (None: none in the step)
    # Which figure: bytes_* above are the process's own use (nvidia-smi per-process "GPU Memory Usage", NVML
    # usedGpuMemory), repeated as process_bytes_*. The device-wide used (nvmlDeviceGetMemoryInfo) adds the
    # driver/firmware reservation outside any process (device/reservation.py): device_used_bytes_*. Compare
    # live free memory with the process figure, a card's total with the device-wide one.
    process_bytes_low: int = 0
    process_bytes_expected: int = 0
    process_bytes_high: int | None = 0
    device_reservation_bytes_low: int = 0
    device_reservation_bytes_expected: int = 0
    device_reservation_bytes_high: int = 0
    device_reservation_basis: str = ""
    device_used_bytes_low: int = 0
    device_used_bytes_expected: int = 0
    device_used_bytes_high: int | None = 0
    nccl_communicators: int = 0  # expected NCCL communicators the rank opens (device/nccl.py)

    def to_dict(self) -> dict:
        return asdict(self)


def allocator_events(trace: Trace, costs: list[FixedCost], empty_caches: list[EmptyCache] | None = None,
                     deferred: bool = False) -> list[tuple[int, int]]:
    """The trace's events with the cuBLAS workspaces allocated where a CUDA run first needs them:
    the first forward matmul (forward thread) and the first backward op (autograd's device thread).
    Both live to the end of the process. An ``EMPTY_CACHE`` event where the step empties the CUDA cache
    (``empty_caches``; default: the calls the run's first two steps make, ``first_steps(trace)``). ``deferred``: with
    the trace's record_stream marks (``trace.stream_marks``), the worst case of the high end (module docstring)."""
    calls = first_steps(trace) if empty_caches is None else empty_caches
    workspace = next((c for c in costs if c.name == "cublas_workspaces"), None)
    inserts: list[tuple[int, tuple[int, int]]] = list(trace.stream_marks) if deferred else []
    # an empty_cache call before a workspace at the same point: that one comes with the phase's first kernel
    inserts += [(call.event, EMPTY_CACHE) for call in calls]
    if workspace is not None and workspace.bytes > 0 and trace.events:
        starts = {phase: index for index, _, phase in reversed(trace.phase_marks)}  # first mark of each phase
        per_handle = workspace.bytes // 2
        inserts.append((starts.get(Phase.FORWARD, 0), (_WORKSPACE_IDS[0], per_handle)))
        if Phase.BACKWARD in starts:
            inserts.append((starts[Phase.BACKWARD], (_WORKSPACE_IDS[1], workspace.bytes - per_handle)))
    events = _interleave(trace.events, inserts)
    return with_load(trace, events, deferred)


def _interleave(events: list[tuple[int, int]], inserts: list[tuple[int, tuple[int, int]]]) -> list[tuple[int, int]]:
    """``events`` with each ``(i, event)`` of ``inserts`` placed before ``events[i]`` (after the last for
    ``i == len(events)``), those at the same point in their order in ``inserts``."""
    at: dict[int, list[tuple[int, int]]] = {}
    for i, event in inserts:
        at.setdefault(i, []).append(event)
    out: list[tuple[int, int]] = []
    for i, event in enumerate(events):
        out.extend(at.get(i, ()))
        out.append(event)
    out.extend(at.get(len(events), ()))
    return out


def with_load(trace: Trace, events: list[tuple[int, int]], deferred: bool = False) -> list[tuple[int, int]]:
    """``events`` after the device allocations made before the step (``trace.load_events``: FSDP1's wrap) and a
    reset of the peaks (allocator.RESET_PEAK): what the wrap left cached stays reserved into the step. A step
    storage the wrap allocated (a unit's shard) loses its setup allocation, which the wrap's stands for.
    ``deferred``: with the wrap's record_stream marks (``trace.load_marks``), the high end's worst case."""
    if not trace.load_events:
        return events
    load = _interleave(trace.load_events, trace.load_marks if deferred else [])
    loaded = {sid for sid, delta in trace.load_events if delta > 0 and sid >= 0}
    rest, seen = [], set()
    for sid, delta in events:
        if delta > 0 and sid in loaded and sid not in seen:
            seen.add(sid)
            continue
        rest.append((sid, delta))
    return load + [RESET_PEAK] + rest


def first_steps(trace: Trace) -> list[EmptyCache]:
    """The calls that empty the cache in the run's first two steps: every call of the first traced step, and of the
    second those made at every step (a call made one step in N > 1 is made at step 0, not step 1)."""
    return [c for c in trace.empty_caches if c.every == 1 or c.iteration == 1]


def empty_cache_schedules(trace: Trace) -> list[tuple[str, list[EmptyCache]]]:
    """The pairs of consecutive steps the run has, as the calls each pair makes (what it is, the calls). Calls made
    at every step: one pair. Calls made one step in N (transformers' ``torch_empty_cache_steps``): the first two
    steps (step 0 empties, step 1 does not), a step that empties after one that does not (steps N-1, N), and for
    N >= 3 two steps that do not (steps 1, 2), which replay as a run without the calls."""
    every = max((c.every for c in trace.empty_caches), default=1)
    if every == 1:
        return [("", list(trace.empty_caches))]
    always = [c for c in trace.empty_caches if c.every == 1]
    periodic = [c for c in trace.empty_caches if c.every > 1]
    schedules = [("steps 0-1 (0 empties the cache)", always + [c for c in periodic if c.iteration == 1]),
                 (f"steps {every - 1}-{every} ({every} empties the cache)",
                  always + [c for c in periodic if c.iteration == 2])]
    if every >= 3:
        schedules.append(("steps 1-2 (neither empties the cache)", always))
    return schedules


CUDNN_OPS = ("convolution", "batch_norm", "rnn", "lstm", "gru")  # aten ops whose CUDA kernels are cuDNN's


def uses_cudnn(trace: Trace) -> bool:
    """Does the step run cuDNN kernels on CUDA (so the process loads cuDNN)? Convolutions, batch norm
    (cudnn_batch_norm) and RNNs; named by the aten ops the trace recorded."""
    return any(any(name in r.op for name in CUDNN_OPS) for r in trace.storages)


def at_bound(events: list[tuple[int, int]], trace: Trace, which: str) -> list[tuple[int, int]] | None:
    """``events`` with every run-time-sized workspace at its ``which`` ('low' | 'high') bound; None when
    a high bound is unbounded."""
    ranges = trace.workspace_ranges
    out = []
    for sid, delta in events:
        if sid in ranges:
            size = ranges[sid][0 if which == "low" else 1]
            if size is None:
                return None
            delta = size if delta > 0 else -size if delta < 0 else 0
        out.append((sid, delta))
    return out


def workspace_range(trace: Trace, events: list[tuple[int, int]], conf, expected,
                    streams: dict[int, int] | None = None) -> WorkspaceRange | None:
    """Replays at the low and the high bounds. The allocator's peaks are not monotonic in one block's size
    (a different size is placed in another cached block), so each end of the range is the lowest / highest
    of the three replays."""
    if not trace.workspace_ranges:
        return None
    low = replay(at_bound(events, trace, "low"), conf, streams=streams)
    high_events = at_bound(events, trace, "high")
    high = replay(high_events, conf, streams=streams) if high_events is not None else None
    runs = [r for r in (low, expected, high) if r is not None]
    unbounded = sorted({why for _, h, why in trace.workspace_ranges.values() if h is None})
    return WorkspaceRange(
        calls=len(trace.workspace_ranges),
        low_allocated_bytes=min(r.peak_allocated for r in runs),
        low_reserved_bytes=min(r.peak_reserved for r in runs),
        high_allocated_bytes=max(r.peak_allocated for r in runs) if high else None,
        high_reserved_bytes=max(r.peak_reserved for r in runs) if high else None,
        unbounded=[f"{why}: up to the free device memory" for why in unbounded],
    )


def device_usage(
    trace: Trace,
    compute_capability: tuple[int, int],
    *,
    world_size: int = 1,
    calibration: dict | None = None,
    env: dict | None = None,
    evidence_runs: tuple | None = None,
    dims: ParallelDims | None = None,
) -> DeviceUsage:
    """``evidence_runs``: the measured runs the ranges rest on (default: measured_runs.MEASURED_RUNS);
    ``dims``: the layout whose NCCL communicators the rank opens (default: ``world_size`` DDP ranks)."""
    env = os.environ if env is None else env
    cudnn = uses_cudnn(trace)
    costs = fixed_costs(compute_capability, world_size, calibration=calibration, env=env, cudnn=cudnn,
                        evidence_runs=evidence_runs, dims=dims)
    var, conf_text = alloc_conf_text(env)
    try:
        conf = parse_alloc_conf(conf_text)
    except ValueError as exc:  # torch would refuse to start the run with the same setting
        raise MemestError(f"{var}={conf_text!r}: {exc}; torch rejects this setting too (fix or unset it)") from None
    streams = trace.streams()
    # the run's step pairs (one, unless the cache is emptied one step in N): the highest reserved of them is the
    # run's high-water mark, and the step runs in a budget only if every pair does
    pairs = [(why, calls, events, replay(events, conf, streams=streams)) for why, calls in empty_cache_schedules(trace)
             for events in [allocator_events(trace, costs, calls)]]
    _, _, events, result = max(pairs, key=lambda run: run[3].peak_reserved)
    limit = max(min_device_limit(e, conf, unconstrained=r, streams=streams) for _, _, e, r in pairs)
    deferred = [replay(e, conf, streams=streams) for _, calls, _, _ in pairs if trace.stream_marks or trace.load_marks
                for e in [allocator_events(trace, costs, calls, deferred=True)]]
    if deferred:  # record_stream's worst case (module docstring): the high end of reserved and of the need
        worst = max(deferred, key=lambda r: r.peak_reserved)
        worst_limit = max(min_device_limit(e, conf, unconstrained=r, streams=streams) for (_, calls, _, _), r in
                          zip(pairs, deferred, strict=True) for e in [allocator_events(trace, costs, calls, True)])
    outside = outside_allocator(costs)
    band = slack_band(cudnn) if evidence_runs is None else slack_band(cudnn, evidence_runs)
    allocated = result.peak_allocated
    floor = min(allocator_floor(events, conf), limit)
    reserved_low, reserved_high = band.bounds(allocated, result.peak_reserved, floor=allocated)
    limit_low, limit_high = band.bounds(allocated, limit, floor=min(limit, allocated))
    # Near capacity the real allocator may fragment less than the replay (another event order, its cache
    # freed before an OOM, expandable segments): the needed range and max_memory_reserved reach down to the
    # floor. Unconstrained device use (bytes_low, room to spare, no OOM recovery) keeps the measured band.
    limit_low = min(limit_low, floor)
    if deferred:
        reserved_high = max(reserved_high, band.bounds(allocated, worst.peak_reserved, floor=allocated)[1])
        limit_high = max(limit_high, band.bounds(allocated, worst_limit, floor=min(worst_limit, allocated))[1])
    expandable = None if conf.expandable_segments else _expandable_limit(events, conf_text, streams)
    workspaces = workspace_range(trace, events, conf, result, streams)
    if workspaces is not None:  # cuDNN's run-time workspace choices widen the range (None: unbounded)
        reserved_low = min(reserved_low, workspaces.low_reserved_bytes)
        limit_low = min(limit_low, workspaces.low_reserved_bytes)
        if workspaces.high_reserved_bytes is None:
            reserved_high = limit_high = None
        else:
            reserved_high = max(reserved_high, workspaces.high_reserved_bytes)
            limit_high = max(limit_high, workspaces.high_reserved_bytes)
    # the process's own use (nvidia-smi per process), low / expected / high: bytes_*, process_* and device_used_*
    process_low = reserved_low + outside.low
    process_expected = result.peak_reserved + outside.expected
    process_high = None if reserved_high is None else reserved_high + outside.high
    held = reservation_spread()
    return DeviceUsage(
        process_bytes_low=process_low,
        process_bytes_expected=process_expected,
        process_bytes_high=process_high,
        device_reservation_bytes_low=held.low,
        device_reservation_bytes_expected=held.expected,
        device_reservation_bytes_high=held.high,
        device_reservation_basis=held.basis,
        device_used_bytes_low=process_low + held.low,
        device_used_bytes_expected=process_expected + held.expected,
        device_used_bytes_high=None if process_high is None else process_high + held.high,
        nccl_communicators=communicator_count(dims or ParallelDims(world_size)).expected if world_size > 1 else 0,
        tensor_peak_bytes=trace.peak()[0],
        allocated_peak_bytes=allocated,
        reserved_peak_bytes=result.peak_reserved,
        device_bytes=process_expected,
        fixed_costs=costs,
        allocator_config=conf_text,
        calibrated=any(c.calibrated for c in costs),
        min_budget_bytes=limit + outside.expected,
        min_allocator_limit_bytes=limit,
        bytes_low=process_low,
        bytes_expected=process_expected,
        bytes_high=process_high,
        needed_bytes_low=limit_low + outside.low,
        needed_bytes_expected=limit + outside.expected,
        needed_bytes_high=None if limit_high is None else limit_high + outside.high,
        reserved_bytes_low=min(reserved_low, floor),
        reserved_bytes_high=reserved_high,
        cudnn_kernels=cudnn,
        range_basis=[c.source for c in costs if not c.in_allocator and c.low != c.high] + [band.basis]
        + allocator_basis(var, conf_text, floor, limit, expandable)
        + streams_basis(trace, events, conf, streams, result)
        + empty_cache_basis(trace, costs, conf, streams, pairs)
        + (record_stream_basis(result, worst, worst_limit, limit) if deferred else [])
        + (workspaces.unbounded if workspaces is not None else []),
        workspaces=workspaces,
        allocator_floor_bytes=floor,
        needed_bytes_floor=floor + outside.expected,
        expandable_limit_bytes=expandable,
    )


def _expandable_limit(events: list[tuple[int, int]], conf_text: str, streams: dict[int, int]) -> int | None:
    """The replay's smallest allocator budget with expandable_segments:True added to ``conf_text``
    (None where torch would reject the combination)."""
    try:
        conf = parse_alloc_conf(f"{conf_text},{_EXPANDABLE}" if conf_text.strip() else _EXPANDABLE)
        return min_device_limit(events, conf, streams=streams)
    except ValueError:
        return None


def streams_basis(trace: Trace, events: list[tuple[int, int]], conf, streams: dict[int, int], result) -> list[str]:
    """The report line for a step that allocates on more than the default stream: how many storages, on how
    many streams, and what keeping their freed blocks apart adds to max_memory_reserved (one replay with
    every block on one stream, for the difference)."""
    if not streams:
        return []
    one_pool = replay(events, conf)
    mib = 2**20
    side = {trace.storages[sid].stream for sid in streams}
    largest = max((trace.storages[sid].nbytes for sid in streams), default=0)
    which = ("FSDP1's unshard and post-backward streams" if (trace.parallel or "").startswith("FSDP1")
             else "FSDP2's all-gather copy-in and reduce-scatter streams")
    return [f"{len(streams)} blocks allocated on {len(side)} side stream(s) (largest {largest / mib:.1f} MiB; "
            f"{which}): the caching allocator re-uses a freed block "
            "only on its own stream (c10/cuda/CUDACachingAllocator.cpp), which the replay follows: "
            f"{(result.peak_reserved - one_pool.peak_reserved) / mib:+.0f} MiB of max_memory_reserved over "
            "one pool for every stream"]


def empty_cache_basis(trace: Trace, costs: list[FixedCost], conf, streams: dict[int, int], pairs: list) -> list[str]:
    """The report line for a step that empties the CUDA cache: who calls it where, and what the calls change of
    max_memory_reserved (one replay without them, for the difference). ``pairs``: the run's pairs of steps as
    device_usage replayed them, (what, calls, events, ReplayResult); the figure is the highest."""
    if not trace.empty_caches:
        return []
    mib = 2**20
    without = replay(allocator_events(trace, costs, []), conf, streams=streams)
    pair, calls, _, result = max(pairs, key=lambda run: run[3].peak_reserved)
    every = max(c.every for c in trace.empty_caches)
    shown = calls if every == 1 else [c for c in trace.empty_caches if c.every > 1 and c.iteration == 1]
    counts: dict[str, int] = {}
    for call in shown:
        counts[call.by] = counts.get(call.by, 0) + 1
    steps = " and ".join(str(i) for i in sorted({c.iteration for c in shown}))
    made = "; ".join(f"{by} ({n} call{'s' * (n > 1)})" for by, n in counts.items())
    line = (f"the step empties the CUDA cache (traced step{'s' * (' and ' in steps)} {steps}): {made}; the allocator "
            "replay releases every cached whole segment there (free pages of expandable segments), as "
            "DeviceCachingAllocator::emptyCache's release_cached_blocks does (c10/cuda/CUDACachingAllocator.cpp): "
            f"max_memory_reserved {result.peak_reserved / mib:.0f} MiB against {without.peak_reserved / mib:.0f} MiB "
            f"without the calls ({(result.peak_reserved - without.peak_reserved) / mib:+.0f} MiB; emptying can also "
            f"raise it: a released segment is not there for a later request to reuse); "
            f"{result.empty_cache_released / mib:.0f} MiB returned to the driver by the calls")
    if every > 1:
        each = ", ".join(f"{why}: {r.peak_reserved / mib:.0f} MiB" for why, _, _, r in pairs)
        line += (f"; one step in {every} empties it (steps 0, {every}, {2 * every}...), so the figure is the highest "
                 f"of the run's pairs of steps ({each}; the highest: {pair})")
    return [line]


def allocator_basis(var: str, conf_text: str, floor: int, limit: int, expandable: int | None) -> list[str]:
    """The report lines that say which allocator the expected values assume and what the low end is."""
    mib = 2**20
    assumed = f"{var}={conf_text}" if conf_text.strip() else f"{var} unset (torch's defaults: expandable segments off)"
    lines = [
        f"allocator replay assumes {assumed}; its expected budget is {limit / mib:.0f} MiB for the allocator, "
        f"{(limit - floor) / mib:.0f} MiB of it fragmentation over the floor",
        f"low end: the allocator floor {floor / mib:.0f} MiB (the step's live blocks in whole 2 MiB segments, "
        "or 2 / 20 MiB pages with expandable segments; c10/cuda/CUDACachingAllocator.cpp): below it no "
        "allocator runs the step; between it and the high end the real allocator may or may not fragment "
        "as much as the replay",
    ]
    if expandable is not None:
        lines.append(f"with {_EXPANDABLE} the replay needs {expandable / mib:.0f} MiB for the allocator "
                     f"({(expandable - limit) / mib:+.0f} MiB; pages mapped on demand, free pages unmapped "
                     "before an OOM)")
    return lines


def record_stream_basis(result, worst, worst_limit: int, limit: int) -> list[str]:
    """What the high end's record_stream worst case adds (module docstring)."""
    return [f"record_stream (FSDP1): the high end frees each record_stream'd block only when the CPU waits for the "
            f"GPU (the rate limiter's event.synchronize, torch/distributed/fsdp/_runtime_utils.py _unshard; an OOM "
            f"retry or empty_cache: synchronize_and_free_events, c10/cuda/CUDACachingAllocator.cpp; the wrap's "
            f"broadcast buckets, record_stream'd by NCCL in torch until spring 2025, at rank 0's next blocking copy), a GPU "
            f"far behind the CPU: reserved {result.peak_reserved / MIB:.1f} -> {worst.peak_reserved / MIB:.1f} MiB, "
            f"need {limit / MIB:.1f} -> {worst_limit / MIB:.1f} MiB; the expected value frees at once (a GPU keeping "
            "up)"]


def fits_in(trace: Trace, usage: DeviceUsage, capacity_bytes: int, env: dict | None = None) -> bool:
    """A direct check: does the allocator replay with the device limit ``capacity_bytes`` (less the
    costs outside the allocator) complete? The estimate's answer is ``usage.min_budget_bytes <= capacity``;
    they agree at the min budget (completes) and one byte below it (OOM; 1 MiB below with
    per_process_memory_fraction or expandable segments); elsewhere they can differ only where OOM is not
    monotonic in the limit (allocator.min_device_limit)."""
    result = replay_under(trace, usage, capacity_bytes, env)
    return result is not None and not result.oom


def replay_under(trace: Trace, usage: DeviceUsage, capacity_bytes: int, env: dict | None = None):
    """The allocator replay under a device budget (less the expected costs outside the allocator): its
    ``peak_reserved`` is the max_memory_reserved a run on that card would show, capped near the card where
    the unconstrained replay holds more (cached blocks are freed before an OOM). None when the costs
    outside the allocator alone exceed the budget; ``oom`` set when the step does not run in it."""
    outside = sum(c.bytes for c in usage.fixed_costs if not c.in_allocator)
    limit = capacity_bytes - outside
    if limit < 0:
        return None
    env = os.environ if env is None else env
    return replay(allocator_events(trace, usage.fixed_costs), alloc_conf_from_env(env), device_limit_bytes=limit,
                  streams=trace.streams())

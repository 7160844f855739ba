"""The estimate pipeline: spec -> source -> trace -> report (+ device usage for --target cuda).
Library code: returns data, prints nothing."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from memest.report.analysis import Report, analyse
from memest.result import EstimateViews, budget_bytes
from memest.sources import load_source
from memest.spec import RunSpec
from memest.spec.choices import Verdict
from memest.trace.events import Trace
from memest.trace.step import trace_step


@dataclass(repr=False)
class Estimate(EstimateViews):
    report: Report
    trace: Trace

    @property
    def needed_bytes(self) -> int:
        """What the step needs: the smallest device budget it runs in (cuda: the allocator replay with
        that limit completes, DeviceUsage.min_budget_bytes), or the peak allocated (cpu). Unconstrained
        usage (a GPU with room to spare) is report.device.device_bytes."""
        device = self.report.device
        return device.min_budget_bytes if device else self.report.peak_allocated_bytes

    @property
    def needed_range(self) -> tuple[int, int, int | None]:
        """(low, expected, high) of the needed budget: the evidence spread of the fixed costs plus the
        allocator replay's measured band (device/usage.py); expected == needed_bytes. cpu: no spread."""
        device = self.report.device
        if device is None:
            low, expected, high = (self.needed_bytes,) * 3
        else:
            low, expected, high = device.needed_bytes_low, device.needed_bytes_expected, device.needed_bytes_high
        if self.report.expert_routing and high is not None:  # --ep: the high end of the routing, traced
            high = max(high, *(r["needed_bytes_high"] for r in self.report.expert_routing))
        return low, expected, high

    def fits(self, capacity: int | str) -> bool:
        """needed <= capacity, by definition, so "fits" and headroom (capacity - needed) never disagree.
        True for both "fits" and "tight" verdicts (see ``verdict``). ``capacity``: bytes, or a budget as
        the CLI takes it ("11GB", "11GiB", "rtx2080ti")."""
        return self.needed_bytes <= budget_bytes(capacity)

    def verdict(self, capacity: int | str) -> Verdict:
        """FITS (the high end of the needed range fits), TIGHT (expected fits, high does not) or
        DOES_NOT_FIT (expected does not); members are their JSON strings ("fits", "tight", "does-not-fit")."""
        from memest.device.fit import verdict

        _, expected, high = self.needed_range
        return verdict(expected, high, budget_bytes(capacity))

    def headroom_bytes(self, capacity: int | str) -> int:
        """>= 0 exactly when the step fits."""
        return budget_bytes(capacity) - self.needed_bytes


def estimate(spec: RunSpec, calibration: dict | None = None, source=None) -> Estimate:
    """``source``: an already loaded ModelSource for ``spec.model`` (planners reuse one). With --pp every
    stage is traced; the estimate returned is the stage that needs the most, with every stage listed
    (``report.pipeline_stages``): the step fits only if its worst stage does."""
    source = source or load_source(spec.model)
    if spec.seq is None and source.default_seq is not None:
        # the sequence length the step runs with, resolved once: the report and JSON show it
        spec = dataclasses.replace(spec, seq=source.default_seq)
    if spec.ep > 1:
        return _routing_range(spec, calibration, source)
    if spec.cp > 1:
        return _context_parallel_ranks(spec, calibration, source)
    return _pipeline_ranks(spec, calibration, source)


def _pipeline_ranks(spec: RunSpec, calibration: dict | None, source) -> Estimate:
    """The step of one rank, or with --pp every pipeline rank's, the one that needs the most returned."""
    if spec.pp == 1:
        return _estimate_one(spec, calibration, source)
    stages = [_estimate_one(dataclasses.replace(spec, pp_stage=i), calibration, source) for i in range(spec.pp)]
    worst = max(stages, key=lambda e: e.needed_bytes)
    worst.report.pipeline_stages = [
        {"stage": i, "rank": e.trace.rank, "traced": e.trace.parallel, "peak_allocated_bytes": e.report.peak_allocated_bytes,
         "needed_bytes": e.needed_bytes, "host_peak_bytes": e.trace.host_peak(), "trace_seconds": e.report.trace_seconds}
        for i, e in enumerate(stages)
    ]
    worst.report.trace_seconds = sum(e.report.trace_seconds for e in stages)
    worst.report.notes.insert(0, _stages_note(stages, worst))
    return worst


def _context_parallel_ranks(spec: RunSpec, calibration: dict | None, source) -> Estimate:
    """--cp: the ring attention's work differs by rank (torch's head-tail load balance: rank r attends to half
    of the key/value blocks of lower ranks' chunks and with half its queries to the others'), so every cp rank
    is traced; the estimate is the one that needs the most, every rank listed (``report.context_parallel_ranks``)."""
    from memest.units import format_bytes

    ranks = [_estimate_one(dataclasses.replace(spec, cp_rank=r), calibration, source) for r in range(spec.cp)]
    worst = max(ranks, key=lambda e: e.needed_bytes)
    worst.report.context_parallel_ranks = [
        {"cp_rank": r, "rank": e.trace.rank, "peak_allocated_bytes": e.report.peak_allocated_bytes,
         "needed_bytes": e.needed_bytes, "trace_seconds": e.report.trace_seconds}
        for r, e in enumerate(ranks)
    ]
    worst.report.trace_seconds = sum(e.report.trace_seconds for e in ranks)
    rows = ", ".join(f"cp rank {r} {format_bytes(e.needed_bytes)}" for r, e in enumerate(ranks))
    worst.report.notes.insert(0, (
        f"context parallel: every cp rank traced ({rows}); the report shows cp rank {ranks.index(worst)}, the one that "
        "needs the most (the verdict is its); data-parallel groups repeat these ranks (the last can hold FSDP2's "
        "shorter last shard where a split is uneven: the first group's trace is its upper bound)"
        + (f", and each cp rank's {spec.tp} tensor-parallel ranks run the same shapes (its first is traced)"
           if spec.tp > 1 else "")
    ))
    kernel = (
        "the CPU flash-attention op inside each ring step (memest's handler: torch registers ring handlers for the "
        "CUDA SDPA ops only), as measured against real gloo runs" if spec.target == "cpu" else
        "torch's own handler around the CUDA flash / memory-efficient op of each ring step, with that kernel's scratch "
        "as memest models it (not measured on a GPU)"
    )
    worst.report.notes.insert(1, (
        "context parallel: the step transformers' Trainer + accelerate run: input_ids, labels, shift_labels and "
        "position_ids cut by torch's head-tail load balancer; attention by torch's ring (torch/distributed/tensor/"
        f"experimental/_context_parallel/_attention.py, {spec.cp_rotate} rotation) with {kernel}; the causal mask is "
        "left to SDPA's is_causal (a mask transformers builds and accelerate's pre-hook drops is not counted)"
    ))
    return worst


def _routing_range(spec: RunSpec, calibration: dict | None, source) -> Estimate:
    """--ep: what reaches a rank's experts depends on the router. Traced at the balanced split (every rank gets 1/ep
    of every rank's (token, expert) pairs: the expected need) and with every rank sending all its pairs to this one
    (the high end of the range); parallel/expert_parallel.py."""
    from memest.units import format_bytes

    # with --pp each routing's estimate is its worst pipeline rank's (every rank traced at both routings)
    runs = {r: _pipeline_ranks(dataclasses.replace(spec, ep_routing=r), calibration, source) for r in ("uniform", "one-rank")}
    expected, high = runs["uniform"], runs["one-rank"]
    expected.report.expert_routing = [
        {"routing": r, "peak_allocated_bytes": e.report.peak_allocated_bytes, "needed_bytes": e.needed_bytes,
         "needed_bytes_high": e.needed_range[2] if e.needed_range[2] is not None else e.needed_bytes,
         "trace_seconds": e.report.trace_seconds}
        for r, e in runs.items()
    ]
    expected.report.trace_seconds += high.report.trace_seconds
    device, worst = expected.report.device, high.report.device
    if device is not None and worst is not None:  # the range shown is the routing's too
        for name in ("bytes_high", "needed_bytes_high", "reserved_bytes_high"):
            a, b = getattr(device, name), getattr(worst, name)
            setattr(device, name, None if a is None or b is None else max(a, b))
    expected.report.notes.insert(0, (
        f"expert parallel: the all-to-all's split is data-dependent (the router's choices); expected need traced with "
        f"uniform routing (each rank receives 1/{spec.ep} of every rank's token-expert pairs: {format_bytes(expected.needed_bytes)}), "
        f"the range's high end with every rank's pairs routed to this rank ({spec.ep} x tokens x top-k rows through its "
        f"experts: {format_bytes(high.needed_bytes)})"
    ))
    return expected


def _stages_note(stages: list[Estimate], worst: Estimate) -> str:
    from memest.units import format_bytes

    rows = ", ".join(f"pipeline rank {i} {format_bytes(e.needed_bytes)}" for i, e in enumerate(stages))
    k = stages.index(worst)
    return (f"pipeline: every pipeline rank's stages traced ({rows}); the report shows pipeline rank {k}, the one that "
            "needs the most (the verdict is its)")


def _estimate_one(spec: RunSpec, calibration: dict | None, source) -> Estimate:
    start = time.perf_counter()
    trace = trace_step(source, spec)
    report = analyse(trace, spec, source.name)
    if spec.target == "cuda":
        from memest.device.usage import device_usage

        report.device = device_usage(trace, spec.compute_capability, world_size=spec.world_size, calibration=calibration)
    report.trace_seconds = time.perf_counter() - start
    report.notes.extend(source.notes)
    if spec.world_size > 1 or spec.offload != "none":
        _parallel_notes(report, trace, spec)
    if trace.uncounted_flop_ops:
        report.notes.append(
            f"FLOPs of {', '.join(sorted(trace.uncounted_flop_ops))} not counted (torch's flop formula rejected the "
            "shapes); time costs such as recompute % are understated, memory is unaffected"
        )
    if spec.target == "cuda":
        report.notes.append(
            "device = caching-allocator reserved + CUDA context + libraries (+ NCCL); cuDNN workspaces are in the trace; "
            + ("calibrated values used" if report.device.calibrated else "defaults from evidence, not calibrated for "
               "this GPU (memest calibrate)")
        )
        report.notes += [f"range rests on: {line}" for line in report.device.range_basis]
    else:
        report.notes.append("peak allocated = bytes held by the CPU allocator at the step's peak")
    if spec.mixed:
        report.notes.append(
            "mixed precision traced with CUDA autocast's op lists (emulated on CPU tensors)"
            if spec.target == "cuda"
            else "mixed precision traced with CPU autocast (torch.autocast('cpu'))"
        )
    return Estimate(report, trace)


def _parallel_notes(report: Report, trace: Trace, spec: RunSpec) -> None:
    """--world-size/--shard/--offload: what the trace is (details: trace.distributed.sharding_summary)."""
    from memest.parallel.distributed import sharding_summary
    from memest.units import format_bytes

    report.sharding = sharding_summary(trace)
    report.effective_batch *= spec.dp  # tensor-parallel ranks share one batch, pipeline stages too
    if spec.pp > 1:
        report.effective_batch *= spec.microbatches_per_step
    if spec.world_size > 1 and trace.parallel:
        report.notes.append(f"per-rank estimate: rank {spec.rank} of {spec.world_size}, traced with {trace.parallel} (docs/sharding.md)")
    elif spec.world_size > 1:
        report.notes.append(f"per-rank estimate: each of the {spec.world_size} ranks runs this {spec.mode} step on its own batch")
    if spec.offload != "none":
        where = "host (CPU) memory" if spec.target == "cuda" else "host memory (the same memory on --target cpu)"
        report.notes.append(
            f"--offload {spec.offload}: {format_bytes(trace.host_peak())} peak held in {where}, "
            "not counted in the peak above"
        )

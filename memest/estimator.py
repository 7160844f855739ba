"""The estimate: spec -> source -> the traces a layout needs -> one Report (+ device usage for --target cuda).
The ranks traced are gathered first (``_Rank``, ``_Gathered``); the report is built once, from them, at the end.
Library code: returns data, prints nothing."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from memest.device import fit
from memest.device.usage import DeviceUsage, device_usage
from memest.errors import MemestError
from memest.features.grpo import completion_len_of
from memest.features.registry import trace_step
from memest.parallel.distributed import sharding_summary
from memest.report.analysis import Report, ReportParts, analyse
from memest.result import EstimateViews, budget_bytes
from memest.sources import load_source
from memest.spec import RunSpec
from memest.spec.choices import ActivationOffload, ExpertRouting, LossHead, Offload, Preference, Target, Verdict
from memest.trace.events import Trace
from memest.units import format_bytes


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
        True for "fits" and for "tight" verdicts from the expected need up; a budget between the needed
        range's floor and the expected need is "tight" and fits() False (see ``verdict``). ``capacity``:
        bytes, or a budget as the CLI takes it ("11GB", "11GiB", "rtx2080ti")."""
        return self.needed_bytes <= budget_bytes(capacity)

    def verdict(self, capacity: int | str) -> Verdict:
        """FITS (the high end of the needed range fits), TIGHT (the needed floor fits, the high end does
        not) or DOES_NOT_FIT (below the floor, ``needed_floor``); members are their JSON strings ("fits",
        "tight", "does-not-fit")."""
        _, expected, high = self.needed_range
        return fit.verdict(expected, high, budget_bytes(capacity), self.needed_floor)

    @property
    def needed_floor(self) -> int:
        """Below this budget the step does not fit (DeviceUsage.needed_bytes_floor: the allocator floor + the
        expected costs outside the allocator); cpu: the needed bytes."""
        device = self.report.device
        return device.needed_bytes_floor if device else self.needed_bytes

    def headroom_bytes(self, capacity: int | str) -> int:
        """>= 0 exactly when the step fits."""
        return budget_bytes(capacity) - self.needed_bytes


@dataclass(frozen=True)
class _Rank:
    """One rank's traced step and its device usage (--target cuda), before any report."""

    spec: RunSpec
    trace: Trace
    device: DeviceUsage | None
    seconds: float

    @cached_property
    def peak_bytes(self) -> int:
        return self.trace.peak()[0]

    @property
    def needed_bytes(self) -> int:
        return self.device.min_budget_bytes if self.device else self.peak_bytes

    @property
    def needed_range(self) -> tuple[int, int, int | None]:
        d = self.device
        return (d.needed_bytes_low, d.needed_bytes_expected, d.needed_bytes_high) if d else (self.needed_bytes,) * 3


@dataclass(frozen=True)
class _Gathered:
    """What the report is built from: the rank it shows, and what tracing the other ranks added."""

    rank: _Rank
    seconds: float  # every trace's
    notes: tuple[str, ...] = ()  # about the ranks traced: they lead the report's notes
    pipeline_stages: list | None = None
    context_parallel_ranks: list | None = None
    expert_routing: list | None = None


def estimate(spec: RunSpec, calibration: dict | None = None, source=None, notes: Sequence[str] = ()) -> Estimate:
    """``source``: an already loaded ModelSource for ``spec.model`` (planners reuse one). With --pp every
    stage is traced; the estimate returned is the stage that needs the most, with every stage listed
    (``report.pipeline_stages``): the step fits only if its worst stage does. ``notes``: the caller's
    (the GPU modelled), after the estimate's own."""
    if spec.target == Target.CPU and spec.activation_offload == ActivationOffload.SAVE_ON_CPU:
        # save_on_cpu(pin_memory=False) on host tensors: tensor.cpu() is the tensor itself, the option is a no-op;
        # refused for the user (battery 29, #162), still traceable below for the ground truth (features/activation_offload)
        raise MemestError("--activation-offload save-on-cpu with --target cpu moves nothing: the saved tensors are "
                          "already in host memory (tensor.cpu() returns each one itself); drop it, or use --target cuda")
    if spec.target == Target.CPU and spec.activation_offload == ActivationOffload.TORCHTUNE:
        raise MemestError("--activation-offload torchtune with --target cpu: torchtune's OffloadActivations runs on CUDA "
                          "only (its __init__ calls torch.cuda.default_stream(), its unpack .to(\"cuda\")); use "
                          "--target cuda")
    if spec.target == Target.CPU and spec.activation_offload == ActivationOffload.TRL:
        raise MemestError("--activation-offload trl with --target cpu: trl's OffloadActivations needs an accelerator "
                          "(trl/models/activation_offloading.py l. 151: torch.accelerator.current_accelerator() is None "
                          "on a CPU, an AttributeError in __init__); use --target cuda")
    source = source or load_source(spec.model)
    if spec.seq is None and source.default_seq is not None:
        # the sequence length the step runs with, resolved once: the report and JSON show it
        spec = dataclasses.replace(spec, seq=source.default_seq)
    if spec.preference != Preference.NONE and source.image_facts is not None and (
            spec.preference != Preference.DPO or spec.world_size > 1):
        # these preference batches are built from input_ids alone (features/preference*.py, grpo.py): a vision-language
        # model's images would be dropped (was: dpo exit 0 without the vision tower; grpo an AttributeError, battery 30);
        # dpo on one process carries trl's vision batch (features/preference.py VISION_KEYS,
        # preference_feature.refuse_images); over ranks it is not measured
        raise MemestError(f"--preference {spec.preference} on a vision-language model ({source.name}) is not traced "
                          "yet: trl's batch would carry its images (pixel_values), memest's preference batch does not "
                          "(docs/limitations.md)")
    _check_completion_positions(spec, source)
    _check_loss_chunks(spec)
    _check_image_positions(spec, source)
    if spec.parallel.ep_enabled:
        gathered = _routing_range(spec, calibration, source)
    elif spec.parallel.cp_enabled:
        gathered = _context_parallel_ranks(spec, calibration, source)
    else:
        gathered = _pipeline_ranks(spec, calibration, source)
    return _estimate_of(gathered, source, notes)


def _check_completion_positions(spec: RunSpec, source) -> None:
    """--preference grpo generates --completion-len tokens after the --seq prompt: each needs a position (was: a
    100,032-token generation on a 256-position model, traced token by token for many minutes, battery 30)."""
    if spec.preference != Preference.GRPO or not source.max_seq or spec.seq is None:
        return
    total = spec.seq + completion_len_of(spec)
    if total > source.max_seq:
        why = f" ({source.max_seq_why})" if source.max_seq_why else ""
        given = f"--completion-len {spec.completion_len}" if spec.completion_len else \
            f"trl's default max_completion_length {completion_len_of(spec)} (--completion-len 0)"
        raise MemestError(f"--preference grpo: the prompt (--seq {spec.seq}) and {given} make {total} positions; "
                          f"{source.name} takes at most {source.max_seq} positions{why}; use --seq + --completion-len "
                          f"of {source.max_seq} or less")


def _check_loss_chunks(spec: RunSpec) -> None:
    """--loss-head chunked[-output]:N splits the sequence in N chunks: more than its tokens leaves empty chunks, one
    traced op each (was: chunked-output:100000 at --seq 32 still tracing after 10 minutes, battery 30)."""
    kind, chunks = LossHead.of(spec.loss_head)
    if chunks and spec.seq is not None and chunks > spec.seq:
        raise MemestError(f"--loss-head {spec.loss_head}: {chunks} chunks of a {spec.seq}-token sequence leave "
                          f"{chunks - spec.seq} of them empty; use {kind}:{spec.seq} or fewer")


def _check_image_positions(spec: RunSpec, source) -> None:
    """--images N adds N images' tokens (--video-frames F a video's) to the --seq text tokens: all need positions
    (was: --images 1000 on a 512-position model traced ~256,000 tokens for many minutes, battery 30)."""
    facts = _image_facts(spec, source) if source.max_seq and spec.seq is not None else None
    if not facts:
        return
    video = facts.get("video")
    total = spec.seq + spec.images * facts["tokens_per_image"] + (video["tokens_per_video"] if video else 0)
    if total > source.max_seq:
        why = f" ({source.max_seq_why})" if source.max_seq_why else ""
        parts = [f"--images {spec.images}: {facts['tokens_per_image']} image tokens each (a {facts['size']} image)"] \
            if spec.images else []
        if video:  # was: --video-frames 100000 blamed a data-dependent op of the model (battery 31 #43)
            parts.append(f"--video-frames {video['frames']}: {video['tokens_per_video']} video tokens (frames of "
                         f"{video['size']})")
        raise MemestError(f"{' and '.join(parts)} and --seq {spec.seq} text tokens make at least {total} positions; "
                          f"{source.name} takes at most {source.max_seq} positions{why}; use fewer or smaller images "
                          "or frames, or a shorter --seq")


def _estimate_one(spec: RunSpec, calibration: dict | None, source) -> Estimate:
    """One rank's estimate (the planners' cut models)."""
    rank = _trace_rank(spec, calibration, source)
    return _estimate_of(_Gathered(rank, rank.seconds), source)


def _estimate_of(g: _Gathered, source, notes: Sequence[str] = ()) -> Estimate:
    """The one place the report is built."""
    spec, trace = g.rank.spec, g.rank.trace
    parallel = spec.world_size > 1 or spec.offload != Offload.NONE
    parts = ReportParts(
        device=g.rank.device,
        trace_seconds=g.seconds,
        batch_factor=spec.dp * (spec.microbatches_per_step if spec.parallel.pp_enabled else 1) if parallel else 1,
        sharding=sharding_summary(trace) if parallel else None,
        pipeline_stages=g.pipeline_stages,
        expert_routing=g.expert_routing,
        context_parallel_ranks=g.context_parallel_ranks,
        notes_before=g.notes,
        notes_after=(*_source_notes(spec, source), *_rank_notes(g.rank), *notes),
        image_facts=_image_facts(spec, source),
    )
    return Estimate(analyse(trace, spec, source.name, parts), trace)


def _source_notes(spec: RunSpec, source) -> list[str]:
    """The source's notes; with --images / --video-frames, not those on its default inputs (the report's images row
    says what was traced: the images given, their size after the processor's resizing, their tokens)."""
    drop = source.default_input_notes if _image_facts(spec, source) is not None else ()
    return [n for n in source.notes if n not in drop]


def _image_facts(spec: RunSpec, source) -> dict | None:
    """--images / --video-frames: what the model's processor makes of them (the report's images row)."""
    if not (spec.images or spec.video_frames) or source.image_facts is None:
        return None
    return source.image_facts(spec.images, spec.input_hw,
                              **spec.vision_options)


def _trace_rank(spec: RunSpec, calibration: dict | None, source) -> _Rank:
    start = time.perf_counter()
    trace = trace_step(source, spec)
    device = (device_usage(trace, spec.compute_capability, world_size=spec.world_size, calibration=calibration,
                           dims=spec.parallel)
              if spec.target == Target.CUDA else None)
    return _Rank(spec, trace, device, time.perf_counter() - start)


def _pipeline_ranks(spec: RunSpec, calibration: dict | None, source) -> _Gathered:
    """The step of one rank, or with --pp every pipeline rank's, the one that needs the most shown."""
    if not spec.parallel.pp_enabled:
        rank = _trace_rank(spec, calibration, source)
        return _Gathered(rank, rank.seconds)
    stages = [_trace_rank(dataclasses.replace(spec, pp_stage=i), calibration, source) for i in range(spec.pp)]
    worst = max(stages, key=lambda r: r.needed_bytes)
    rows = ", ".join(f"pipeline rank {i} {format_bytes(r.needed_bytes)}" for i, r in enumerate(stages))
    note = (f"pipeline: every pipeline rank's stages traced ({rows}); the report shows pipeline rank "
            f"{stages.index(worst)}, the one that needs the most (the verdict is its)")
    listed = [
        {"stage": i, "rank": r.trace.rank, "traced": r.trace.parallel, "peak_allocated_bytes": r.peak_bytes,
         "needed_bytes": r.needed_bytes, "host_peak_bytes": r.trace.host_peak(saved=False), "trace_seconds": r.seconds}
        for i, r in enumerate(stages)
    ]
    return _Gathered(worst, sum(r.seconds for r in stages), (note,), pipeline_stages=listed)


def _context_parallel_ranks(spec: RunSpec, calibration: dict | None, source) -> _Gathered:
    """--cp: the ring attention's work differs by rank (torch's head-tail load balance: rank r attends to half
    of the key/value blocks of lower ranks' chunks and with half its queries to the others'), so every cp rank
    is traced; the estimate is the one that needs the most, every rank listed (``report.context_parallel_ranks``)."""
    ranks = [_trace_rank(dataclasses.replace(spec, cp_rank=r), calibration, source) for r in range(spec.cp)]
    worst = max(ranks, key=lambda r: r.needed_bytes)
    listed = [
        {"cp_rank": i, "rank": r.trace.rank, "peak_allocated_bytes": r.peak_bytes, "needed_bytes": r.needed_bytes,
         "trace_seconds": r.seconds}
        for i, r in enumerate(ranks)
    ]
    rows = ", ".join(f"cp rank {i} {format_bytes(r.needed_bytes)}" for i, r in enumerate(ranks))
    shown = (
        f"context parallel: every cp rank traced ({rows}); the report shows cp rank {ranks.index(worst)}, the one that "
        "needs the most (the verdict is its); data-parallel groups repeat these ranks (the last can hold FSDP2's "
        "shorter last shard where a split is uneven: the first group's trace is its upper bound)"
        + (f", and each cp rank's {spec.tp} tensor-parallel ranks run the same shapes (its first is traced)"
           if spec.parallel.tp_enabled else "")
    )
    kernel = (
        "the CPU flash-attention op inside each ring step (memest's handler: torch registers ring handlers for the "
        "CUDA SDPA ops only), as measured against real gloo runs" if spec.target == Target.CPU else
        "torch's own handler around the CUDA flash / memory-efficient op of each ring step, with that kernel's scratch "
        "as memest models it (not measured on a GPU)"
    )
    step = (
        "context parallel: the step transformers' Trainer + accelerate run: input_ids, labels, shift_labels and "
        "position_ids cut by torch's head-tail load balancer; attention by torch's ring (torch/distributed/tensor/"
        f"experimental/_context_parallel/_attention.py, {spec.cp_rotate} rotation) with {kernel}; the causal mask is "
        "left to SDPA's is_causal (a mask transformers builds and accelerate's pre-hook drops is not counted)"
    )
    return _Gathered(worst, sum(r.seconds for r in ranks), (shown, step), context_parallel_ranks=listed)


def _routing_range(spec: RunSpec, calibration: dict | None, source) -> _Gathered:
    """--ep: what reaches a rank's experts depends on the router. Traced at the balanced split (every rank gets 1/ep
    of every rank's (token, expert) pairs: the expected need) and with every rank sending all its pairs to this one
    (the high end of the range); parallel/expert_parallel.py."""
    # with --pp each routing's estimate is its worst pipeline rank's (every rank traced at both routings)
    runs = {r: _pipeline_ranks(dataclasses.replace(spec, ep_routing=r), calibration, source) for r in ExpertRouting}
    expected, high = runs[ExpertRouting.UNIFORM], runs[ExpertRouting.ONE_RANK]
    listed = [
        {"routing": r.value, "peak_allocated_bytes": g.rank.peak_bytes, "needed_bytes": g.rank.needed_bytes,
         "needed_bytes_high": g.rank.needed_range[2] if g.rank.needed_range[2] is not None else g.rank.needed_bytes,
         "trace_seconds": g.seconds}
        for r, g in runs.items()
    ]
    note = (
        f"expert parallel: the all-to-all's split is data-dependent (the router's choices); expected need traced with "
        f"uniform routing (each rank receives 1/{spec.ep} of every rank's token-expert pairs: "
        f"{format_bytes(expected.rank.needed_bytes)}), the range's high end with every rank's pairs routed to this rank "
        f"({spec.ep} x tokens x top-k rows through its experts: {format_bytes(high.rank.needed_bytes)})"
    )
    rank = dataclasses.replace(expected.rank, device=_widest(expected.rank.device, high.rank.device))
    return dataclasses.replace(expected, rank=rank, seconds=expected.seconds + high.seconds,
                               notes=(note, *expected.notes), expert_routing=listed)


def _widest(device: DeviceUsage | None, other: DeviceUsage | None) -> DeviceUsage | None:
    """``device`` with the high ends of ``other``'s ranges where they are higher (None: unbounded)."""
    if device is None or other is None:
        return device
    names = ("bytes_high", "needed_bytes_high", "reserved_bytes_high")
    high = {n: None if getattr(device, n) is None or getattr(other, n) is None else max(getattr(device, n), getattr(other, n))
            for n in names}
    return dataclasses.replace(device, **high)


def _rank_notes(rank: _Rank) -> list[str]:
    """What the rank's trace is: parallel layout, uncounted FLOPs, the target's accounting, mixed precision."""
    spec, trace, device = rank.spec, rank.trace, rank.device
    notes = _parallel_notes(trace, spec) if spec.world_size > 1 or spec.offload != Offload.NONE else []
    if trace.uncounted_flop_ops:
        notes.append(
            f"FLOPs of {', '.join(sorted(trace.uncounted_flop_ops))} not counted (torch's flop formula rejected the "
            "shapes); time costs such as recompute % are understated, memory is unaffected"
        )
    if spec.target == Target.CUDA:
        notes.append(
            "device = caching-allocator reserved + CUDA context + libraries (+ NCCL); cuDNN workspaces are in the trace; "
            + ("calibrated values used" if device.calibrated else "defaults from evidence, not calibrated for "
               "this GPU (memest calibrate)")
        )
        notes += [f"range rests on: {line}" for line in device.range_basis]
    else:
        notes.append("peak allocated = bytes held by the CPU allocator at the step's peak")
    if spec.mixed:
        notes.append(
            "mixed precision traced with CUDA autocast's op lists (emulated on CPU tensors)"
            if spec.target == Target.CUDA
            else "mixed precision traced with CPU autocast (torch.autocast('cpu'))"
        )
    return notes


def _parallel_notes(trace: Trace, spec: RunSpec) -> list[str]:
    """--world-size/--shard/--offload: what the trace is (details: parallel.distributed.sharding_summary)."""
    notes = []
    if spec.world_size > 1 and trace.parallel:
        notes.append(f"per-rank estimate: rank {spec.rank} of {spec.world_size}, traced with {trace.parallel} (docs/sharding.md)")
    elif spec.world_size > 1:
        notes.append(f"per-rank estimate: each of the {spec.world_size} ranks runs this {spec.mode} step on its own batch")
    if spec.offload != Offload.NONE:
        where = "host (CPU) memory" if spec.target == Target.CUDA else "host memory (the same memory on --target cpu)"
        notes.append(
            f"--offload {spec.offload}: {format_bytes(trace.host_peak(saved=False))} peak held in {where}, "
            "not counted in the peak above"
        )
    return notes

"""From a trace to a Report: the peak, what is alive at the peak, and per-layer memory."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass

from memest.device.usage import DeviceUsage
from memest.features.activation_offload import rules_source
from memest.features.checkpointing import within
from memest.features.loss_head import describe
from memest.features.optim import FOLKLORE_N
from memest.report.images import images_summary
from memest.spec import RunSpec
from memest.spec.choices import ActivationOffload, Outputs, Quant
from memest.trace.events import Category, Phase, Trace
from memest.trace.step import TRACED_MICRO_STEPS
from memest.units import format_bytes

# The JSON contract's categories (design.md §5); buffers and inputs are reported as "other".
BREAKDOWN_KEYS = ("parameters", "gradients", "optimizer_state", "activations", "temporaries", "other")
_TO_BREAKDOWN = {
    Category.PARAMETERS: "parameters",
    Category.GRADIENTS: "gradients",
    Category.OPTIMIZER_STATE: "optimizer_state",
    Category.ACTIVATIONS: "activations",
    Category.TEMPORARIES: "temporaries",
    Category.BUFFERS: "other",
    Category.INPUTS: "other",
}


@dataclass(frozen=True)
class LayerRow:
    name: str  # fully qualified module name; '' is the whole model
    type: str
    depth: int
    output_shape: str
    params: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int  # saved for backward during one step's forward
    bytes_at_peak: int  # everything attributed to this module (and its children) alive at the peak
    share_of_peak: float


@dataclass(frozen=True)
class Report:
    """One estimate's record, built once (``analyse``): fields in the order of the --json document."""

    model: str
    model_type: str
    spec: dict
    param_count: int
    param_bytes: int
    peak_allocated_bytes: int
    peak_iteration: int
    phase_at_peak: str
    module_at_peak: str
    op_at_peak: str
    breakdown_at_peak: dict[str, int]
    other_at_peak: dict[str, int]  # buffers and inputs, the parts of "other"
    peak_by_phase: dict[str, int]
    peak_by_iteration: dict[int, int]
    layers: list[LayerRow]
    folklore_bytes: int
    folklore_formula: str
    trace_seconds: float
    attention_backends: dict[str, int]  # --target cuda: SDPA kernel -> calls
    device: DeviceUsage | None  # --target cuda: allocator replay and fixed costs
    effective_batch: int  # batch x grad_accum (x data-parallel ranks, x micro-batches with --pp)
    step_flops: int  # FLOPs of one step (the last traced), torch.utils.flop_counter formulas
    recompute_flops: int  # of which: forward ops re-run in backward by activation checkpointing
    checkpointed: list[str]
    sharding: dict | None  # --world-size/--shard/--offload: parallel.distributed.sharding_summary
    pipeline_stages: list | None  # --pp: every stage's peak and need (estimator.estimate)
    expert_routing: list | None  # --ep: the peak and need at each routing assumption traced (estimator.estimate)
    context_parallel_ranks: list | None  # --cp: every cp rank's peak and need (estimator.estimate)
    notes: list[str]
    # --outputs kept: bytes of model outputs alive at the peak only because the loop still references them
    # (past the point where a loop that frees outputs drops them); 0 with --outputs freed
    outputs_held_bytes: int
    trainable_param_count: int  # elements of the parameters that require grad (LoRA adapters, unfrozen)
    # --data-dependent upper-bound: data-dependent op -> calls answered at their bound (every element selected
    # or distinct); non-empty means the peak is an upper bound for them
    bounded_ops: dict[str, int]
    # why the folklore formula does not apply to this step ('' where it does): its figure is left out of the
    # summary and of --json (folklore_bytes null); folklore_bytes stays computed for the accuracy benchmark
    folklore_skipped: str = ""
    # --activation-offload: the saved tensors' host copies (mode, pinned, host_peak_bytes), apart from --offload's
    # host memory (``sharding``); None without it
    activation_host: dict | None = None
    # --images on a vision-language model: the processor's tokens per image, the batch's image tokens, the vision
    # tower's parameters and its share of the peak and of the activations (report/images.py); None without it
    images: dict | None = None

    def to_dict(self) -> dict:
        doc = asdict(self)
        if self.folklore_skipped:
            doc["folklore_bytes"] = None
        return doc


@dataclass(frozen=True)
class ReportParts:
    """What the estimator adds to a trace's own analysis (estimator.py gathers it; a trace alone has none)."""

    device: DeviceUsage | None = None
    trace_seconds: float = 0.0
    batch_factor: int = 1  # effective batch = batch x grad_accum x this (data-parallel ranks, --pp micro-batches)
    sharding: dict | None = None
    pipeline_stages: list | None = None
    expert_routing: list | None = None
    context_parallel_ranks: list | None = None
    notes_before: tuple[str, ...] = ()  # about the ranks traced (they lead)
    notes_after: tuple[str, ...] = ()  # about the source, the run and the device modelled
    image_facts: dict | None = None  # --images: what the processor makes of them (sources' image_facts)


def _ancestors(name: str, known: dict) -> list[str]:
    """The module itself and every enclosing module known in the model ('' is the model)."""
    out = [""]
    if name in known and name:
        parts = name.split(".")
        out += [".".join(parts[: i + 1]) for i in range(len(parts))]
    return out


def analyse(trace: Trace, spec: RunSpec, model_name: str, parts: ReportParts = ReportParts()) -> Report:
    """The Report of ``trace``, with what the estimator gathered (``parts``), in one constructor call."""
    peak, peak_i = trace.peak()
    storages = trace.storages
    peak_iter, peak_phase = trace.phase_at(peak_i)
    at_peak = trace.live_at(peak_i) if trace.events else set()
    peak_rec = storages[trace.events[peak_i][0]] if trace.events else None

    breakdown = dict.fromkeys(BREAKDOWN_KEYS, 0)
    other = {"buffers": 0, "inputs": 0}
    for sid in at_peak:
        rec = storages[sid]
        breakdown[_TO_BREAKDOWN[rec.category]] += rec.nbytes
        if rec.category in (Category.BUFFERS, Category.INPUTS):
            other[rec.category.value] += rec.nbytes

    last = spec.iterations
    per_module: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for sid, rec in enumerate(storages):
        module = trace.owner_module.get(sid, rec.module)
        keys = []
        if rec.category is Category.GRADIENTS and rec.iteration == last:
            keys.append("grad")
        elif rec.category is Category.OPTIMIZER_STATE:
            keys.append("optimizer")
        elif rec.category is Category.ACTIVATIONS and rec.iteration == last:
            keys.append("activation")
        if sid in at_peak:
            keys.append("at_peak")
        for anc in _ancestors(module, trace.modules):
            for key in keys:
                per_module[anc][key] += rec.nbytes

    layers = []
    for name, mod in trace.modules.items():
        stats = per_module.get(name, {})
        at = stats.get("at_peak", 0)
        layers.append(
            LayerRow(
                name=name,
                type=mod.type,
                depth=0 if name == "" else name.count(".") + 1,
                output_shape=mod.output_shape,
                params=mod.params,
                param_bytes=mod.param_bytes,
                grad_bytes=stats.get("grad", 0),
                optimizer_bytes=stats.get("optimizer", 0),
                activation_bytes=stats.get("activation", 0),
                bytes_at_peak=at,
                share_of_peak=at / peak if peak else 0.0,
            )
        )

    folklore, formula = _folklore(trace, spec)
    step_flops, recompute = _flops(trace, spec)
    return Report(
        model=model_name,
        model_type=trace.model_type,
        spec=spec.to_dict(),
        param_count=trace.param_count,
        param_bytes=trace.param_bytes,
        trainable_param_count=trace.trainable_count,
        peak_allocated_bytes=peak,
        peak_iteration=peak_iter,
        phase_at_peak=peak_phase.value,
        module_at_peak=peak_rec.module if peak_rec else "",
        op_at_peak=peak_rec.op if peak_rec else "",
        breakdown_at_peak=breakdown,
        other_at_peak=other,
        peak_by_phase=_peak_by(trace, lambda it, ph: ph.value),
        peak_by_iteration=_peak_by(trace, lambda it, ph: it),
        layers=layers,
        folklore_bytes=folklore,
        folklore_formula=formula,
        folklore_skipped=folklore_skipped(spec),
        trace_seconds=parts.trace_seconds,
        attention_backends=dict(trace.attention_backends),
        device=parts.device,
        effective_batch=spec.batch * spec.grad_accum * parts.batch_factor,
        step_flops=step_flops,
        recompute_flops=recompute,
        checkpointed=list(trace.checkpointed),
        sharding=parts.sharding,
        pipeline_stages=parts.pipeline_stages,
        expert_routing=parts.expert_routing,
        context_parallel_ranks=parts.context_parallel_ranks,
        notes=[*parts.notes_before, *trace.notes, *_loop_notes(trace, spec, peak_i), *parts.notes_after],
        outputs_held_bytes=trace.held_output_bytes(peak_i) if trace.events else 0,
        bounded_ops=dict(trace.bounded_ops),
        activation_host=_activation_host(trace, spec),
        images=images_summary(trace, parts.image_facts, spec.batch, last, at_peak, peak),
    )


def _activation_host(trace: Trace, spec: RunSpec) -> dict | None:
    """--activation-offload: the peak of the saved tensors' host copies (pinned host memory is page-locked)."""
    if spec.activation_offload == ActivationOffload.NONE:
        return None
    return {"mode": spec.activation_offload.value,
            "pinned": spec.activation_offload in (ActivationOffload.SAVE_ON_CPU_PINNED, ActivationOffload.TORCHTUNE,
                                                 ActivationOffload.TRL),
            "host_peak_bytes": trace.host_peak(saved=True), "rules": rules_source(spec.activation_offload)}


def _loop_notes(trace: Trace, spec: RunSpec, peak_i: int) -> list[str]:
    """Which training loop was traced (--outputs), what its outputs hold at the peak, and the loss head."""

    if not spec.training:
        return []
    if spec.outputs == Outputs.KEPT:
        held = trace.held_output_bytes(peak_i) if trace.events else 0
        note = (
            "loop: outputs kept (out = model(x); loss.backward(): out referenced until the next forward returns); "
            f"outputs held at the peak: {format_bytes(held)}"
        )
        if held > trace.peak()[0] // 200:  # half a percent of the peak or more
            note += " — --outputs freed if your loop drops them before backward, as HF Trainer and Lightning do"
    else:
        note = (
            "loop: outputs freed before backward (HF Trainer, Lightning, torchtune); a loop that keeps out = model(x) "
            "through backward needs more: --outputs kept"
        )
    return [note] + ([describe(spec)] if describe(spec) else [])


def _peak_by(trace: Trace, key) -> dict:
    out: dict = {}
    marks = trace.phase_marks
    live = 0
    mark_i, current = -1, key(0, Phase.SETUP)
    for i, (_, delta) in enumerate(trace.events):
        while mark_i + 1 < len(marks) and marks[mark_i + 1][0] <= i:
            mark_i += 1
            current = key(marks[mark_i][1], marks[mark_i][2])
            out[current] = max(out.get(current, -1), live)  # what is alive when the phase begins counts
        live += delta
        if live > out.get(current, -1):
            out[current] = live
    return out


def _flops(trace: Trace, spec: RunSpec) -> tuple[int, int]:
    """FLOPs of the last traced step, and the part that is recomputation: checkpointing re-runs the
    forward ops of the checkpointed modules in backward, so their forward FLOPs are counted twice (selective
    checkpointing: the ops its policy recomputes, ``trace.recompute_flops``)."""
    last = [(phase, module, n) for (it, phase, module), n in trace.flops.items() if it == spec.iterations]
    # accumulation: the tracer runs min(K, 2) identical micro-steps; a step has K of them
    traced = min(spec.grad_accum, TRACED_MICRO_STEPS) if spec.training else 1
    scale = spec.grad_accum / traced if spec.training else 1
    micro_phases = (Phase.FORWARD, Phase.LOSS, Phase.BACKWARD)
    total = sum(n * scale if phase in micro_phases else n for phase, _, n in last)
    recompute = sum(n for phase, module, n in last if phase is Phase.FORWARD and within(module, trace.checkpointed))
    if trace.recompute_flops is not None:  # selective checkpointing: only the ops its policy recomputes
        recompute = trace.recompute_flops
    return int(total), int(recompute * scale)


def folklore_skipped(spec: RunSpec) -> str:
    """Why the folklore formula (one device training every parameter with its optimizer) does not apply to
    ``spec``; '' where it does."""
    if not spec.training:
        return f"--mode {spec.mode}: the formula counts gradients and optimizer state a {spec.mode} step does not hold"
    if spec.lora or spec.quant != Quant.NONE:
        return ("LoRA / quantized base: the formula counts every weight at its stored size as trained, with its "
                "gradient and optimizer state")
    if spec.world_size > 1:
        return ("a per-rank figure of a parallel run: the formula is for one device holding the whole step (no "
                "sharding, no communication buffers)")
    return ""


def _folklore(trace: Trace, spec: RunSpec) -> tuple[int, str]:
    """The rule of thumb memest is checked against: params x n + batch x layer outputs x 2."""
    n = FOLKLORE_N[spec.optim]
    parents = {name.rpartition(".")[0] for name in trace.modules if name}
    leaves = [m for name, m in trace.modules.items() if name not in parents]
    outputs = sum(m.output_bytes * max(m.calls, 1) for m in leaves)
    return trace.param_bytes * n + outputs * 2, f"params x {n} + layer outputs x 2"

"""`memest advise`: the classic memory savers, each re-traced against a budget, ranked by what they
cost in time, and the cheapest combination that fits with the command line that reproduces it.

Time costs are what the trace can price: recomputed FLOPs for checkpointing (flop counter formulas),
communication volume per step for sharding, PCIe volume for offload; "0% FLOPs" for the optimizer
and precision swaps (they change numerics or dynamics, not work), for accumulation (same work in
smaller kernels), for freeing the outputs before backward (a loop change), for the optimizer step in
backward (the same steps, each parameter's in its gradient's hook; no accumulation, no whole-model
clipping) and for the chunked and fused loss heads of causal LMs (the same matmuls in chunks; Liger
computes the head's gradients in forward instead of recomputing, features/loss_head.py).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass, field

from memest.errors import MemestError
from memest.features import grpo
from memest.features.checkpointing import repeated_blocks
from memest.features.compiled import unwrap
from memest.features.loss_head import causal_lm_head
from memest.features.preference import reference_of
from memest.plan.parallel import plan_parallel
from memest.plan.runner import Runner
from memest.spec import RunSpec
from memest.spec.choices import CompileScope, Optimizer, Outputs, Precision, Preference, Reference, Target
from memest.spec.options import command_line
from memest.trace.values import PlaceholderScalars
from memest.units import format_bytes, plural


@dataclass
class Remedy:
    name: str
    changes: dict  # RunSpec fields changed from the base
    needed_bytes: int
    fits: bool
    time_cost: str
    cost_rank: float  # lower is cheaper
    note: str = ""  # for a change that does not lower the need: why (what grows at its peak)
    lowers_need: bool = True  # False: needs as much as the base or more; listed, never recommended
    derived: bool = False  # a layout from plan-parallel's planner (need derived from cut-depth traces); not combined
    command: str = ""  # the `memest estimate` command line that reproduces it

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Advice:
    base_needed_bytes: int
    capacity_bytes: int
    base_fits: bool
    remedies: list[Remedy] = field(default_factory=list)
    combination: Remedy | None = None
    command: str = ""
    traces: int = 0
    parallel: dict | None = None  # advise --gpus: the planner's run (gpus, seconds, traces, check, notes)
    skipped: list[dict] = field(default_factory=list)  # savers whose trace fails on this step: {name, changes, reason}
    not_offered: list[dict] = field(default_factory=list)  # savers not traced on this kind of step: {name, reason}

    def to_dict(self) -> dict:
        return asdict(self)


# the remedies that change the training method (features/finetune.py): adapters on every linear layer, as
# QLoRA (Dettmers et al. 2023, arXiv:2305.14314) found needed to match 16-bit fine-tuning
LORA = "r=16,alpha=32,dropout=0.05,targets=all-linear"
LORA_CAVEAT = ("trains only the adapters: a different method from full fine-tuning, whose quality can trail it on "
               "harder tasks (LoRA Learns Less and Forgets Less, Biderman et al. 2024, arXiv:2405.09673)")
QLORA_CAVEAT = ("4-bit NF4 base: QLoRA matched 16-bit LoRA in its paper (Dettmers et al. 2023) but the base's "
                "weights are rounded; each layer is dequantised in forward and backward (slower steps); needs "
                "bitsandbytes on a CUDA GPU")


def _peft_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("peft") is not None


def _model_traits(runner: Runner) -> tuple[bool, bool, bool]:
    """(has repeated blocks or transformers' checkpointing switch, is a causal LM whose head
    --loss-head can replace, the step is torch.compile'd), from one build of the model on fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode


    with FakeTensorMode(), PlaceholderScalars():
        model, request = unwrap(runner.source.build_model())
    compiled = runner.base.compile if runner.base.compile is not None else request is not None
    blocks = bool(repeated_blocks(model)) or getattr(model, "supports_gradient_checkpointing", False)
    try:
        causal_lm_head(model)
        causal_lm = True
    except MemestError:
        causal_lm = False
    return blocks, causal_lm, compiled


def _recompute_pct(result) -> float:
    r = result.report
    base = r.step_flops - r.recompute_flops
    return 100 * r.recompute_flops / base if base else 0.0


# why advise offers no sharding for a step compiled whole (spec/run.py _check_compile_parallel refuses it)
WHOLE_STEP_SHARDING = ("not traced with the whole step compiled (FSDP2's collectives would be traced into its graph); "
                       "with --compile-scope blocks it is")


def candidates(runner: Runner, not_offered: list[dict] | None = None) -> list[tuple[str, dict, float]]:
    """(name, changes, rank) of the remedies that apply to the base spec. ``not_offered``: where given, a saver
    that cannot be traced on this kind of step at all gets ``{name, reason}`` there (said in one line, not skipped
    in silence)."""
    base = runner.base
    out: list[tuple[str, dict, float]] = []
    blocks, causal_lm, compiled = _model_traits(runner) if base.training else (False, False, False)
    if base.training and base.outputs == Outputs.KEPT:
        out.append(("free outputs before backward", {"outputs": "freed"}, 0.0))
    # a compiled step with a replaced head is refused (features/compiled.py: the head's forward would run eager)
    if base.training and base.loss_head == "standard" and causal_lm and not compiled:
        out.append(("chunked LM head + cross-entropy (torchtune)", {"loss_head": "chunked"}, 0.03))
        out.append(("chunked logits, fp32 upcast per chunk (torchtune CEWithChunkedOutputLoss, axolotl "
                    "chunked_cross_entropy)", {"loss_head": "chunked-output"}, 0.035))
        out.append(("fused linear cross-entropy (Liger-Kernel)", {"loss_head": "fused"}, 0.04))
    if base.precision == Precision.FP32 and base.target == Target.CUDA:
        out.append(("bf16 mixed precision", {"precision": "bf16-mixed"}, -0.1))
    # a spec it cannot apply to is refused: the whole step compiled (--compile-scope blocks keeps the hooks eager)
    if base.training and not base.optim_in_backward and (not compiled or base.compile_scope == CompileScope.BLOCKS):
        out.append(("optimizer step in backward (torchtune optimizer_in_bwd)", {"optim_in_backward": True}, 0.01))
    if base.optim in (Optimizer.ADAM, Optimizer.ADAMW):
        out.append(("8-bit Adam", {"optim": "adam8bit"}, 0.01))
        out.append(("Adafactor", {"optim": "adafactor"}, 0.02))
    # checkpointing inside a step compiled whole is refused (features/compiled.py: the RNG state fake tensors cannot
    # hold); each block checkpointed, then compiled (--compile-scope blocks, torchtitan's order) is traced
    blocks_scope = compiled and base.compile_scope == CompileScope.BLOCKS
    if base.checkpointing == "none" and base.training and blocks and (not compiled or blocks_scope):
        out.append(("activation checkpointing", {"checkpointing": "blocks"}, 0.2))
        # torchtitan's op-level SAC: keeps the matmuls' outputs, so it recomputes less and saves less than blocks
        out.append(("selective activation checkpointing (torchtitan's op policy)", {"checkpointing": "selective"}, 0.15))
    k = 2
    smallest = 2 if base.preference == Preference.KTO else 1  # trl's KTOTrainer refuses a micro-batch of 1
    while base.batch // k >= smallest and base.batch % k == 0 and k <= 64:
        out.append((f"micro-batch {base.batch // k} x {k} accumulation",
                    {"batch": base.batch // k, "grad_accum": base.grad_accum * k}, 0.02 * math.log2(k)))
        k *= 2
    if base.training:
        out += _state_candidates(compiled, blocks_scope, not_offered)
    if base.training and causal_lm and not base.lora and _peft_available():
        out.append(("LoRA r=16 on every linear layer (peft)", {"lora": LORA}, 0.8))
        out.append(("QLoRA: NF4 base + LoRA r=16 (bitsandbytes + peft)", {"lora": LORA, "quant": "nf4"}, 0.9))
    if base.preference == Preference.GRPO:
        return out + _grpo_candidates(base)
    if base.preference.has_reference and reference_of(base) != Reference.PRECOMPUTED:  # dpo, kto
        out.append(("precomputed reference log-probs (trl precompute_ref_log_probs=True)",
                    {"reference": Reference.PRECOMPUTED}, 0.05))
    if base.preference.has_reference and reference_of(base) == Reference.COPY and _peft_available():
        out.append(("LoRA r=16 with its adapter-disabled base as the reference (trl + peft)",
                    {"lora": LORA, "reference": Reference.ADAPTER}, 0.7))
    if base.seq and base.seq >= 256:
        out.append((f"shorter sequence ({base.seq // 2})", {"seq": base.seq // 2}, 1.0))
    return out + _pixels_candidates(runner)


def _state_candidates(compiled: bool, blocks_scope: bool, not_offered: list[dict] | None) -> list[tuple[str, dict, float]]:
    """Sharding and optimizer offload. Sharding a compiled step is traced with each block compiled (--compile-scope
    blocks, then FSDP2: torchtitan's order; spec/run.py _check_compile_parallel), not with the whole step compiled."""
    out: list[tuple[str, dict, float]] = []
    if not compiled or blocks_scope:
        for n in (2, 4, 8):
            out.append((f"ZeRO-3 / FSDP over {n} GPUs", {"world_size": n, "shard": "zero3"}, 0.3 + 0.05 * n))
    elif not_offered is not None:
        not_offered.append({"name": "ZeRO-3 / FSDP", "reason": WHOLE_STEP_SHARDING})
    if not compiled:
        out.append(("CPU offload of the optimizer", {"offload": "optimizer"}, 0.5))
    return out


def _pixels_candidates(runner: Runner) -> list[tuple[str, dict, float]]:
    """Qwen2-VL with --images / --video-frames: max_pixels lowered to a quarter of the largest resized image or
    frame (half the resolution each way), offered where it cuts the image or video tokens (sources/hf_qwen_vl.py)."""
    base = runner.base
    if not (base.images or base.video_frames) or runner.source.image_facts is None:
        return []
    hw = base.input_hw
    facts = runner.source.image_facts(base.images, hw, **base.vision_options)
    if facts.get("max_pixels") is None:  # a processor without the rule (LLaVA's fixed tiles)
        return []
    sizes = ([facts["resized"]] if base.images else []) + ([facts["video"]["resized"]] if facts.get("video") else [])
    largest = max(math.prod(int(side) for side in size.split("x")) for size in sizes)
    lower = largest // 4
    if base.min_pixels and base.min_pixels > lower:
        return []
    after = runner.source.image_facts(base.images, hw, **{**base.vision_options, "max_pixels": lower})
    if _vision_tokens(after) >= _vision_tokens(facts):
        return []
    return [(f"lower max_pixels to {lower:,} ({_vision_tokens(facts)} -> {_vision_tokens(after)} image and video "
             "tokens per example)", {"max_pixels": lower}, 0.9)]


def _vision_tokens(facts: dict) -> int:
    """Image and video tokens per example."""
    video = facts.get("video")
    return facts["per_example"] * facts["tokens_per_image"] + (video["tokens_per_video"] if video else 0)


def _pixels_time_cost(base: RunSpec, result) -> str:
    """What lowering max_pixels costs: fewer image tokens, each image seen at a lower resolution."""
    im = result.report.images
    parts = []
    if base.images:
        parts.append(f"{im['tokens_per_image']} tokens per image ({im['size']} resized to {im['resized']})")
    if im.get("video"):
        parts.append(f"{im['video']['tokens_per_video']} per video (frames resized to {im['video']['resized']})")
    return ("fewer image tokens, lower resolution: " + "; ".join(parts)
            + "; the model sees less detail (Qwen2-VL processor min_pixels/max_pixels)")


def _grpo_candidates(base: RunSpec) -> list[tuple[str, dict, float]]:
    """trl GRPOTrainer's own savers (features/grpo.py): fewer completions per prompt, shorter completions, no
    reference model (trl's default beta 0.0), each re-traced."""
    out: list[tuple[str, dict, float]] = []
    g, length = grpo.generations_of(base), grpo.completion_len_of(base)
    if g // 2 >= 2 and base.batch % 2 == 0 and (base.batch // 2) % (g // 2) == 0:
        out.append((f"fewer generations per prompt ({g // 2}), the same prompts per step (trl num_generations)",
                    {"generations": g // 2, "batch": base.batch // 2}, 0.3))
    if length >= 2:
        out.append((f"shorter completions ({length // 2} tokens, trl max_completion_length)",
                    {"completion_len": length // 2}, 0.6))
    if base.reference != Reference.AUTO:
        out.append(("no reference model (trl's default beta 0.0)", {"reference": Reference.AUTO}, 0.4))
    if base.seq and base.seq >= 256:
        out.append((f"shorter prompts ({base.seq // 2})", {"seq": base.seq // 2}, 1.0))
    return out


def _grpo_time_cost(changes: dict, base: RunSpec) -> str | None:
    if "generations" in changes:
        return (f"each prompt's group baseline from {changes['generations']} samples instead of "
                f"{grpo.generations_of(base)} (noisier advantages); half the completions per step, the same prompts")
    if "completion_len" in changes:
        return (f"completions stop at {changes['completion_len']} tokens: longer answers are truncated (trl "
                "mask_truncated_completions decides whether they still count)")
    if changes.get("reference") == Reference.AUTO:
        return "no KL penalty to the reference policy (trl GRPOConfig beta=0.0, its default); one forward less per step"
    return None


def _preference_time_cost(changes: dict, base: RunSpec) -> str | None:
    """The cost of a preference-training remedy (trl's reference handling, GRPO's own savers), or None."""
    if base.preference == Preference.GRPO and (cost := _grpo_time_cost(changes, base)):
        return cost
    if changes.get("reference") == Reference.PRECOMPUTED:
        trainer = "KTOTrainer" if base.preference == Preference.KTO else "DPOTrainer"
        return (f"before training, one reference forward over the whole dataset (trl {trainer}._precompute_ref_logps); "
                "each step then runs no reference forward and, without peft, no reference model is kept")
    if changes.get("reference") == Reference.ADAPTER:
        return ("the reference forward runs the policy's base with the adapter disabled (trl use_adapter); "
                + LORA_CAVEAT)
    return None


def _time_cost(name: str, changes: dict, result, base: RunSpec) -> str:
    if cost := _preference_time_cost(changes, base):
        return cost
    if "outputs" in changes:
        return "0% FLOPs; a loop change: del the output (logits) before loss.backward()"
    if changes.get("loss_head") == "chunked":
        return "0% FLOPs (the head's matmuls in 8 chunks); torchtune LinearCrossEntropyLoss"
    if changes.get("loss_head") == "chunked-output":
        return ("0% FLOPs (the head's matmul and cross-entropy in 8 chunks); torchtune CEWithChunkedOutputLoss, "
                "axolotl chunked_cross_entropy: true")
    if changes.get("loss_head") == "fused":
        return ("0% FLOPs (head gradients computed in forward, no recompute); needs liger-kernel "
                "(Triton, CUDA): apply_liger_kernel_to_<model>(fused_linear_cross_entropy=True)")
    if "checkpointing" in changes:
        return f"+{_recompute_pct(result):.0f}% FLOPs (recompute)"
    if "shard" in changes:
        n = changes["world_size"]
        volume = 3 * result.report.param_bytes * (n - 1) / n  # all-gather fwd + bwd, reduce-scatter
        return f"~{format_bytes(volume)} collectives per step per rank; needs {n} GPUs"
    if "offload" in changes:
        return f"~{format_bytes(2 * result.report.param_bytes)} over PCIe per step (grads out, params in)"
    if "seq" in changes:
        return "changes the task (shorter context)"
    if "max_pixels" in changes:
        return _pixels_time_cost(base, result)
    if "lora" in changes:
        r = result.report
        share = 100 * r.trainable_param_count / r.param_count if r.param_count else 0.0
        trains = f"{r.trainable_param_count:,} trainable parameters ({share:.2f}% of {r.param_count:,}); "
        return trains + (QLORA_CAVEAT + "; " if "quant" in changes else "") + LORA_CAVEAT
    if "precision" in changes:
        return "faster on tensor cores; changes numerics"
    if "optim_in_backward" in changes:
        return ("0% FLOPs (the same optimizer, one parameter at a time in its backward hook); no gradient "
                "accumulation, no clipping over the whole model's gradients")
    if "optim" in changes:
        return "0% FLOPs; changes optimizer dynamics"
    return "0% FLOPs (same work in smaller kernels)"


def advise(runner: Runner, capacity: int, gpus: int | None = None, budget_label: str = "",
           command_options: dict | None = None) -> Advice:
    """Every saver re-traced. A change that does not lower the need is listed with why, never ranked
    as a remedy; when the base already fits nothing is recommended. ``gpus``: also the best layouts of
    that many GPUs from plan-parallel's planner (hf: models), priced per rank and in bytes sent per step.
    ``command_options``: estimate's own options (gpu=, calibration=) every remedy's command line adds."""
    extra = command_options or {}
    base = runner.run()
    advice = Advice(base.needed_bytes, capacity, base.fits(capacity))
    if gpus:
        advice.remedies += parallel_remedies(runner, capacity, gpus, budget_label, advice, extra)
    for name, changes, rank in candidates(runner, advice.not_offered):
        try:
            spec = dataclasses.replace(runner.base, **changes)
        except MemestError:
            continue  # the saver contradicts the base's own options (e.g. ZeRO-3 over 2 GPUs of a --tp 2 run)
        try:
            result = runner.run(**changes)
        except MemestError as exc:  # a saver the user never asked for fails on this step: skip it, say why
            advice.skipped.append({"name": name, "changes": changes, "reason": str(exc)})
            continue
        remedy = Remedy(name, changes, result.needed_bytes, result.fits(capacity),
                        _time_cost(name, changes, result, runner.base), rank, command=command_line(spec, **extra))
        if result.needed_bytes >= base.needed_bytes:
            remedy.lowers_need = False
            remedy.note = why_not_lower(base, result)
        advice.remedies.append(remedy)
    for remedy in advice.remedies:
        if remedy.derived and remedy.needed_bytes >= base.needed_bytes:
            remedy.lowers_need = False
            remedy.note = "per rank, the layout needs as much as one GPU running the whole step"
    advice.remedies.sort(key=lambda r: (not r.lowers_need, not r.fits, r.cost_rank, r.needed_bytes))
    if not advice.base_fits:
        usable = [r for r in advice.remedies if r.lowers_need and (r.fits or not r.derived)]
        advice.combination = _cheapest_combination(runner, capacity, usable)
    if advice.combination is not None:
        if not advice.combination.command:  # a combination of several remedies
            spec = dataclasses.replace(runner.base, **advice.combination.changes)
            advice.combination.command = command_line(spec, **extra)
        advice.command = advice.combination.command
    advice.traces = runner.traces + (advice.parallel or {}).get("traces", 0)
    return advice


PARALLEL_LAYOUTS = 3  # the planner's best layouts offered as remedies


def parallel_remedies(runner: Runner, capacity: int, gpus: int, budget_label: str, advice: Advice,
                      extra: dict | None = None) -> list[Remedy]:
    """The planner's best layouts of ``gpus`` GPUs (plan/parallel.py: the same traces and extrapolation as
    `memest plan-parallel`), each priced in memory per rank and in bytes each rank sends per step."""

    if not runner.base.model.startswith("hf:"):
        advice.parallel = {"gpus": gpus, "error": "--gpus: plan-parallel lays out hf: models (their depth is cut)"}
        return []
    base = dataclasses.replace(runner.base, seq=runner.base.seq or runner.source.default_seq)
    try:
        plan = plan_parallel(base.model, gpus, capacity, budget_label, base, calibration=runner.calibration,
                             progress=runner.progress, top=PARALLEL_LAYOUTS)
    except MemestError as exc:  # the planner cannot lay this model out: the other savers still stand
        advice.parallel = {"gpus": gpus, "error": str(exc)}
        return []
    advice.parallel = {"gpus": gpus, "seconds": plan.seconds, "traces": plan.traces, "check": plan.check, "notes": plan.notes}
    out = []
    for i, lay in enumerate([lay for lay in plan.layouts if lay.traced and not lay.error and not lay.lower_bound][:PARALLEL_LAYOUTS]):
        out.append(Remedy(
            f"{lay.name} on {plural(gpus, 'GPU')} (plan-parallel)", lay.changes(), lay.needed_bytes, lay.fits,
            f"~{format_bytes(lay.comm_bytes)} sent per step per rank; needs {plural(gpus, 'GPU')}; per-rank need from {lay.derived_from}",
            0.3 + 0.05 * gpus + 0.001 * i, derived=True, command=command_line(lay.spec(base), **(extra or {})),
        ))
    return out


def why_not_lower(base, result) -> str:
    """What grows at the changed step's peak, from the two traces' breakdowns at their peaks."""
    b, r = base.report, result.report
    growth = {k: r.breakdown_at_peak.get(k, 0) - b.breakdown_at_peak.get(k, 0) for k in r.breakdown_at_peak}
    key, grew = max(growth.items(), key=lambda kv: kv[1])
    where = f"peak in {r.phase_at_peak}" + (f" (was {b.phase_at_peak})" if r.phase_at_peak != b.phase_at_peak else "")
    if grew <= 0:
        return f"{where}; allocator rounding and cached blocks add {format_bytes(result.needed_bytes - base.needed_bytes)}"
    return f"{where}: {key.replace('_', ' ')} +{format_bytes(grew)} at the peak"


def _cheapest_combination(runner: Runner, capacity: int, remedies: list[Remedy]) -> Remedy | None:
    """Greedy, cheapest first: add remedies (one accumulation step, one sharding width at a time)
    until the traced step fits."""
    singles = [r for r in remedies if r.fits]
    if singles:
        return singles[0]
    ordered = sorted(remedies, key=lambda r: r.cost_rank)
    changes: dict = {}
    seen_keys: set[str] = set()
    for remedy in ordered:
        keys = set(remedy.changes)
        if keys & seen_keys and not ({"batch", "grad_accum"} >= keys or {"world_size", "shard"} >= keys):
            continue  # e.g. a second optimizer swap
        trial = {**changes, **remedy.changes}
        try:
            result = runner.run(**trial)
        except MemestError:  # these savers do not combine on this step: go on without this one
            continue
        changes = trial
        seen_keys |= keys
        if result.fits(capacity):
            names = [r.name for r in ordered if set(r.changes.items()) <= set(changes.items())]
            return Remedy(" + ".join(names), changes, result.needed_bytes, True, "see the remedies above",
                          sum(r.cost_rank for r in ordered if r.name in names))
    return None

"""`memest plan-parallel MODEL --gpus G --gpu CARD`: the dp x tp (x pp) layouts of G GPUs, each rank's
need, the layouts that fit ranked by communication volume per step.

A 70B model cannot be traced once per layout in a minute on a laptop, so each layout is traced on the
same model cut to a few layers (the config's ``num_hidden_layers``), and the per-rank peak is taken as
affine in the layer count: peak(L) = a + b * L from 2 and 4 layers per stage, extrapolated to the
model's L. The first layout is checked against a direct trace at 3 layers per stage (``check``). The need adds what a step needs above its peak allocated (allocator
rounding, CUDA context, libraries: device/usage.py) as traced at depth 2k.

Layouts: tp in 1, 2, 4, 8 (within one NVLink node; it must divide the attention and key/value heads),
dp = G / tp with FSDP2 full shard (--shard zero3) when dp > 1, TP with sequence parallel where the
model takes torchtitan's plan; and pipeline-only layouts pp = G (one stage per GPU, 1F1B, M = pp
micro-batches) when G <= L, and pipeline x FSDP2 x TP layouts pp x dp x tp = G (``pipeline_layouts``).

Communication volume per step and rank (bytes sent, ring algorithms; what ranks the layouts):
  FSDP (dp > 1): 2 all-gathers of the rank's parameters in their compute dtype + 1 reduce-scatter of
    its gradients in fp32, each (dp - 1) / dp of the unsharded size (ZeRO paper, Rajbhandari et al.
    2020, section 7: 3 x the parameters for ZeRO-3);
  TP: 4 all-reduces of a layer's activations (b x s x h) per layer per step, each 2 (tp - 1) / tp of the
    size (Megatron-LM, Narayanan et al. 2021, section 3.2: 2 in forward, 2 in backward; sequence
    parallel replaces each by an all-gather + reduce-scatter of the same volume, Korthikanti et al. 2022);
  PP: per micro-batch one activation sent forward and one gradient sent back at each stage boundary
    (Narayanan et al. 2021, section 3.2), b x s x h each.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import MemestError
from ..spec import RunSpec

# traced depths per stage. At 1 layer the peak can sit elsewhere (llama-tiny: -10% at 3 from 1 and 2), and
# successive layers' increments alternate (llama-2-70b, FSDP 8: fit on 2 and 3 was +4.8% at 4), so the
# slope is taken over two layers, and the check interpolates at 3
LOW, HIGH = 2, 4
TP_SIZES = (1, 2, 4, 8)  # tensor parallel stays inside one node (8 GPUs over NVLink), Megatron's guidance


@dataclass
class Layout:
    dp: int
    tp: int
    pp: int
    sp: bool
    needed_bytes: int = 0
    peak_bytes: int = 0
    comm_bytes: int = 0
    fits: bool = False
    verdict: str = ""
    derived_from: str = ""
    error: str = ""
    ep: int = 1  # expert parallel (MoE): experts over ep of the dp ranks (expert_layouts)

    @property
    def name(self) -> str:
        parts = [f"dp {self.dp}", f"tp {self.tp}" + (" + sp" if self.sp else ""), f"pp {self.pp}"]
        return " x ".join(parts) + (f" (ep {self.ep})" if self.ep > 1 else "")

    def command(self, model: str, base: RunSpec) -> str:
        flags = [f"--world-size {self.dp * self.tp * self.pp}"]
        if self.tp > 1:
            flags.append(f"--tp {self.tp}" + (" --sp" if self.sp else ""))
        if self.dp > 1:
            flags.append("--shard zero3")
        if self.pp > 1:
            flags.append(f"--pp {self.pp}")
        if self.ep > 1:
            flags.append(f"--ep {self.ep}")
        return f"memest estimate {model} --batch {base.batch} --seq {base.seq} --precision {base.precision} --optim {base.optim} " + " ".join(flags)


@dataclass
class ParallelPlan:
    model: str
    gpus: int
    budget_bytes: int
    budget_label: str
    base: dict
    layers: int
    layouts: list[Layout] = field(default_factory=list)
    check: dict | None = None  # the extrapolation checked against a direct trace
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _config(model: str) -> tuple[dict, Path]:
    from ..sources.hf import _config_path

    if not model.startswith("hf:"):
        raise MemestError("plan-parallel takes hf: models (their depth is cut to trace each layout in seconds)")
    path = _config_path(model[3:])
    if path is None:
        raise MemestError(f"{model}: plan-parallel needs a config file (bundled name or path), not a Hub id")
    return json.loads(path.read_text()), path


def layouts_for(gpus: int, config: dict) -> list[Layout]:
    heads = config.get("num_attention_heads", 1)
    kv = config.get("num_key_value_heads") or heads
    out = []
    for tp in TP_SIZES:
        if gpus % tp or heads % tp or kv % tp:
            continue
        out.append(Layout(dp=gpus // tp, tp=tp, pp=1, sp=tp > 1))
    return out + pipeline_layouts(gpus, config) + expert_layouts(gpus, config)


def pipeline_layouts(gpus: int, config: dict) -> list[Layout]:
    """The pipeline layouts of ``gpus``: pp x dp x tp = gpus with 2 <= pp <= the model's layers, tp as for
    the layouts above, each stage sharded with FSDP2 over dp (trace/distributed._pipeline; without
    sequence parallel, which is not traced with a pipeline), 1F1B with M = pp micro-batches."""
    heads = config.get("num_attention_heads", 1)
    kv = config.get("num_key_value_heads") or heads
    out = []
    for pp in range(2, min(gpus, config["num_hidden_layers"]) + 1):
        for tp in TP_SIZES:
            if gpus % (pp * tp) == 0 and not heads % tp and not kv % tp:
                out.append(Layout(dp=gpus // (pp * tp), tp=tp, pp=pp, sp=False))
    return out


# -- expert parallel (MoE) -------------------------------------------------------------------------
# ep within one node, so the all-to-all stays on NVLink: transformers' suggestion (distributed/utils.py,
# TransformersDeviceMesh: "default ep to node width (8 on most machines) so that all-to-all never leaves the node")
EP_SIZES = (2, 4, 8)


def _experts(config: dict) -> tuple[int, int]:
    """(routed experts per MoE layer, experts per token); (0, 0) for a dense model."""
    experts = config.get("num_local_experts") or config.get("num_experts") or config.get("n_routed_experts") or 0
    return experts, config.get("num_experts_per_tok") or 0


def expert_layouts(gpus: int, config: dict) -> list[Layout]:
    """MoE models: FSDP over every GPU with the experts divided over ep of them (--ep; trace/expert_parallel.py)."""
    experts, _ = _experts(config)
    return [Layout(dp=gpus, tp=1, pp=1, sp=False, ep=ep) for ep in EP_SIZES if experts and not experts % ep and not gpus % ep]


def expert_comm_bytes(layout: Layout, config: dict, base: RunSpec, act: int) -> tuple[int, int]:
    """(bytes each rank sends per step in the all-to-alls, the routed experts' parameters). Per MoE layer 4
    all-to-alls (dispatch and combine in the forward, their two in the backward) of tokens x top-k rows of the
    hidden size, (ep - 1) / ep of them leaving the rank at uniform routing (transformers' AllToAllEP)."""
    experts, top_k = _experts(config)
    h = config["hidden_size"]
    inter = config.get("moe_intermediate_size") or config.get("intermediate_size") or 0
    moe_layers = config["num_hidden_layers"] - (config.get("first_k_dense_replace") or 0)
    tokens = base.batch * (base.seq or 1)
    sent = moe_layers * 4 * tokens * top_k * h * act * (layout.ep - 1) / layout.ep
    return int(sent), moe_layers * experts * 3 * h * inter


def comm_bytes(layout: Layout, config: dict, base: RunSpec, param_count: int) -> int:
    """Bytes each rank sends per step (module docstring)."""
    h, layers = config["hidden_size"], config["num_hidden_layers"]
    act = 2 if base.precision in ("bf16", "fp16", "bf16-mixed", "fp16-mixed") else 4
    tokens = base.batch * (base.seq or 1)
    total = 0
    if layout.ep > 1:  # the experts' FSDP runs over dp / ep copies of each expert group, the rest over dp
        sent, expert_params = expert_comm_bytes(layout, config, base, act)
        copies = layout.dp // layout.ep
        total += sent + (copies - 1) / copies * expert_params / layout.ep * (2 * act + 4)
        param_count = max(param_count - expert_params, 0)
    if layout.dp > 1:  # a pipeline rank holds its stage's 1/pp of the parameters
        share = param_count / (layout.tp * layout.pp)
        frac = (layout.dp - 1) / layout.dp
        total += frac * share * (2 * act + 4)
    if layout.tp > 1:  # a pipeline rank's layers, for each of its M = pp micro-batches
        total += layers / layout.pp * max(1, layout.pp) * 4 * 2 * (layout.tp - 1) / layout.tp * tokens * h * act
    if layout.pp > 1:
        total += 2 * layout.pp * tokens * h * act  # M = pp micro-batches of --batch, forward + backward
    return int(total)


def plan_parallel(model: str, gpus: int, budget: int, budget_label: str, base: RunSpec, calibration=None,
                  progress=None, check: bool = True) -> ParallelPlan:
    from ..pipeline import _estimate_one, estimate
    from ..sources import load_source

    start = time.perf_counter()
    config, _ = _config(model)
    layers = config["num_hidden_layers"]
    plan = ParallelPlan(model, gpus, budget, budget_label, base.to_dict(), layers)
    param_count = None
    with tempfile.TemporaryDirectory(prefix="memest-plan-") as tmp:
        sources: dict[int, object] = {}

        def source(depth: int):
            if depth not in sources:
                path = Path(tmp) / f"depth{depth}" / "config.json"
                path.parent.mkdir()
                path.write_text(json.dumps({**config, "num_hidden_layers": depth}))
                sources[depth] = load_source(f"hf:{path}")
            return sources[depth]

        def run(layout: Layout, depth_per_stage: int):
            # a pipeline's first and last stages are traced with their layers, the middle ones left empty
            # (what a stage holds depends on its own layers and its place in the schedule, not on theirs)
            depth = depth_per_stage * min(layout.pp, 2)
            spec = dataclasses.replace(
                base, model=f"hf:{Path(tmp) / f'depth{depth}' / 'config.json'}",
                world_size=layout.dp * layout.tp * layout.pp, tp=layout.tp, sp=layout.sp, pp=layout.pp, ep=layout.ep,
                shard="zero3" if layout.dp > 1 else "none",
                pp_split=",".join([str(depth_per_stage)] + ["0"] * (layout.pp - 2) + [str(depth_per_stage)]) if layout.pp > 1 else "",
            )
            src = source(depth)
            if layout.ep > 1:  # the expected need: uniform routing (estimate's range adds the one-rank high end)
                return _estimate_one(dataclasses.replace(spec, seq=spec.seq or src.default_seq), calibration, src)
            if layout.pp == 1:
                return estimate(spec, calibration=calibration, source=src)
            # the first stage (embedding; 1F1B: the most micro-batches in flight, by the schedule's own order,
            # trace/pipeline_schedule.py) and the last (head and logits); a middle stage holds the same layers
            # with fewer micro-batches in flight
            ends = [_estimate_one(dataclasses.replace(spec, seq=spec.seq or src.default_seq, pp_stage=i), calibration, src)
                    for i in (0, layout.pp - 1)]
            return max(ends, key=lambda e: e.needed_bytes)

        for i, layout in enumerate(layouts_for(gpus, config)):
            if progress:
                progress(f"plan-parallel {i + 1}: {layout.name}")
            try:
                try:
                    one, two = run(layout, LOW), run(layout, HIGH)
                except MemestError:
                    if not layout.sp:
                        raise
                    layout.sp = False  # not a Llama-style decoder: transformers' own plan, without SP
                    one, two = run(layout, LOW), run(layout, HIGH)
            except MemestError as exc:
                layout.error = str(exc)
                plan.layouts.append(layout)
                continue
            if param_count is None and layout.pp == 1:  # pipeline layouts come last
                param_count = _param_count(one, two, layers)
            per_stage = layers / layout.pp
            slope = (two.report.peak_allocated_bytes - one.report.peak_allocated_bytes) / (HIGH - LOW)
            layout.peak_bytes = int(one.report.peak_allocated_bytes + slope * (per_stage - LOW))
            layout.needed_bytes = layout.peak_bytes + (two.needed_bytes - two.report.peak_allocated_bytes)
            layout.derived_from = f"depths {LOW} and {HIGH} per stage, affine in layers"
            if plan.check is None and check:
                mid = run(layout, LOW + 1)
                predicted = int(one.report.peak_allocated_bytes + slope)
                real = mid.report.peak_allocated_bytes
                plan.check = {"layout": layout.name, "depth_per_stage": LOW + 1, "predicted_peak_bytes": predicted,
                              "traced_peak_bytes": real, "error": (predicted - real) / real}
            layout.comm_bytes = comm_bytes(layout, config, base, param_count or 0)
            layout.fits = layout.needed_bytes <= budget
            layout.verdict = "fits" if layout.fits else "does-not-fit"
            plan.layouts.append(layout)
    plan.layouts.sort(key=lambda lay: (bool(lay.error), not lay.fits, lay.comm_bytes if lay.fits else lay.needed_bytes))
    plan.seconds = time.perf_counter() - start
    plan.notes.append(
        f"per-rank need derived from traces of the model cut to {LOW} and {HIGH} layers per stage (affine in layers), "
        f"checked once against a {LOW + 1}-layer trace; communication volume per step from the ZeRO and Megatron-LM papers' "
        "counts (memest/plan/parallel.py)"
    )
    if any(lay.pp > 1 for lay in plan.layouts):
        plan.notes.append(
            "pipeline layouts: 1F1B with M = pp micro-batches of --batch, each stage FSDP2-sharded over dp and TP over tp; "
            "the first and the last stage traced (middle stages hold fewer micro-batches of the same layers, as walking "
            "torch's Schedule1F1B order gives, and neither embedding nor head)"
        )
    if any(lay.ep > 1 for lay in plan.layouts):
        plan.notes.append(
            "expert-parallel layouts (ep): traced with uniform routing, the expected need; all tokens routed to one rank "
            "needs more (memest estimate --ep shows that range); all-to-all volume at uniform routing"
        )
    plan.notes.append("not searched: pipeline x sequence parallel, expert x pipeline parallel, context parallel (not traced yet)")
    return plan


def _param_count(one, two, layers: int) -> int:
    """The full model's parameters from the two cut models' (global counts: DTensor.numel is the whole
    tensor's): per-layer count times the layers."""
    p1, p2 = one.trace.param_count, two.trace.param_count
    return int(p1 + (p2 - p1) / (HIGH - LOW) * (layers - LOW))

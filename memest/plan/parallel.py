"""`memest plan-parallel MODEL --gpus G --gpu CARD`: the dp x tp (x pp) layouts of G GPUs, each rank's
need, the layouts that fit ranked by communication volume per step.

A 70B model cannot be traced once per layout in a minute on a laptop, so each layout is traced on the
same model cut to a few layers per stage (the config's ``num_hidden_layers``) and extrapolated:

- Depth. The per-rank peak is affine in the layers per stage once the stage has 3 (every layer adds its
  state shard and its saved activations; the peak stays at the same point of backward): traced at
  LOW = 3 and HIGH = 4 layers per stage, extrapolated to the stage's real layer count (a stage of at
  most HIGH layers is traced at its real depth). At 2 layers the peak sits elsewhere under FSDP2
  (llama-2-70b, FSDP 64: peak(2) is 8.5% below the line through 3..80, which is exact to the byte at 80;
  benchmarks/parallel.md).
- Micro-batches (pipelines). A stage's step runs M micro-batches; 1F1B's first stage holds min(M, N)
  of them in flight, GPipe's all M, and the last stage keeps each micro-batch's output (torch's
  schedules merge them at the end). Tracing M = N = 64 is 64 forward and backward passes, so the first
  and last stage are traced in pipelines of m = 2 and 3 stages with m micro-batches, and the peak taken
  as affine in m up to M (with M = N, as the planner lays out, the first stage's m in flight become N).
- What a step needs above its peak allocated (allocator rounding and cached blocks, CUDA context,
  libraries: device/usage.py) is the deepest cut trace's; it is not affine in the depth (the allocator's
  fragmentation moves): llama-2-70b -0.1% to -1.2% at full depth, mixtral-8x7b FSDP 64 -8%.

One layout, the recommended one, is checked against a direct trace one step past the traced grid (one
layer more, or one micro-batch more); the errors are reported (``check``), and where the need misses by
more than DIRECT_ABOVE the layout is traced at its full depth (its direct need replaces the derived one).

Before any trace, a layout is left out when the model state alone cannot fit: every parameter lives on
at least one rank with its gradient and optimizer state at the optimizer step, so a rank holds at least
(parameters x bytes of parameter + gradient + optimizer state) / G (the optimizer table, features/optim.py);
when that exceeds the budget the layout is reported with that lower bound, not traced. A pipeline is also
left out when its first stage's activations in flight (measured per layer and micro-batch on a traced
pipeline of the same tp, parallel_bounds.py) with its layers' state exceed the budget.

The search. The ranking (bytes sent per step) is known before any trace, so layouts are taken in that
order and the search stops once ``top`` of them fit (``--top``, default 1: the recommended layout; every
layout that sends less was traced or bounded, so the best ``top`` are those of the exhaustive search); the
rest are listed as not traced. A pipeline's first stage (the worst in every plan measured) is traced
first; when its need alone exceeds the budget the layout does not fit and its last stage is not traced
(its need is reported as a lower bound). A stage's 2 to 4 grid points are traced in this process and a
worker process at once (WORKERS); the traces, and so the plan, are the same either way.

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
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from memest.errors import MemestError
from memest.imports import FORKSERVER_PRELOAD
from memest.parallel.dims import ParallelDims
from memest.plan import parallel_bounds
from memest.spec import RunSpec
from memest.spec.choices import Offload, Precision, Quant, Shard
from memest.spec.options import command_line
from memest.units import format_bytes

LOW, HIGH = 3, 4  # traced layers per stage (module docstring: the peak is affine from 3 layers on)
MICRO = (2, 3)  # pipelines: traced in m-stage pipelines of m micro-batches
TP_SIZES = (1, 2, 4, 8)  # tensor parallel stays inside one node (8 GPUs over NVLink), Megatron's guidance
MICRO_PROXY_SCHEDULES = ("1f1b", "gpipe")
# the check's need error above which the recommended layout is traced at full depth: the peak extrapolates
# exactly, the allocator's fragmentation does not (mixtral-8x7b FSDP 64: -19% at 5 layers, -8% at 32;
# benchmarks/parallel.md)
DIRECT_ABOVE = 0.02  # schedules whose end stages' peak is affine in m (module docstring)
TOP = 1  # the search stops once this many layouts fit (the recommended one); advise asks for its three
WORKERS = min(2, os.cpu_count() or 1)  # processes tracing at once: a stage's grid has 2 to 4 points


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
    error: str = ""  # why its trace failed (verdict not-traceable), the planner's temporary paths named as the model
    reason: str = ""  # that error in one short line (the table's cell)
    ep: int = 1  # expert parallel (MoE): experts over ep of the dp ranks (expert_layouts)
    traced: bool = True  # False: left out before tracing (needed_bytes a lower bound, or 0 where ranked below)
    lower_bound: bool = False  # needed_bytes is a lower bound (a floor, or the first stage's need alone)
    floor_bytes: int = 0  # the lower bound known before tracing it (model state; pipelines: + activations in flight)
    layer_bytes: int = 0  # pipelines: bytes each micro-batch holds per layer on the first stage (parallel_bounds)
    schedule: str = "1f1b"
    microbatches: int = 0  # pipelines: micro-batches per step (0 = pp)

    @property
    def name(self) -> str:
        parts = [f"dp {self.dp}", f"tp {self.tp}" + (" + sp" if self.sp else ""), f"pp {self.pp}"]
        return " x ".join(parts) + (f" (ep {self.ep})" if self.dims.ep_enabled else "")

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def dims(self) -> ParallelDims:
        """The layout as one value (parallel/dims.py)."""
        return ParallelDims(self.world_size, self.tp, self.pp, ep=self.ep, shard=Shard.ZERO3 if self.dp > 1 else Shard.NONE)

    def changes(self) -> dict:
        """The RunSpec fields of this layout (as `memest estimate` takes them)."""
        # --sp layouts trace torchtitan's plan with its default, loss parallel (unless the user's --no-loss-parallel);
        # a user's --loss-parallel applies to them only (the others have no such head: parallel_dims.loss_parallel)
        lp = {} if self.sp else {"loss_parallel": None}
        return {"world_size": self.world_size, "tp": self.tp, "sp": self.sp, "pp": self.pp, "ep": self.ep,
                "shard": "zero3" if self.dp > 1 else "none", **lp}

    def spec(self, base: RunSpec) -> RunSpec:
        """``base`` laid out so (a pipeline: its schedule and micro-batches too), as `memest estimate` traces it."""
        extra = {"microbatches": self.microbatches, "pp_schedule": self.schedule} if self.dims.pp_enabled else {}
        return dataclasses.replace(base, **self.changes(), **extra)

    def command(self, base: RunSpec, **extra) -> str:
        """The `memest estimate` command line of this layout (``extra``: estimate's own options, e.g. gpu=); ''
        where ``base`` cannot be laid out so (its error says why)."""
        try:
            return command_line(self.spec(base), **extra)
        except MemestError:
            return ""


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
    param_count: int = 0
    traces: int = 0

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _config(model: str) -> tuple[dict, Path]:
    from memest.sources.hf import _config_path

    if not model.startswith("hf:"):
        raise MemestError("plan-parallel takes hf: models (their depth is cut to trace each layout in seconds)")
    path = _config_path(model[3:])
    if path is None:
        raise MemestError(f"{model}: plan-parallel needs a config file (bundled name or path), not a Hub id")
    config = json.loads(path.read_text())
    missing = [key for key in ("num_hidden_layers", "hidden_size") if key not in config]
    if missing:  # e.g. GPT-2's n_layer / n_embd: the depth cut and the communication count read these keys
        raise MemestError(f"{model}: plan-parallel reads the config's {' and '.join(missing)} (to cut its depth and count "
                          "its communication); this config names them otherwise: not supported yet, use memest estimate "
                          "with --world-size/--tp/--pp per layout")
    return config, path


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
    """(routed experts per MoE layer, experts per token); (0, 0) for a dense model: the trace's own reader."""
    from memest.parallel.expert_parallel import expert_counts

    return expert_counts(config)


def expert_layouts(gpus: int, config: dict) -> list[Layout]:
    """MoE models: FSDP over dp with the experts divided over ep of the GPUs (--ep; parallel/expert_parallel.py),
    alone (tp 1) or with TP over tp as for the dp x tp layouts (transformers' plan, without sequence parallel):
    ep a multiple of tp (transformers' DistributedConfig; spec.py), within one node as tp is."""
    experts, _ = _experts(config)
    heads = config.get("num_attention_heads", 1)
    kv = config.get("num_key_value_heads") or heads
    return [Layout(dp=gpus // tp, tp=tp, pp=1, sp=False, ep=ep) for tp in TP_SIZES for ep in EP_SIZES
            if experts and not experts % ep and not gpus % ep and not gpus % tp and not heads % tp and not kv % tp
            and not ep % tp]


def expert_comm_bytes(layout: Layout, config: dict, base: RunSpec, act: int) -> tuple[int, int]:
    """(bytes each rank sends per step in the all-to-alls, the routed experts' parameters). Per MoE layer 4
    all-to-alls (dispatch and combine in the forward, their two in the backward) of tokens x top-k rows of the
    hidden size, (ep - 1) / ep of them leaving the rank at uniform routing (transformers' AllToAllEP); with TP each
    rank of a TP group dispatches its 1 / tp slice of the group's tokens (parallel/expert_parallel.py)."""
    experts, top_k = _experts(config)
    h = config["hidden_size"]
    inter = config.get("moe_intermediate_size") or config.get("intermediate_size") or 0
    moe_layers = config["num_hidden_layers"] - (config.get("first_k_dense_replace") or 0)
    tokens = base.batch * (base.seq or 1) / layout.tp
    sent = moe_layers * 4 * tokens * top_k * h * act * (layout.ep - 1) / layout.ep
    return int(sent), moe_layers * experts * 3 * h * inter


def comm_bytes(layout: Layout, config: dict, base: RunSpec, param_count: int) -> int:
    """Bytes each rank sends per step (module docstring)."""
    h, layers = config["hidden_size"], config["num_hidden_layers"]
    act = 2 if base.precision in (Precision.BF16, Precision.FP16, Precision.BF16_MIXED, Precision.FP16_MIXED) else 4
    tokens = base.batch * (base.seq or 1)
    total = 0
    if layout.dims.ep_enabled:  # the experts' FSDP runs over world / ep copies of each expert group, the rest over dp
        sent, expert_params = expert_comm_bytes(layout, config, base, act)
        copies = layout.world_size // layout.ep
        total += sent + (copies - 1) / copies * expert_params / layout.ep * (2 * act + 4)
        param_count = max(param_count - expert_params, 0)
    if layout.dp > 1:  # a pipeline rank holds its stage's 1/pp of the parameters
        share = param_count / (layout.tp * layout.pp)
        frac = (layout.dp - 1) / layout.dp
        total += frac * share * (2 * act + 4)
    if layout.dims.tp_enabled:  # a pipeline rank's layers, for each of its M = pp micro-batches
        total += layers / layout.pp * max(1, layout.pp) * 4 * 2 * (layout.tp - 1) / layout.tp * tokens * h * act
    if layout.dims.pp_enabled:
        total += 2 * (layout.microbatches or layout.pp) * tokens * h * act  # M micro-batches of --batch, forward + backward
    return int(total)


def state_bytes_per_param(base: RunSpec) -> int | None:
    """Bytes of parameter + gradient + optimizer state per parameter that a step's optimizer step holds
    on the device (the optimizer table's params x n, features/optim.py; paged optimizers keep their state on
    the host). None where the step holds less than that (frozen or quantized weights, offload)."""
    from memest.features.optim import OPTIMIZERS

    if not base.training or base.lora or base.freeze or base.quant != Quant.NONE or base.offload != Offload.NONE:
        return None
    info = OPTIMIZERS[base.optim]
    param = 2 if base.precision in (Precision.BF16, Precision.FP16) else 4  # -mixed keeps fp32 weights (autocast)
    n = 2 if info.kwargs.get("paged") else info.folklore_n
    return int(param * n)


def state_floor(layout: Layout, param_count: int, per_param: int | None) -> int:
    """A lower bound of any rank's need: the whole model state over the layout's ranks (module docstring)."""
    return 0 if per_param is None else param_count * per_param // layout.world_size


@dataclass
class _Stage:
    """One traced rank of a layout: the points traced, (layers, m) -> Estimate, and the real (layers, M)."""

    index: int  # the stage (pipelines: 0 or the last); 0 otherwise
    depth: int  # its real layers
    micro: int  # its real micro-batches (M); 0 without a pipeline
    depths: tuple[int, ...]
    micros: tuple[int, ...]  # (0,) without a pipeline
    points: dict = field(default_factory=dict)

    def predict(self, depth: int, micro: int) -> tuple[int, int]:
        """(peak, needed) at (depth, micro): each segment's peak (``segment_peaks``) bilinear in the traced
        grid, the highest of them; needed adds the deepest point's bytes above its peak."""
        d, m = self.depths, self.micros
        u = (depth - d[0]) / (d[-1] - d[0]) if len(d) > 1 else 0.0
        v = (micro - m[0]) / (m[-1] - m[0]) if len(m) > 1 else 0.0
        corners = [(d[i], m[j]) for i in (0, -1) for j in (0, -1)]
        segs = [self.points[c].segments for c in corners]
        labels = set.intersection(*(set(seg) for seg in segs))
        if any(max(seg[k] for k in labels) != self.points[c].peak for seg, c in zip(segs, corners, strict=True)):
            segs, labels = [{"step": self.points[c].peak} for c in corners], {"step"}

        def at(label: str) -> float:
            p00, p01, p10, p11 = (seg[label] for seg in segs)
            return p00 + (p10 - p00) * u + (p01 - p00) * v + (p11 - p10 - p01 + p00) * u * v

        peak = int(max(at(label) for label in labels))
        top = self.points[(d[-1], m[-1])]
        return peak, peak + top.needed - top.peak


def segment_peaks(trace) -> dict[tuple, int]:
    """The highest live bytes in each phase's first and last segment of each iteration (between the trace's
    phase marks), and before the first mark. The step's peak is the highest of them where it falls in
    such a segment (checked by the caller). Fitted one by one, a peak that moves from one segment to
    another as the step grows (the last pipeline stage: from its last backward to merging its M outputs)
    is extrapolated from where each segment's own bytes go, not from a line through two different places."""
    seq: list[list] = [[("start",), 0]]
    marks, i_mark, live = trace.phase_marks, 0, 0
    for i, (_, delta) in enumerate(trace.events):
        while i_mark < len(marks) and marks[i_mark][0] <= i:
            seq.append([marks[i_mark][1:], live])
            i_mark += 1
        live += delta
        if live > seq[-1][1]:
            seq[-1][1] = live
    out: dict[tuple, int] = {}
    for k, (key, peak) in enumerate(seq):
        same = [j for j, (other, _) in enumerate(seq) if other == key]
        if k == same[0]:
            out[(*key, "first")] = peak
        if k == same[-1]:
            out[(*key, "last")] = peak
    return out


def _stages(layout: Layout, layers: int) -> list[_Stage]:
    def grid(n: int, traced: tuple[int, ...]) -> tuple[int, ...]:
        return (n,) if n <= traced[-1] else traced

    if not layout.dims.pp_enabled:
        return [_Stage(0, layers, 0, grid(layers, (LOW, HIGH)), (0,))]
    base, extra = divmod(layers, layout.pp)  # even split, the first stages one more (trace/pipeline_parallel.split_layers)
    counts = [base + (1 if i < extra else 0) for i in (0, layout.pp - 1)]
    m = layout.microbatches or layout.pp
    proxy = layout.schedule in MICRO_PROXY_SCHEDULES and m == layout.pp
    micros = grid(m, MICRO) if proxy else (m,)
    return [_Stage(i, c, m, grid(c, (LOW, HIGH)), micros) for i, c in zip((0, layout.pp - 1), counts, strict=True)]


@dataclass
class _Point:
    """What the planner keeps of one traced point (a trace summarised where it ran, in a worker or here)."""

    peak: int  # peak allocated bytes
    needed: int
    segments: dict  # segment_peaks of its trace
    in_flight: int | None  # pipelines: parallel_bounds.in_flight_layer_bytes at its depth
    seconds: float


def _trace_point(spec: RunSpec, depth: int, calibration, source=None) -> _Point:
    """One cut model's step traced (``source`` or loaded here, once per process and model) and summarised."""
    from memest.estimator import _estimate_one

    start = time.perf_counter()
    if source is None:
        from memest.sources import load_source

        source = _WORKER_SOURCES.get(spec.model) or _WORKER_SOURCES.setdefault(spec.model, load_source(spec.model))
    est = _estimate_one(spec, calibration, source)
    in_flight = parallel_bounds.in_flight_layer_bytes(est.trace, depth) if spec.parallel.pp_enabled else None
    return _Point(est.report.peak_allocated_bytes, est.needed_bytes, segment_peaks(est.trace), in_flight,
                  time.perf_counter() - start)


_WORKER_SOURCES: dict[str, object] = {}


class _Tracer:
    """Traces of the cut models: one source per depth (built once, shared by every layout), cached by
    (layout, stage, depth, m). ``workers`` > 1: a batch of traces (one stage's grid) runs in this process
    and in ``workers - 1`` worker processes at once (forkserver: fresh processes, no state of this one)."""

    def __init__(self, config: dict, base: RunSpec, calibration, tmp: Path, progress=None, workers: int = 1):
        self.config, self.base, self.calibration, self.tmp, self.progress = config, base, calibration, tmp, progress
        self.sources: dict[int, object] = {}
        self.cache: dict[tuple, _Point] = {}
        self.traces = 0
        self.pool, self.workers = None, workers

    def _pool(self):
        """The worker processes, started at the first batch (a plan that traces nothing starts none)."""
        if self.pool is None:
            import concurrent.futures
            import multiprocessing

            context = multiprocessing.get_context("forkserver")
            context.set_forkserver_preload(FORKSERVER_PRELOAD)  # imported once per process (imports.py)
            self.pool = concurrent.futures.ProcessPoolExecutor(self.workers - 1, mp_context=context)
        return self.pool

    def untemp(self, text: str, model: str) -> str:
        """``text`` with the cut configs' temporary paths named as ``model`` (the path means nothing to the user)."""
        import re

        return re.sub(r"(hf:)?" + re.escape(str(self.tmp)) + r"/depth\d+/config\.json", lambda _: model, text)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(cancel_futures=True)

    def source(self, depth: int):
        from memest.sources import load_source

        if depth not in self.sources:
            path = self.tmp / f"depth{depth}" / "config.json"
            path.parent.mkdir()
            path.write_text(json.dumps({**self.config, "num_hidden_layers": depth}))
            self.sources[depth] = load_source(f"hf:{path}")
        return self.sources[depth]

    def param_count(self, layers: int) -> int:
        """The full model's parameters, from meta-device builds of the model cut to LOW and HIGH layers."""
        import torch

        counts = []
        for depth in (LOW, HIGH):
            with torch.device("meta"):
                model = self.source(depth).build_model()
            counts.append(sum(p.numel() for p in {id(p): p for p in model.parameters()}.values()))
        self.counts = counts
        return int(counts[0] + (counts[1] - counts[0]) / (HIGH - LOW) * (layers - LOW))

    def layer_params(self) -> int:
        """Parameters of one decoder layer (meta-device builds at LOW and HIGH layers)."""
        return self.counts[1] - self.counts[0]

    def _spec(self, layout: Layout, stage: _Stage, depth: int, micro: int) -> RunSpec:
        src = self.source(depth)
        changes = dict(model=f"hf:{self.tmp / f'depth{depth}' / 'config.json'}", seq=self.base.seq or src.default_seq,
                       **layout.changes())
        if layout.dims.pp_enabled:
            pp = micro if micro != stage.micro else layout.pp  # the proxy pipeline: m stages, m micro-batches
            index = 0 if stage.index == 0 else pp - 1
            split = ["0"] * pp
            split[index] = str(depth)
            changes.update(pp=pp, world_size=layout.dp * layout.tp * pp, microbatches=micro, pp_split=",".join(split),
                           pp_stage=index, pp_schedule=layout.schedule)
        return dataclasses.replace(self.base, **changes)

    @staticmethod
    def _key(layout: Layout, stage: _Stage, depth: int, micro: int) -> tuple:
        return (layout.dp, layout.tp, layout.sp, layout.pp, layout.ep, layout.schedule, stage.index, depth, micro)

    def _done(self, layout: Layout, stage: _Stage, depth: int, micro: int, point: _Point) -> _Point:
        self.traces += 1
        if self.progress:
            self.progress(f"traced {layout.name}, stage {stage.index}, {depth} layers"
                          + (f", {micro} micro-batches" if micro else "") + f" in {point.seconds:.1f} s")
        self.cache[self._key(layout, stage, depth, micro)] = point
        return point

    def trace(self, layout: Layout, stage: _Stage, depth: int, micro: int) -> _Point:
        key = self._key(layout, stage, depth, micro)
        if key in self.cache:
            return self.cache[key]
        point = _trace_point(self._spec(layout, stage, depth, micro), depth, self.calibration, self.source(depth))
        return self._done(layout, stage, depth, micro, point)

    def trace_all(self, layout: Layout, stage: _Stage, points: list[tuple[int, int]]) -> None:
        """``points`` ((depth, m)) of one stage, into ``stage.points``: the first ones in the workers, the rest here.
        A trace that fails raises its error once every trace of the batch has ended."""
        todo = [pt for pt in points if self._key(layout, stage, *pt) not in self.cache]
        remote = {}
        if self.workers > 1 and len(todo) > 1:
            n = len(todo) - -(-len(todo) // self.workers)  # this process takes its share, the workers the rest
            for depth, micro in todo[:n]:
                remote[(depth, micro)] = self._pool().submit(_trace_point, self._spec(layout, stage, depth, micro), depth,
                                                          self.calibration)
        error = None
        for pt in todo:
            if pt in remote:
                continue
            try:
                self.trace(layout, stage, *pt)
            except MemestError as exc:
                error = error or exc
        for pt, future in remote.items():
            try:
                self._done(layout, stage, *pt, future.result())
            except MemestError as exc:
                error = error or exc
        if error is not None:
            raise error
        for pt in points:
            stage.points[pt] = self.cache[self._key(layout, stage, *pt)]


def _derive(layout: Layout, tracer: _Tracer, layers: int, stop_above: int | None = None, floor=None) -> list[_Stage]:
    """The layout's stages traced and extrapolated, the first stage first; with ``stop_above``, a pipeline
    whose first stage alone needs more is left there (its need, a lower bound of the layout's, marked so).
    ``floor(layout, stage)``: asked once a pipeline's first stage is traced at its first depth (both
    micro-batch counts); True when that rules the layout out (it says so in the layout), and the rest is not
    traced. Returns the stages traced in full."""
    stages, done = _stages(layout, layers), []
    worst = None
    for st in stages:
        if floor is not None and st.index == 0 and len(st.depths) > 1 and len(st.micros) > 1:
            tracer.trace_all(layout, st, [(st.depths[0], m) for m in st.micros])
            if floor(layout, st):
                return []
        tracer.trace_all(layout, st, [(d, m) for d in st.depths for m in st.micros])
        done.append(st)
        peak, needed = st.predict(st.depth, st.micro)
        if worst is None or needed > layout.needed_bytes:
            worst, layout.peak_bytes, layout.needed_bytes = st, peak, needed
        if stop_above is not None and len(done) < len(stages) and layout.needed_bytes > stop_above:
            layout.lower_bound = True
            break
    how = []
    if len(worst.depths) > 1:
        how.append(f"{LOW} and {HIGH} layers per stage, affine in layers")
    else:
        how.append(f"its {worst.depth} layer{'s' if worst.depth != 1 else ''} traced")
    if layout.dims.pp_enabled:
        how.append(f"{'m = 2, 3 stages x micro-batches, affine in m' if len(worst.micros) > 1 else f'{worst.micro} micro-batches traced'}")
        how.insert(0, f"stage {worst.index} alone: its need is over the budget, the last stage not traced" if layout.lower_bound
                   else f"stage {worst.index} (worst of first and last)")
    layout.derived_from = "; ".join(how)
    return done


def plan_parallel(model: str, gpus: int, budget: int, budget_label: str, base: RunSpec, calibration=None,
                  progress=None, check: bool = True, prune: bool = True, top: int | None = TOP,
                  workers: int | None = None) -> ParallelPlan:
    """``prune``: leave out, untraced, the layouts a lower bound already rules out (the model state; the
    activations a pipeline's first stage holds, ``parallel_bounds``), and stop tracing a pipeline whose first
    stage alone needs more than the budget. ``top``: layouts are searched in their ranking order (bytes sent
    per step, known before any trace) and the search stops once ``top`` of them fit; the rest are listed as
    not traced (None or 0: every layout is traced). ``prune=False, top=None`` traces every layout. ``workers``:
    processes tracing at once (default: WORKERS); the plan is the same with any number."""
    start = time.perf_counter()
    if base.quant != Quant.NONE:  # every layout of 2+ GPUs shards the base (spec/run.py quant_layout_unmodelled)
        raise MemestError(f"plan-parallel with --quant {base.quant}: a quantized base sharded over GPUs (FSDP-QLoRA, "
                          "DeepSpeed ZeRO-3 QLoRA) is not modelled; drop --quant to lay out a 16-bit base, or estimate "
                          "plain DDP with memest estimate --world-size N --shard none")
    config, _ = _config(model)
    layers = config["num_hidden_layers"]
    base = with_traced_seq(base)
    plan = ParallelPlan(model, gpus, budget, budget_label, base.to_dict(), layers)
    per_param = state_bytes_per_param(base)
    with tempfile.TemporaryDirectory(prefix="memest-plan-") as tmp:
        tracer = _Tracer(config, base, calibration, Path(tmp), progress, WORKERS if workers is None else workers)
        try:
            search = _search(plan, tracer, config, base, per_param, prune, top, check)
        finally:
            tracer.close()
    plan.seconds = time.perf_counter() - start
    plan.notes.append(
        f"per-rank need derived from traces of the model cut to {LOW} and {HIGH} layers per stage (the peak is affine in "
        f"layers from {LOW} on), pipelines' first and last stage in 2- and 3-stage pipelines (affine in micro-batches); "
        "the recommended layout checked against a direct trace one step further; communication volume per step from "
        "the ZeRO and Megatron-LM papers' counts (memest/plan/parallel.py)"
    )
    plan.notes += search.notes()
    if any(lay.dims.pp_enabled for lay in plan.layouts):
        plan.notes.append(
            "pipeline layouts: 1F1B with M = pp micro-batches of --batch, each stage FSDP2-sharded over dp and TP over tp; "
            "the first and the last stage traced (middle stages hold fewer micro-batches of the same layers, as walking "
            "torch's Schedule1F1B order gives, and neither embedding nor head)"
        )
    if any(lay.dims.ep_enabled for lay in plan.layouts):
        plan.notes.append(
            "expert-parallel layouts (ep): traced with uniform routing, the expected need; all tokens routed to one rank "
            "needs more (memest estimate --ep shows that range); all-to-all volume at uniform routing"
        )
    plan.notes.append("not searched (each traced by `memest estimate`, not yet by the planner): pipeline x sequence "
                      "parallel, expert x pipeline parallel, context parallel (--cp)")
    return plan


def with_traced_seq(base: RunSpec) -> RunSpec:
    """``base`` with the sequence length every layout is traced at (the model's default without --seq), so the
    communication volume and the printed commands use the length the needs come from (issue 22, item 10)."""
    if base.seq is not None:
        return base
    from memest.sources import load_source

    return dataclasses.replace(base, seq=load_source(base.model).default_seq)


def _search(plan: ParallelPlan, tracer: _Tracer, config: dict, base: RunSpec, per_param: int | None, prune: bool,
            top: int | None, check: bool) -> _Search:
    """Each layout in ranking order: left out (``_Search``) or traced and derived; then the check."""
    budget, layers, progress = plan.budget_bytes, plan.layers, tracer.progress
    derived: dict[int, list[_Stage]] = {}
    plan.param_count = param_count = tracer.param_count(layers)
    search = _Search(plan, tracer, config, base, per_param, prune, top)
    for layout in layouts_for(plan.gpus, config):
        layout.comm_bytes = comm_bytes(layout, config, base, param_count)
        plan.layouts.append(layout)
    for i, layout in enumerate(sorted(plan.layouts, key=lambda lay: lay.comm_bytes)):
        if search.left_out(layout):
            continue
        if progress:
            progress(f"plan-parallel {i + 1}: {layout.name}")
        try:
            try:
                derived[id(layout)] = _derive(layout, tracer, layers, budget if prune else None,
                                              search.own_floor if prune else None)
            except MemestError:
                if not layout.sp:
                    raise
                layout.sp = False  # not a Llama-style decoder: transformers' own plan, without SP
                layout.lower_bound = False
                derived[id(layout)] = _derive(layout, tracer, layers, budget if prune else None,
                                              search.own_floor if prune else None)
        except MemestError as exc:
            layout.error = tracer.untemp(str(exc), plan.model)
            layout.reason = short_reason(layout.error, plan.model)
            layout.traced, layout.verdict = False, "not-traceable"
            continue
        layout.fits = layout.needed_bytes <= budget
        layout.verdict = "fits" if layout.fits else "does-not-fit"
        search.learn(layout, derived[id(layout)])
    plan.layouts.sort(key=_rank)
    best = next((lay for lay in plan.layouts if derived.get(id(lay))), None)
    if check and best is not None:
        plan.check = _check(best, derived[id(best)], tracer)
        if plan.check and abs(plan.check["needed_error"]) > DIRECT_ABOVE:
            _trace_full_depth(best, tracer, budget, plan)
    plan.traces = tracer.traces
    return search


REASON_CHARS = 80  # the longest reason a table cell shows (the whole error is in --json's layout "error")


def short_reason(error: str, model: str) -> str:
    """``error`` (a layout's failed trace) in one line of at most REASON_CHARS: what raised and its first clause,
    without the model's path or the hint after " — " (the whole error stays in the layout's ``error``)."""
    text = error.split(" — ")[0].strip()
    if text.startswith(f"{model}: "):
        text = text[len(model) + 2:]
    where, raised, message = text.partition(" raised ")
    if raised:  # "optimizer.step() raised RuntimeError: aten... got mixed ..., need to ..."
        message = message.split(": ", 1)[-1]
        text = f"{where}: {message}"
    text = text.split(", ")[0].splitlines()[0] if text else "the trace failed"
    return text if len(text) <= REASON_CHARS else text[:REASON_CHARS - 1].rstrip() + "…"


def _rank(lay: Layout) -> tuple:
    """Fitting layouts first, least communication first; then those that do not fit, traced before bounded,
    least need first; then those the search stopped before (least communication first); errors last."""
    unknown = not lay.traced and not lay.needed_bytes
    return (bool(lay.error), unknown, not lay.fits, lay.lower_bound, lay.comm_bytes if lay.fits or unknown else lay.needed_bytes)


class _Search:
    """What ``plan_parallel`` leaves out before tracing a layout (searched in ranking order): the layouts
    below the ``top`` that fit, and those a lower bound rules out (parallel_bounds)."""

    def __init__(self, plan: ParallelPlan, tracer: _Tracer, config: dict, base: RunSpec, per_param: int | None,
                 prune: bool, top: int | None):
        self.plan, self.tracer, self.config, self.base = plan, tracer, config, base
        self.per_param, self.prune, self.top = per_param, prune, top
        self.fitting = 0
        self.layer_bytes: dict[tuple, parallel_bounds.LayerBytes] = {}  # (tp, dp > 1, schedule) -> measured
        self.bounded = self.stopped = 0
        self.layer_params: int | None = None

    def left_out(self, layout: Layout) -> bool:

        budget, param_count = self.plan.budget_bytes, self.plan.param_count
        floor = layout.floor_bytes = state_floor(layout, param_count, self.per_param)
        if self.prune and floor > budget:
            layout.traced, layout.lower_bound, layout.needed_bytes, layout.verdict = False, True, floor, "does-not-fit"
            layout.derived_from = (f"not traced: the model state alone is at least {format_bytes(floor)} per rank "
                                   f"({param_count:,} parameters x {self.per_param} B / {layout.world_size} ranks)")
            return True
        act = self._activation_floor(layout)
        layout.floor_bytes = max(floor, act[0] if act else 0)
        if self.top and self.fitting >= self.top:
            layout.traced, layout.verdict = False, "not-traced"
            layout.derived_from = (f"not searched: sends more per step than the {self.top} layout{'s' if self.top > 1 else ''} "
                                   "that fit above it, where the search stopped (--top 0 traces every layout)")
            self.stopped += 1
            return True
        if self.prune and act is not None and act[0] > budget:
            self._ruled_out(layout, act, "not traced")
            return True
        return False

    def _ruled_out(self, layout: Layout, act: tuple, how: str) -> None:

        floor, per_layer, depth, micro = act
        layout.lower_bound, layout.needed_bytes, layout.verdict = True, floor, "does-not-fit"
        layout.traced = how != "not traced"
        layout.derived_from = (f"{how}: its first stage holds at least {format_bytes(floor)} before its first backward "
                               f"({micro} micro-batches x {depth} layers x {format_bytes(per_layer.bytes_per_layer)} a layer "
                               f"and micro-batch, measured on {per_layer.source}, + its layers' parameters and optimizer state)")
        self.bounded += 1

    def own_floor(self, layout: Layout, stage: _Stage) -> bool:
        """A pipeline's first stage traced at its first depth (m = 2 and 3): the activation floor from its own
        bytes per layer and micro-batch; True (the layout marked) where that is over the budget."""
        measured = parallel_bounds.layer_bytes(stage.points, stage.depths[0], stage.micros, f"its own first {len(stage.micros)} traces")
        if measured is None:
            return False
        layout.layer_bytes = measured.bytes_per_layer
        self.layer_bytes.setdefault(self._key(layout), measured)
        act = self._activation_floor(layout, measured)
        if act is None or act[0] <= self.plan.budget_bytes:
            return False
        self._ruled_out(layout, act, f"stage 0 traced at {stage.depths[0]} layers only")
        return True

    def _key(self, layout: Layout) -> tuple:
        return (layout.tp, layout.dp > 1, layout.schedule)

    def _activation_floor(self, layout: Layout, per_layer: parallel_bounds.LayerBytes | None = None):
        """(floor, LayerBytes, layers, micro-batches) of a pipeline's first stage, or None (parallel_bounds);
        ``per_layer``: measured on the layout itself, else on the first traced layout of its kind."""
        per_layer = per_layer or self.layer_bytes.get(self._key(layout))
        if per_layer is None or self.per_param is None or not layout.dims.pp_enabled or layout.schedule not in MICRO_PROXY_SCHEDULES:
            return None
        if layout.microbatches not in (0, layout.pp):
            return None
        if self.layer_params is None:
            self.layer_params = self.tracer.layer_params()
        stage = _stages(layout, self.plan.layers)[0]
        param = 2 if self.base.precision in (Precision.BF16, Precision.FP16) else 4
        floor = parallel_bounds.activation_floor(per_layer, stage.depth, layout.pp, self.layer_params, self.per_param - param,
                                                 layout.dp, layout.tp)
        return floor, per_layer, stage.depth, layout.pp

    def learn(self, layout: Layout, stages: list[_Stage]) -> None:
        if layout.fits:
            self.fitting += 1
        if not stages:  # ruled out by its own activation floor (own_floor measured it)
            return
        first = stages[0]
        if not layout.dims.pp_enabled or first.index != 0:
            return
        measured = parallel_bounds.layer_bytes(first.points, first.depths[0], first.micros, layout.name)
        if measured is not None:
            layout.layer_bytes = measured.bytes_per_layer
            self.layer_bytes.setdefault(self._key(layout), measured)

    def notes(self) -> list[str]:
        out, how = [], " ".join(lay.derived_from for lay in self.plan.layouts)
        if "model state alone" in how:
            out.append(
                "layouts marked 'not traced' with '>=' cannot fit: every parameter, its gradient and its optimizer state "
                "are on some rank at the optimizer step, so the most loaded rank holds at least the model state / GPUs "
                "(a lower bound)"
            )
        if "first stage holds" in how:
            out.append(
                "pipelines whose first stage 'holds at least' cannot fit: before its first backward the first stage holds its "
                "M micro-batches' activations (the bytes per layer and micro-batch measured on a traced pipeline of the same "
                "tensor parallel degree, or on the layout's own first traces) and its layers' parameters and optimizer "
                "state (a lower bound; memest/plan/parallel_bounds.py)"
            )
        if "stage 0 alone" in how:
            out.append("pipelines marked 'stage 0 alone': the first stage's derived need already exceeds the budget; the "
                       "layout's need (the worst stage's) is at least that")
        if any(lay.error for lay in self.plan.layouts):
            out.append("layouts marked 'not traceable': their trace fails as laid out (the cell shows what raised; "
                       "--json's layout 'error' holds the whole message); they are not ranked")
        if self.stopped:
            out.append(
                f"layouts are searched in their ranking order (bytes sent per step, known before tracing); the search "
                f"stopped once {self.top} fit, so {self.stopped} layout{'s' if self.stopped > 1 else ''} that send more "
                "are listed as not searched (they may or may not fit); --top 0 traces every layout"
            )
        return out


def _trace_full_depth(layout: Layout, tracer: _Tracer, budget: int, plan: ParallelPlan) -> None:
    """The layout traced as it runs (full depth; a pipeline's first and last stage with M micro-batches),
    its need replacing the derived one; the layouts re-ranked."""
    from memest.estimator import _estimate_one
    from memest.sources import load_source

    src = load_source(plan.model)
    spec = dataclasses.replace(tracer.base, seq=tracer.base.seq or src.default_seq, **layout.changes(),
                               **({"microbatches": layout.microbatches, "pp_schedule": layout.schedule} if layout.dims.pp_enabled else {}))
    stages = (0, layout.pp - 1) if layout.dims.pp_enabled else (0,)
    start = time.perf_counter()
    ends = [_estimate_one(dataclasses.replace(spec, pp_stage=i), tracer.calibration, src) for i in stages]
    tracer.traces += len(ends)
    direct = max(ends, key=lambda e: e.needed_bytes)
    derived = layout.needed_bytes
    layout.peak_bytes, layout.needed_bytes = direct.report.peak_allocated_bytes, direct.needed_bytes
    layout.fits = layout.needed_bytes <= budget
    layout.verdict = "fits" if layout.fits else "does-not-fit"
    layout.derived_from = (f"traced at its full depth ({time.perf_counter() - start:.0f} s): the need derived from the cut "
                           f"model, {format_bytes(derived)}, missed by {100 * plan.check['needed_error']:+.1f}% at the check")
    plan.check["full_depth_needed_bytes"] = layout.needed_bytes
    plan.layouts.sort(key=_rank)
    plan.notes.append(
        f"{layout.name}: its derived need missed the check's direct trace by {100 * plan.check['needed_error']:+.1f}% (the "
        f"caching allocator's fragmentation is not affine in depth, while the peak is), so it was traced at full depth; the "
        "other layouts' needs are derived and may be off by as much"
    )


def _check(layout: Layout, stages: list[_Stage], tracer: _Tracer) -> dict | None:
    """The layout's worst stage traced directly one step past its traced grid: one layer more where the
    depth was extrapolated, else one micro-batch more; None where every point was traced directly."""
    stage = max(stages, key=lambda st: st.predict(st.depth, st.micro)[1])
    if len(stage.depths) > 1:
        depth, micro = HIGH + 1, stage.micros[0]
    elif len(stage.micros) > 1:
        depth, micro = stage.depths[0], MICRO[-1] + 1
    else:
        return None
    predicted, predicted_needed = stage.predict(depth, micro)
    direct = tracer.trace(layout, stage, depth, micro)
    real, real_needed = direct.peak, direct.needed
    return {"layout": layout.name, "stage": stage.index, "depth_per_stage": depth, "microbatches": micro,
            "predicted_peak_bytes": predicted, "traced_peak_bytes": real, "error": (predicted - real) / real,
            "predicted_needed_bytes": predicted_needed, "traced_needed_bytes": real_needed,
            "needed_error": (predicted_needed - real_needed) / real_needed}

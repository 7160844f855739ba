"""`memest serve`: will the engine start with these settings, how many KV tokens and sequences it holds,
and what to change when it will not start. Library code: returns a ServePlan, prints nothing."""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field

from memest.errors import MemestError
from memest.serve import evidence
from memest.serve.budget import (
    Part,
    SglangBudget,
    VllmBudget,
    longest_context,
    sglang_budget,
    sglang_default_fraction,
    vllm_budget,
)
from memest.serve.kv import ModelKV, model_dtype, model_kv
from memest.serve.profile import ProfileRun, trace_profile_run
from memest.serve.weights import Weights, weights_per_rank


@dataclass(frozen=True)
class ServeSpec:
    model: str  # hf:NAME, hf:path/config.json or hf:org/name (a decoder-only transformers config)
    total_bytes: int  # the GPU's memory as cudaMemGetInfo reports it
    card: str | None = None
    max_model_len: int | None = None  # None: the model's max_position_embeddings (vLLM's default)
    utilization: float | None = None  # vLLM gpu_memory_utilization / SGLang mem_fraction_static; None: default
    tp: int = 1
    kv_dtype: str = "auto"  # auto | fp8
    dtype: str = "auto"
    block_size: int = evidence.DEFAULT_BLOCK_SIZE
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    engine: str = "vllm"
    cuda_graphs: str = "profiled"  # profiled (vLLM >= 0.21) | after (older) | none (--enforce-eager)
    compute_capability: tuple[int, int] = (9, 0)
    non_torch: Part | None = None  # measured (--non-torch-memory, --calibration); None: evidence.non_torch(tp)
    context: Part | None = None  # measured CUDA context (--calibration); None: the evidence spread


@dataclass
class ServePlan:
    spec: ServeSpec
    model_name: str
    max_model_len: int
    max_positions: int | None
    utilization: float
    utilization_source: str
    max_num_seqs: int
    max_num_batched_tokens: int
    batching_source: str
    kv: ModelKV
    weights: Weights
    profile: ProfileRun | None
    vllm: VllmBudget | None = None
    sglang: SglangBudget | None = None
    context: Part | None = None
    verdict: str = "starts"  # starts | may-not-start | will-not-start
    reasons: list[str] = field(default_factory=list)
    fixes: list[str] = field(default_factory=list)
    longest_context: int = 0  # the longest max_model_len one sequence fits at this budget
    longest_context_low: int = 0  # ... with every cost at the high end of its range
    longest_context_high: int = 0  # ... with every cost at the low end of its range
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    config: object = field(default=None, repr=False)  # the transformers config (for the fixes' re-computation)

    @property
    def starts(self) -> bool:
        """Starts for certain: one max_model_len sequence fits even with every cost at the high end of its range
        (the low end of the KV range). "may-not-start" is not a start."""
        return self.verdict == "starts"

    @property
    def non_torch(self) -> Part | None:
        return next((p for p in self.vllm.parts if p.name == evidence.NON_TORCH_NAME), None) if self.vllm else None

    @property
    def tokens(self) -> int:
        return self.vllm.layout.tokens if self.vllm else self.sglang.tokens

    @property
    def sequences(self) -> int:
        return self.vllm.layout.sequences if self.vllm else self.sglang.sequences


def load_config(model: str):
    """The transformers config of an hf: reference, without building the model (imports with the garbage
    collector paused, as load_hf_source does)."""
    import sys

    from memest.trace.step import imports_without_gc

    if not model.startswith("hf:"):
        raise MemestError(f"memest serve takes an hf: model (hf:NAME, hf:path/config.json, hf:org/name), not {model!r}")
    name = model[3:]
    with contextlib.nullcontext() if "transformers" in sys.modules else imports_without_gc():
        import transformers

        from memest.sources.hf import _config_path, _from_file, _from_hub

        transformers.logging.set_verbosity_error()
        path = _config_path(name)
        return _from_file(transformers, path) if path is not None else _from_hub(transformers, name)


def _build_meta(config):
    import torch
    import transformers

    arch = (getattr(config, "architectures", None) or [None])[0]
    cls = getattr(transformers, arch, None) if arch else None
    if cls is None:
        cls = transformers.AutoModelForCausalLM._model_mapping[type(config)]
    with torch.device("meta"):
        return cls(config)


def plan_serve(spec: ServeSpec, config=None) -> ServePlan:
    start = time.perf_counter()
    config = config if config is not None else load_config(spec.model)
    _check(spec)
    dtype = model_dtype(config, spec.dtype)
    kv = model_kv(config, spec.tp, spec.kv_dtype, spec.dtype)
    positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    max_len = spec.max_model_len or positions
    if not max_len:
        raise MemestError(f"{spec.model}: the config gives no max_position_embeddings; pass --max-model-len")
    tokens, seqs, batching = evidence.default_batching(spec.total_bytes, spec.card)
    batched = spec.max_num_batched_tokens or tokens
    num_seqs = min(spec.max_num_seqs or seqs, batched)
    notes = list(kv.notes)
    if spec.engine == "sglang":
        weights = weights_per_rank(_build_meta(config), config, spec.tp, dtype)
        plan = _sglang(spec, config, kv, weights, max_len, positions, dtype, notes)
    else:
        plan = _vllm(spec, config, kv, max_len, positions, batched, num_seqs, batching, dtype, notes)
    plan.seconds = time.perf_counter() - start
    return plan


def _check(spec: ServeSpec) -> None:
    if spec.utilization is not None and not 0 < spec.utilization <= 1:
        raise MemestError(f"--gpu-memory-utilization must be in (0, 1], got {spec.utilization}")
    if spec.block_size < 1 or spec.tp < 1:
        raise MemestError("--block-size and --tp must be at least 1")
    for name, value in (("--max-model-len", spec.max_model_len), ("--max-num-seqs", spec.max_num_seqs),
                        ("--max-num-batched-tokens", spec.max_num_batched_tokens)):
        if value is not None and value < 1:
            raise MemestError(f"{name} must be at least 1, got {value}")


def _vllm(spec, config, kv, max_len, positions, batched, num_seqs, batching, dtype, notes) -> ServePlan:
    util = spec.utilization if spec.utilization is not None else evidence.DEFAULT_UTILIZATION
    util_src = "--gpu-memory-utilization" if spec.utilization is not None else "vLLM default 0.9 (config/cache.py)"
    profile = trace_profile_run(config, spec.tp, batched, num_seqs, dtype, spec.compute_capability)
    if profile.model is not None:
        weights = weights_per_rank(profile.model, config, spec.tp, dtype, split=profile.split)
    else:
        weights = weights_per_rank(_build_meta(config), config, spec.tp, dtype)
    profile.model = None  # the fake model is not needed past here
    parts = [Part.exact("weights", weights.bytes, f"{weights.parameters:,} parameters as {dtype} on one of {spec.tp} "
                        "rank(s), + rotary cache (serve/weights.py)"), profile.activation,
             spec.non_torch or evidence.non_torch(spec.tp)]
    if spec.utilization is None:
        notes.append(evidence.DEFAULT_UTILIZATION_NEWER)
    if spec.non_torch is None:
        notes.append(evidence.NON_TORCH_OLDER)
    graphs = evidence.cuda_graphs(spec.cuda_graphs)
    if graphs is not None:
        parts.append(graphs)
    elif spec.cuda_graphs == "after":
        notes.append(evidence.CUDA_GRAPHS_AFTER)
    budget = vllm_budget(spec.total_bytes, util, parts, kv, spec.block_size, max_len, batched)
    context = _context(spec)
    plan = ServePlan(spec, spec.model[3:], max_len, positions, util, util_src, num_seqs, batched, batching, kv, weights,
                     profile, vllm=budget, context=context, notes=notes + profile.notes, config=config)
    limit = max(positions or 0, max_len)
    plan.longest_context = longest_context(kv, budget.available.bytes, spec.block_size, batched, limit)
    plan.longest_context_low = longest_context(kv, budget.available.low, spec.block_size, batched, limit)
    plan.longest_context_high = longest_context(kv, budget.available.high, spec.block_size, batched, limit)
    if plan.longest_context == limit:
        plan.notes.append(f"one sequence fits at every length up to {limit:,} tokens (the model's positions or "
                          "--max-model-len, whichever is larger); memest searches no further")
    _verdict_vllm(plan)
    return plan


def _context(spec: ServeSpec) -> Part:
    from memest.device.overheads import context_spread

    if spec.context is not None:
        return spec.context
    c = context_spread(spec.compute_capability, "lazy")
    return Part("CUDA context", c.expected, c.low, c.high, c.basis)


def _verdict_vllm(plan: ServePlan) -> None:
    """starts: one max_model_len sequence fits with every cost at the high end of its range (the low end of the KV
    range); may-not-start: it fits only with the expected or the low-end costs; will-not-start: not even then, or a
    refusal that does not depend on the ranges. Each refusal names its reason and fixes."""
    b, spec = plan.vllm, plan.spec
    lay = b.layout
    may: list[str] = []
    if plan.max_positions and plan.max_model_len > plan.max_positions:
        plan.reasons.append(f"max_model_len {plan.max_model_len} exceeds the model's {plan.max_positions} positions: "
                            "vLLM refuses it unless VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 (config/model.py)")
        plan.fixes.append(f"--max-model-len {min(plan.max_positions, max(plan.longest_context, 1))}")
    ctx = plan.context
    free_at_start, free_worst = spec.total_bytes - ctx.bytes, spec.total_bytes - ctx.high
    start_msg = ("is below the requested {req} GiB (total x {u}): vLLM raises 'Free memory on device ... is less than "
                 "desired GPU memory utilization' (gpu_worker.py init_device)")
    if free_at_start < b.requested_bytes:
        plan.reasons.append(f"free memory at start-up (~{_gib(free_at_start)} GiB after the CUDA context) "
                            + start_msg.format(req=_gib(b.requested_bytes), u=b.utilization))
        plan.fixes.append(f"--gpu-memory-utilization {math.floor(free_at_start / spec.total_bytes * 100) / 100:.2f} "
                          "or lower")
    elif free_worst < b.requested_bytes:
        may.append(f"with the CUDA context at the high end of its range ({_gib(ctx.high)} GiB) the free memory at "
                   f"start-up ({_gib(free_worst)} GiB) " + start_msg.format(req=_gib(b.requested_bytes), u=b.utilization))
        plan.fixes.append(f"--gpu-memory-utilization {math.floor(free_worst / spec.total_bytes * 100) / 100:.2f} "
                          "or lower")

    def holds(available: int) -> bool:
        return available > 0 and lay.request_bytes <= available

    need = f"one {plan.max_model_len}-token sequence needs {_gib(lay.request_bytes)} GiB of KV cache"
    if not holds(b.available.bytes):
        if b.available.bytes <= 0:
            why = (f"no memory left for the KV cache: weights, activations and the rest take {_gib(b.non_kv_bytes)} "
                   f"GiB of the {_gib(b.requested_bytes)} GiB requested ('No available memory for the cache blocks', "
                   "kv_cache_utils.py)")
        else:
            why = (f"{need}, {_gib(b.available.bytes)} GiB are available (check_enough_kv_cache_memory); the longest "
                   f"that fits is {plan.longest_context} tokens")
        if holds(b.available.high):
            may.append(f"with the expected costs {why}; it fits only with every cost at the low end of its range "
                       f"({_gib(b.available.high)} GiB for the KV cache)")
        else:
            plan.reasons.append(why)
        _kv_fixes(plan, b.available.bytes, b.non_kv_bytes, plan.longest_context)
    elif not holds(b.available.low):
        costs = ", ".join(f"{p.name} {_gib(p.high)}" for p in b.parts if p.high != p.bytes)
        may.append(f"with every cost at the high end of its range ({costs} GiB) {_gib(max(b.available.low, 0))} GiB "
                   f"remain for the KV cache and {need} (check_enough_kv_cache_memory); the longest that surely fits "
                   f"is {plan.longest_context_low} tokens")
        _kv_fixes(plan, b.available.low, sum(p.high for p in b.parts), plan.longest_context_low, "surely ")
    if plan.reasons:
        plan.verdict = "will-not-start"
        plan.reasons += may
    elif may:
        plan.verdict = "may-not-start"
        plan.reasons += may
        if plan.non_torch is not None and plan.non_torch.low != plan.non_torch.high:
            plan.fixes.append("--non-torch-memory GiB (the non-torch figure of your own vLLM start-up log) or "
                              "--calibration FILE: a measured value narrows the range")


def _kv_fixes(plan: ServePlan, available: int, non_kv: int, longest: int, surely: str = "") -> None:
    """What would make one max_model_len sequence fit in ``available`` KV bytes (``non_kv``: what is subtracted
    before it): a shorter length, a larger share, fp8 KV, more GPUs."""
    from memest.serve.budget import request_bytes

    b, spec = plan.vllm, plan.spec
    need_util = (non_kv + b.layout.request_bytes) / spec.total_bytes
    start_limit = (spec.total_bytes - plan.context.bytes) / spec.total_bytes
    if longest >= spec.block_size:
        plan.fixes.append(f"--max-model-len {longest} (the longest one sequence {surely}fits)")
    if b.utilization < need_util <= start_limit:
        plan.fixes.append(f"--gpu-memory-utilization {math.ceil(need_util * 100) / 100:.2f}")
    if spec.kv_dtype == "auto" and available > 0 and plan.config is not None:
        kv8 = model_kv(plan.config, spec.tp, "fp8", spec.dtype)
        need8 = request_bytes(kv8, spec.block_size, plan.max_model_len, plan.max_num_batched_tokens)
        if need8 <= available:
            plan.fixes.append(f"--kv-dtype fp8 (one sequence then needs {_gib(need8)} GiB)")
    plan.fixes.append(f"--tp {spec.tp * 2} (weights and KV heads split over {spec.tp * 2} GPUs)")


def _sglang(spec, config, kv, weights, max_len, positions, dtype, notes) -> ServePlan:
    if spec.utilization is not None:
        fraction, src = spec.utilization, "--gpu-memory-utilization (as SGLang's --mem-fraction-static)"
    else:
        fraction, src = sglang_default_fraction(spec.total_bytes, spec.tp)
    context = _context(spec)
    budget = sglang_budget(spec.total_bytes, fraction, src, context, weights.bytes, kv, max_len)
    notes = notes + ["SGLang: activations, CUDA graphs and other buffers live in the (1 - mem_fraction_static) share; "
                     "they are not traced or subtracted one by one (model_runner.py profile_max_num_token)"]
    if spec.non_torch is not None:
        notes.append("SGLang subtracts no non-torch term (it lives in the (1 - mem_fraction_static) share): the measured "
                     "non-torch value is not used")
    plan = ServePlan(spec, spec.model[3:], max_len, positions, fraction, src, 0, 0, "", kv, weights, None,
                     sglang=budget, context=context, notes=notes)
    plan.longest_context = budget.tokens
    plan.longest_context_low, plan.longest_context_high = budget.tokens_low, budget.tokens_high
    if budget.tokens <= 0:
        plan.verdict = "will-not-start"
        plan.reasons.append(f"no room for the KV pool: the weights ({_gib(weights.bytes)} GiB) exceed "
                            f"mem_fraction_static x free memory ({_gib(budget.free_before_load * fraction)} GiB); "
                            "SGLang raises 'Not enough memory. Please try to increase --mem-fraction-static'")
        smallest = math.ceil(weights.bytes / budget.free_before_load * 10000) / 10000  # rest >= 0: f >= w / free
        plan.fixes += [f"--gpu-memory-utilization {smallest:.4f} or higher (mem_fraction_static: the KV pool is empty "
                       "below it)", f"--tp {spec.tp * 2}"]
    elif budget.tokens_low <= 0:
        plan.verdict = "may-not-start"
        plan.reasons.append(f"with the CUDA context at the high end of its range ({_gib(context.high)} GiB) the KV pool "
                            "is empty: SGLang raises 'Not enough memory. Please try to increase --mem-fraction-static'")
        plan.fixes.append(f"--tp {spec.tp * 2}")
    elif budget.tokens_low < max_len:
        plan.notes.append(f"the token pool ({budget.tokens:,}; {budget.tokens_low:,} with the CUDA context at the high "
                          f"end of its range) can be shorter than max_model_len {max_len}: SGLang starts, and caps "
                          "requests at the pool")
    return plan


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def plan_doc(plan: ServePlan) -> dict:
    """The JSON document of a plan (bytes as integers)."""
    s = plan.spec
    doc = {
        "engine": s.engine, "model": s.model, "total_bytes": s.total_bytes, "gpu": s.card,
        "settings": {"max_model_len": plan.max_model_len, "utilization": plan.utilization,
                     "utilization_source": plan.utilization_source, "tp": s.tp, "kv_dtype": s.kv_dtype,
                     "dtype": plan.kv.dtype if s.kv_dtype == "auto" else None, "block_size": s.block_size,
                     "max_num_seqs": plan.max_num_seqs or None, "max_num_batched_tokens": plan.max_num_batched_tokens or None,
                     "batching_source": plan.batching_source or None, "cuda_graphs": s.cuda_graphs},
        "kv": plan.kv.to_dict(), "kv_bytes_per_token": plan.kv.bytes_per_token, "weights": plan.weights.to_dict(),
        "profile_run": plan.profile.to_dict() if plan.profile else None,
        "context": plan.context.to_dict() if plan.context else None,
        "verdict": plan.verdict, "starts": plan.starts, "reasons": plan.reasons, "fixes": plan.fixes,
        "longest_context": plan.longest_context, "notes": plan.notes, "seconds": round(plan.seconds, 3),
        "non_torch": plan.non_torch.to_dict() if plan.non_torch else None,
        "non_torch_calibrated": bool(plan.spec.non_torch is not None),
    }
    if plan.vllm is not None:
        b = plan.vllm
        doc.update(budget=b.to_dict(), kv_cache_bytes=b.available.bytes, kv_cache_bytes_low=b.available.low,
                   kv_cache_bytes_high=b.available.high, blocks=b.layout.blocks, kv_tokens=b.layout.tokens,
                   kv_tokens_low=b.layout_low.tokens, kv_tokens_high=b.layout_high.tokens,
                   concurrency=b.layout.concurrency, sequences=b.layout.sequences,
                   concurrency_low=b.layout_low.concurrency, concurrency_high=b.layout_high.concurrency,
                   sequences_low=b.layout_low.sequences, sequences_high=b.layout_high.sequences,
                   longest_context_low=plan.longest_context_low, longest_context_high=plan.longest_context_high)
    else:
        g = plan.sglang
        doc.update(budget=g.to_dict(), kv_cache_bytes=g.rest.bytes, kv_cache_bytes_low=g.rest.low,
                   kv_cache_bytes_high=g.rest.high, blocks=None, kv_tokens=g.tokens, kv_tokens_low=g.tokens_low,
                   kv_tokens_high=g.tokens_high, concurrency=g.tokens / plan.max_model_len, sequences=g.sequences,
                   concurrency_low=g.tokens_low / plan.max_model_len, concurrency_high=g.tokens_high / plan.max_model_len,
                   sequences_low=g.tokens_low // plan.max_model_len, sequences_high=g.tokens_high // plan.max_model_len,
                   longest_context_low=g.tokens_low, longest_context_high=g.tokens_high)
    return doc

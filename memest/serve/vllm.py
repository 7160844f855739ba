"""vLLM (v1 engine): its start-up arithmetic, step by step (each step names the function that does it), the
verdict and the fixes.

1. requested = total x gpu_memory_utilization  (vllm/v1/worker/gpu_worker.py ``Worker.init_device``; it
   refuses to start when the free memory at start-up is below this)
2. non-KV = weights + torch peak increase of the profile run + non-torch increase [+ CUDA-graph estimate]
   (vllm/utils/mem_utils.py ``memory_profiling`` -> ``MemoryProfilingResult.non_kv_cache_memory``; the CUDA
   graph estimate is subtracted since v0.21, ``VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS``, PR #30515)
3. available KV = requested - non-KV  (gpu_worker.py ``Worker.determine_available_memory``)
4. blocks = available // page_size // layers (one group) or // group_size (hybrid sliding + full)
   (vllm/v1/core/kv_cache_utils.py ``get_num_blocks``, ``_get_kv_cache_config_uniform_type``,
   ``_get_kv_cache_config_uniform_page_size``)
5. tokens = blocks x block_size ("GPU KV cache size: N tokens"; hybrid: blocks // groups x block_size)
6. concurrency = blocks / cdiv(one request's bytes, bytes per block)  (``get_max_concurrency_for_kv_cache_config``)
7. will not start when available <= 0, or one max_model_len request needs more than available
   (``check_enough_kv_cache_memory``); the longest length that fits: ``estimate_max_model_len``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

from memest.serve import evidence
from memest.serve.budget import Part
from memest.serve.engine import Gate, ServeEngine, ServePlan, Setup, Sizes, gib
from memest.serve.kv import ModelKV, cdiv, model_kv
from memest.serve.model import build_meta
from memest.serve.profile import profile_floor, rank_config, remember, trace_profile_run
from memest.serve.weights import weights_per_rank
from memest.spec.choices import CudaGraphs, KvDtype, ServeVerdict

# ------------------------------------------------------------------------------------------ arithmetic


@dataclass
class KVLayout:
    """Blocks, tokens and per-request needs of a KV budget (steps 4-7), for one rank."""

    available_bytes: int
    page_bytes: int  # one block of one layer
    layers_per_pool: int  # how many layers share the blocks: all of them, or the hybrid group size
    groups: int  # KV cache groups (1 unless sliding and full layers are mixed)
    blocks: int
    tokens: int
    request_bytes: int  # one max_model_len request in every layer (check_enough_kv_cache_memory)
    blocks_per_request: int
    concurrency: float  # vLLM's "Maximum concurrency for N tokens per request"
    sequences: int  # whole sequences of max_model_len that fit at once (floor of the concurrency)

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def sizes(self) -> Sizes:
        return Sizes(self.blocks, self.tokens, self.concurrency, self.sequences)


def kv_layout(kv: ModelKV, available: int, block_size: int, max_model_len: int, max_num_batched_tokens: int) -> KVLayout:
    """Steps 4-6 for one rank's available KV bytes (may be <= 0: no blocks)."""
    page = kv.layers[0].page_bytes(block_size)
    by_kind: dict[tuple, int] = {}
    for layer in kv.layers:
        key = (layer.kind, layer.window)
        by_kind[key] = by_kind.get(key, 0) + 1
    if len(by_kind) == 1:
        pool_layers, groups = len(kv.layers), 1
    else:  # hybrid: groups of the smallest type's layer count, padded (uniform page size)
        pool_layers = min(by_kind.values())
        groups = sum(cdiv(n, pool_layers) for n in by_kind.values())
    blocks = max(int(max(available, 0) // page // pool_layers), 0)
    tokens = (blocks // groups) * block_size
    request = request_bytes(kv, block_size, max_model_len, max_num_batched_tokens)
    per_group_usage = sum(_group_usage(kv, key, block_size, max_model_len, max_num_batched_tokens)
                          for key in by_kind for _ in range(cdiv(by_kind[key], pool_layers)))
    blocks_per_request = cdiv(pool_layers * per_group_usage, page * pool_layers)
    concurrency = blocks / blocks_per_request if blocks_per_request else 0.0
    return KVLayout(int(available), page, pool_layers, groups, blocks, tokens, request, blocks_per_request,
                    concurrency, int(concurrency))


def _group_usage(kv: ModelKV, key: tuple, block_size: int, max_model_len: int, max_num_batched_tokens: int) -> int:
    layer = next(x for x in kv.layers if (x.kind, x.window) == key)
    return layer.max_memory_usage_bytes(block_size, max_model_len, max_num_batched_tokens)


def request_bytes(kv: ModelKV, block_size: int, max_model_len: int, max_num_batched_tokens: int) -> int:
    """One request of max_model_len tokens over every layer (kv_cache_utils.max_memory_usage_bytes)."""
    return sum(x.max_memory_usage_bytes(block_size, max_model_len, max_num_batched_tokens) for x in kv.layers)


def longest_context(kv: ModelKV, available: int, block_size: int, max_num_batched_tokens: int, limit: int) -> int:
    """The longest max_model_len one request fits in ``available`` (estimate_max_model_len's binary
    search, over 1..limit); 0 when not even one token fits."""
    def fits(n: int) -> bool:
        return request_bytes(kv, block_size, n, max_num_batched_tokens) <= available

    if available <= 0 or not fits(1):
        return 0
    lo, hi = 1, max(limit, 1)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


@dataclass
class VllmBudget:
    total_bytes: int
    utilization: float
    requested_bytes: int
    parts: list[Part]  # weights, activation peak, non-torch, CUDA graphs (what is subtracted)
    available: Part  # the KV bytes (expected and range: expected parts, then the parts' high / low ends)
    layout: KVLayout
    layout_low: KVLayout  # with every part at its high end
    layout_high: KVLayout  # with every part at its low end
    notes: list[str] = field(default_factory=list)

    @property
    def non_kv_bytes(self) -> int:
        return sum(p.bytes for p in self.parts)

    def to_dict(self) -> dict:
        return {"total_bytes": self.total_bytes, "utilization": self.utilization,
                "requested_bytes": self.requested_bytes, "non_kv_bytes": self.non_kv_bytes,
                "parts": [p.to_dict() for p in self.parts], "available": self.available.to_dict(),
                "layout": self.layout.to_dict(), "layout_low": self.layout_low.to_dict(),
                "layout_high": self.layout_high.to_dict(), "notes": self.notes}


def vllm_budget(total: int, utilization: float, parts: list[Part], kv: ModelKV, block_size: int,
                max_model_len: int, max_num_batched_tokens: int) -> VllmBudget:
    """Steps 1-6. ``total``: the GPU's memory as cudaMemGetInfo reports it (torch.cuda.mem_get_info)."""
    requested = int(total * utilization)  # MemorySnapshot.total_memory * gpu_memory_utilization (float)
    expected = requested - sum(p.bytes for p in parts)
    low = requested - sum(p.high for p in parts)
    high = requested - sum(p.low for p in parts)
    available = Part("KV cache", expected, low, high, "requested - weights - activation peak - non-torch"
                     " [- CUDA graphs] (gpu_worker.py determine_available_memory)")

    def layout(avail: int) -> KVLayout:
        return kv_layout(kv, avail, block_size, max_model_len, max_num_batched_tokens)

    return VllmBudget(total, utilization, requested, parts, available, layout(expected), layout(low), layout(high))


# -------------------------------------------------------------------------------------------- engine


class VllmEngine(ServeEngine):
    def __init__(self, setup: Setup, budget: VllmBudget, utilization_source: str):
        self.setup, self.budget, self.utilization_source = setup, budget, utilization_source

    @classmethod
    def plan(cls, setup: Setup) -> ServePlan:
        spec, config, kv = setup.spec, setup.config, setup.kv
        util = spec.utilization if spec.utilization is not None else evidence.DEFAULT_UTILIZATION
        util_src = "--gpu-memory-utilization" if spec.utilization is not None else "vLLM default 0.9 (config/cache.py)"
        profile, weights = _profile(setup)
        parts = [Part.exact("weights", weights.bytes, f"{weights.parameters:,} parameters as {setup.dtype} on one of "
                            f"{spec.tp} rank(s), + rotary cache (serve/weights.py)"), profile.activation,
                 spec.non_torch or evidence.non_torch(spec.tp)]
        notes = list(setup.notes)
        if spec.utilization is None:
            notes.append(evidence.DEFAULT_UTILIZATION_NEWER)
        if spec.non_torch is None:
            notes.append(evidence.NON_TORCH_OLDER)
        graphs = evidence.cuda_graphs(spec.cuda_graphs)
        if graphs is not None:
            parts.append(graphs)
        elif spec.cuda_graphs == CudaGraphs.AFTER:
            notes.append(evidence.CUDA_GRAPHS_AFTER)
        max_len, batched = setup.max_model_len, setup.max_num_batched_tokens
        budget = vllm_budget(spec.total_bytes, util, parts, kv, spec.block_size, max_len, batched)
        plan = ServePlan(spec, setup.model_name, max_len, setup.max_positions, util, util_src, setup.max_num_seqs,
                         batched, setup.batching_source, kv, weights, profile, cls(setup, budget, util_src),
                         context=setup.context, notes=notes + profile.notes, config=config)
        limit = max(setup.max_positions or 0, max_len)
        plan.longest_context = longest_context(kv, budget.available.bytes, spec.block_size, batched, limit)
        plan.longest_context_low = longest_context(kv, budget.available.low, spec.block_size, batched, limit)
        plan.longest_context_high = longest_context(kv, budget.available.high, spec.block_size, batched, limit)
        if plan.longest_context == limit:
            plan.notes.append(f"one sequence fits at every length up to {limit:,} tokens (the model's positions or "
                              "--max-model-len, whichever is larger); memest searches no further")
        _verdict(plan, budget)
        return plan

    @property
    def kv_cache(self) -> Part:
        return self.budget.available

    def sizes(self) -> tuple[Sizes, Sizes, Sizes]:
        b = self.budget
        return b.layout_low.sizes, b.layout.sizes, b.layout_high.sizes

    def steps(self) -> list[Part]:
        b = self.budget
        requested = Part.exact(f"requested (x {b.utilization:g})", b.requested_bytes,
                               f"{self.utilization_source}; gpu_worker.py init_device")
        return [requested] + [replace(x, name=f"- {x.name}") for x in b.parts]

    def capacity_lines(self) -> list[str]:
        lay, low, high = self.budget.layout, self.budget.layout_low, self.budget.layout_high
        s = self.setup
        return [f"blocks: {lay.blocks:,} of {s.spec.block_size} tokens ({low.blocks:,}-{high.blocks:,}); "
                f"GPU KV cache size: {lay.tokens:,} tokens ({low.tokens:,}-{high.tokens:,})",
                f"maximum concurrency for {s.max_model_len:,} tokens per request: {lay.concurrency:.2f}x "
                f"({low.concurrency:.2f}-{high.concurrency:.2f}) -> {lay.sequences} full-length sequences at "
                f"once, {low.sequences} for certain, up to {high.sequences} (max_num_seqs {s.max_num_seqs}, "
                f"max_num_batched_tokens {s.max_num_batched_tokens})"]

    def gate(self, sequences: int) -> Gate:
        b = self.budget
        kv = sequences * b.layout.request_bytes
        return Gate(sum(p.low for p in b.parts) + kv, b.non_kv_bytes + kv, sum(p.high for p in b.parts) + kv,
                    b.requested_bytes, f"x {b.utilization:g}")

    @property
    def non_torch(self) -> Part | None:
        return next((p for p in self.budget.parts if p.name == evidence.NON_TORCH_NAME), None)


def _profile(setup: Setup):
    """The profile run and the weights on one rank: traced once per model and profile inputs (``setup.profiles``,
    by default kept for the process: the same config, tp, tokens, requests, dtype and GPU generation trace the same
    run), or, for ``setup.floor``, the profile run's lower bound and the weights of the rank's model on the meta
    device (the same parameters the traced rank model holds), without a trace."""
    spec, config = setup.spec, setup.config
    to_json = getattr(config, "to_json_string", None)
    key = (to_json() if to_json else id(config), spec.tp, setup.max_num_batched_tokens, setup.max_num_seqs,
           setup.dtype, spec.compute_capability)
    if key in setup.profiles:  # traced before (a fix's re-plan that changes none of the profile's inputs)
        return setup.profiles[key]
    if setup.floor:
        weights_key = ("weights",) + key[:2] + (setup.dtype,)
        if weights_key not in setup.profiles:
            rank, _ = rank_config(config, spec.tp)
            split = spec.tp == 1 or rank is not config
            remember(setup.profiles, weights_key,
                     weights_per_rank(build_meta(rank), config, spec.tp, setup.dtype, split=split))
        floor = profile_floor(config, setup.max_num_batched_tokens, setup.max_num_seqs, setup.dtype)
        return floor, setup.profiles[weights_key]
    profile = trace_profile_run(config, spec.tp, setup.max_num_batched_tokens, setup.max_num_seqs,
                                setup.dtype, spec.compute_capability)
    if profile.model is not None:
        weights = weights_per_rank(profile.model, config, spec.tp, setup.dtype, split=profile.split)
    else:
        weights = weights_per_rank(build_meta(config), config, spec.tp, setup.dtype)
    profile.model = None  # the fake model is not needed past here
    remember(setup.profiles, key, (profile, weights))
    return profile, weights


# ------------------------------------------------------------------------------------ verdict, fixes


def _verdict(plan: ServePlan, b: VllmBudget) -> None:
    """starts: one max_model_len sequence fits with every cost at the high end of its range (the low end of the KV
    range); may-not-start: it fits only with the expected or the low-end costs; will-not-start: not even then, or a
    refusal that does not depend on the ranges. Each refusal names its reason and fixes."""
    spec = plan.spec
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
        plan.reasons.append(f"free memory at start-up (~{gib(free_at_start)} GiB after the CUDA context) "
                            + start_msg.format(req=gib(b.requested_bytes), u=b.utilization))
        plan.fixes.append(f"--gpu-memory-utilization {math.floor(free_at_start / spec.total_bytes * 100) / 100:.2f} "
                          "or lower")
    elif free_worst < b.requested_bytes:
        may.append(f"with the CUDA context at the high end of its range ({gib(ctx.high)} GiB) the free memory at "
                   f"start-up ({gib(free_worst)} GiB) " + start_msg.format(req=gib(b.requested_bytes), u=b.utilization))
        plan.fixes.append(f"--gpu-memory-utilization {math.floor(free_worst / spec.total_bytes * 100) / 100:.2f} "
                          "or lower")

    def holds(available: int) -> bool:
        return available > 0 and lay.request_bytes <= available

    need = f"one {plan.max_model_len}-token sequence needs {gib(lay.request_bytes)} GiB of KV cache"
    if not holds(b.available.bytes):
        if b.available.bytes <= 0:
            why = (f"no memory left for the KV cache: weights, activations and the rest take {gib(b.non_kv_bytes)} "
                   f"GiB of the {gib(b.requested_bytes)} GiB requested ('No available memory for the cache blocks', "
                   "kv_cache_utils.py)")
        else:
            why = (f"{need}, {gib(b.available.bytes)} GiB are available (check_enough_kv_cache_memory); the longest "
                   f"that fits is {plan.longest_context} tokens")
        if holds(b.available.high):
            may.append(f"with the expected costs {why}; it fits only with every cost at the low end of its range "
                       f"({gib(b.available.high)} GiB for the KV cache)")
        else:
            plan.reasons.append(why)
        _kv_fixes(plan, b, b.available.bytes, b.non_kv_bytes, plan.longest_context)
    elif not holds(b.available.low):
        costs = ", ".join(f"{p.name} {gib(p.high)}" for p in b.parts if p.high != p.bytes)
        may.append(f"with every cost at the high end of its range ({costs} GiB) {gib(max(b.available.low, 0))} GiB "
                   f"remain for the KV cache and {need} (check_enough_kv_cache_memory); the longest that surely fits "
                   f"is {plan.longest_context_low} tokens")
        _kv_fixes(plan, b, b.available.low, sum(p.high for p in b.parts), plan.longest_context_low, "surely ")
    if plan.reasons:
        plan.verdict = ServeVerdict.WILL_NOT_START
        plan.reasons += may
    elif may:
        plan.verdict = ServeVerdict.MAY_NOT_START
        plan.reasons += may
        if plan.non_torch is not None and plan.non_torch.low != plan.non_torch.high:
            plan.fixes.append("--non-torch-memory GiB (the non-torch figure of your own vLLM start-up log) or "
                              "--calibration FILE: a measured value narrows the range")


def _kv_fixes(plan: ServePlan, b: VllmBudget, available: int, non_kv: int, longest: int, surely: str = "") -> None:
    """What would make one max_model_len sequence fit in ``available`` KV bytes (``non_kv``: what is subtracted
    before it): a shorter length, a larger share, fp8 KV, more GPUs."""
    spec = plan.spec
    need_util = (non_kv + b.layout.request_bytes) / spec.total_bytes
    start_limit = (spec.total_bytes - plan.context.bytes) / spec.total_bytes
    if longest >= spec.block_size:
        plan.fixes.append(f"--max-model-len {longest} (the longest one sequence {surely}fits)")
    if not surely and plan.longest_context_low >= spec.block_size and plan.longest_context_low < longest:
        plan.fixes.append(f"--max-model-len {plan.longest_context_low} (the longest one sequence surely fits)")
    if b.utilization < need_util <= start_limit:
        plan.fixes.append(f"--gpu-memory-utilization {math.ceil(need_util * 100) / 100:.2f}")
    if spec.kv_dtype == KvDtype.AUTO and available > 0 and plan.config is not None:
        kv8 = model_kv(plan.config, spec.tp, KvDtype.FP8, spec.dtype)
        need8 = request_bytes(kv8, spec.block_size, plan.max_model_len, plan.max_num_batched_tokens)
        if need8 <= available:
            plan.fixes.append(f"--kv-dtype fp8 (one sequence then needs {gib(need8)} GiB)")
    plan.fixes.append(f"--tp {spec.tp * 2} (weights and KV heads split over {spec.tp * 2} GPUs)")

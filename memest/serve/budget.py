"""The serving engines' own start-up arithmetic: how much memory the KV cache gets, how many blocks and
tokens that is, how many sequences fit, and whether the engine starts.

vLLM (v1 engine), step by step (each step names the function that does it):

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

SGLang: rest = free after loading - free before loading x (1 - mem_fraction_static); tokens = rest // cell
(python/sglang/srt/model_executor/model_runner.py ``profile_max_num_token``); activations, CUDA graphs and
everything else live in the (1 - mem_fraction_static) share, not subtracted one by one.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from memest.serve.kv import ModelKV, cdiv


@dataclass(frozen=True)
class Part:
    """One term of the budget: expected bytes with a low-high range and where the number comes from."""

    name: str
    bytes: int
    low: int
    high: int
    source: str

    @classmethod
    def exact(cls, name: str, value: int, source: str) -> Part:
        return cls(name, int(value), int(value), int(value), source)

    def to_dict(self) -> dict:
        return asdict(self)


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


@dataclass
class SglangBudget:
    total_bytes: int
    mem_fraction_static: float
    mem_fraction_source: str
    free_before_load: int  # after the CUDA context and distributed init
    weights_bytes: int
    rest: Part  # the KV bytes: free after load - free before load x (1 - fraction)
    cell_bytes: int
    tokens: int
    tokens_low: int
    tokens_high: int
    sequences: int  # whole max_model_len sequences (token pool / max_model_len; page size 1)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {k: (v.to_dict() if isinstance(v, Part) else v) for k, v in self.__dict__.items()}


def sglang_default_fraction(total: int, tp: int) -> tuple[float, str]:
    """SGLang's default mem_fraction_static for a GPU of ``total`` bytes: (gpu_mem - reserved) / gpu_mem
    with reserved by memory class (python/sglang/srt/server_args.py ``ServerArgs.__post_init__``,
    2025 releases: < 35 GiB: 2.8 + tp/10 GiB; < 90 GiB (H100, A100): 9.5 + tp/2; < 160 GiB (H20, H200):
    12 + tp/2; else 32 GiB); older releases used 0.88 / 0.87 / 0.85 / 0.81 / 0.79 by TP size."""
    mib = total / 2**20
    if mib < 35 * 1024:
        reserved = (2.8 + tp / 10) * 1024
    elif mib < 90 * 1024:
        reserved = (9.5 + tp / 2) * 1024
    elif mib < 160 * 1024:
        reserved = (12 + tp / 2) * 1024
    else:
        reserved = 32 * 1024
    return round((mib - reserved) / mib, 3), (f"SGLang default for a {mib / 1024:.0f} GiB GPU at tp {tp}: "
                                              f"(gpu_mem - {reserved / 1024:g} GiB) / gpu_mem (server_args.py)")


def sglang_budget(total: int, fraction: float, fraction_source: str, context: Part, weights: int, kv: ModelKV,
                  max_model_len: int) -> SglangBudget:
    """``profile_max_num_token``: total_gpu_memory there is the free memory after distributed init
    (the CUDA context is gone from it); available_gpu_memory the free memory after loading the weights."""
    from memest.serve.kv import sglang_cell_bytes

    cell = sglang_cell_bytes(kv)

    def tokens(ctx: int) -> tuple[int, int]:
        before = total - ctx
        rest = (before - weights) - before * (1 - fraction)
        return int(rest), max(int(rest // cell), 0)

    rest, n = tokens(context.bytes)
    rest_low, n_low = tokens(context.high)
    rest_high, n_high = tokens(context.low)
    part = Part("KV cache", rest, rest_low, rest_high, "free after load - free before load x (1 - mem_fraction_static)"
                " (model_runner.py profile_max_num_token)")
    return SglangBudget(total, fraction, fraction_source, total - context.bytes, weights, part, cell, n, n_low, n_high,
                        n // max_model_len if max_model_len else 0)

"""KV-cache bytes per token and per block, from a transformers config, as the serving engines size them.

vLLM (v1 engine) describes each attention layer by a KV-cache spec (vllm/v1/kv_cache_interface.py):

- ``AttentionSpec.real_page_size_bytes`` = 2 (K and V) x block_size x num_kv_heads x head_size x dtype size;
- ``MLAAttentionSpec.real_page_size_bytes`` = block_size x 1 x (kv_lora_rank + qk_rope_head_dim) x dtype size
  (one latent vector per token, no separate V; vllm/config/model.py ``get_head_size`` / ``get_num_kv_heads``);
- ``FullAttentionSpec.max_memory_usage_bytes`` = cdiv(max_model_len, block_size) x page size;
- ``SlidingWindowSpec.max_memory_usage_bytes`` = (cdiv(min(window - 1 + max_num_batched_tokens,
  max_model_len), block_size) + 1) x page size (the last window plus the tokens being scheduled).

KV heads per tensor-parallel rank: max(1, total // tp) (vllm/config/model.py ``ModelConfig.get_num_kv_heads``:
heads are replicated when tp exceeds them); MLA's latent is not split (one "head" on every rank).
SGLang's cell size is the same product per token (python/sglang/srt/model_executor/model_runner.py
``profile_max_num_token``: kv heads x head_dim x layers x 2 x element size; MLA: (kv_lora_rank +
qk_rope_head_dim) x layers x element size).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from memest.errors import MemestError
from memest.spec.choices import KvDtype

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8": 1}
FULL, SLIDING, MLA = "full", "sliding", "mla"


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class LayerKV:
    """One attention layer's cache as vLLM's spec for it: kind, heads on this rank, head size, window."""

    kind: str  # full | sliding | mla
    kv_heads: int
    head_size: int
    dtype_bytes: int
    window: int | None = None

    def bytes_per_token(self) -> int:
        factor = 1 if self.kind == MLA else 2  # MLA stores one latent; attention stores K and V
        return factor * self.kv_heads * self.head_size * self.dtype_bytes

    def page_bytes(self, block_size: int) -> int:
        return block_size * self.bytes_per_token()

    def max_memory_usage_bytes(self, block_size: int, max_model_len: int, max_num_batched_tokens: int) -> int:
        """vLLM's bytes for one request of max_model_len tokens in this layer (kv_cache_interface.py)."""
        if self.kind == SLIDING:
            tokens = min(self.window - 1 + max_num_batched_tokens, max_model_len)
            return (cdiv(tokens, block_size) + 1) * self.page_bytes(block_size)
        return cdiv(max_model_len, block_size) * self.page_bytes(block_size)


@dataclass
class ModelKV:
    """Every attention layer of the model, on one tensor-parallel rank."""

    layers: list[LayerKV]
    dtype: str  # the cache's dtype name
    notes: list[str] = field(default_factory=list)

    @property
    def bytes_per_token(self) -> int:
        """KV bytes one token takes in every layer of this rank (what a full-attention cache grows by)."""
        return sum(layer.bytes_per_token() for layer in self.layers)

    @property
    def kinds(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for layer in self.layers:
            out[layer.kind] = out.get(layer.kind, 0) + 1
        return out

    def to_dict(self) -> dict:
        return {"bytes_per_token": self.bytes_per_token, "dtype": self.dtype, "layers": len(self.layers),
                "kinds": self.kinds, "layer_specs": [asdict(x) for x in _distinct(self.layers)], "notes": self.notes}


def _distinct(layers: list[LayerKV]) -> list[LayerKV]:
    seen: list[LayerKV] = []
    for layer in layers:
        if layer not in seen:
            seen.append(layer)
    return seen


def _get(config, *names, default=None):
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return default


def model_dtype(config, dtype: str = "auto") -> str:
    """The weights' dtype vLLM serves with. ``auto``: the config's torch_dtype when it is 16-bit; a
    float32 (or missing) config is served in float16 ("Following common practice, we use float16 for
    float32 models": vllm/config/model.py ``_get_and_verify_dtype``)."""
    if dtype != "auto":
        return {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}.get(dtype, dtype)
    raw = _get(config, "torch_dtype", "dtype")
    name = str(raw).replace("torch.", "") if raw is not None else "float32"
    return name if name in ("bfloat16", "float16") else "float16"


def attention_layers(config) -> int:
    return int(_get(config, "num_hidden_layers", "n_layer", "num_layers"))


def model_kv(config, tp: int = 1, kv_dtype: str = KvDtype.AUTO, dtype: str = "auto") -> ModelKV:
    """The KV spec of every attention layer on one of ``tp`` ranks, from a transformers config."""
    if tp < 1:
        raise MemestError(f"--tp must be at least 1, got {tp}")
    if _get(config, "is_encoder_decoder", default=False) or not _get(config, "num_attention_heads", "n_head"):
        raise MemestError(f"{getattr(config, 'model_type', 'this model')}: memest serve sizes decoder-only "
                          "transformers (a causal LM config); this config is not one")
    cache_dtype = model_dtype(config, dtype) if kv_dtype == KvDtype.AUTO else "fp8"
    nbytes = DTYPE_BYTES[cache_dtype]
    n_layers = attention_layers(config)
    notes: list[str] = []
    lora = _get(config, "kv_lora_rank")
    if lora:  # multi-head latent attention (DeepSeek-V2/V3): one latent + rope key per token, not split by TP
        rope = int(_get(config, "qk_rope_head_dim", default=0))
        layer = LayerKV(MLA, 1, int(lora) + rope, nbytes)
        notes.append(f"MLA: {lora} latent + {rope} rope dims per token and layer, replicated on every TP rank "
                     "(vLLM MLAAttentionSpec, SGLang MLA cell size)")
        return ModelKV([layer] * n_layers, cache_dtype, notes)
    heads = int(_get(config, "num_attention_heads", "n_head"))
    kv_heads = int(_get(config, "num_key_value_heads", default=heads))
    head_dim = int(_get(config, "head_dim", default=0) or int(_get(config, "hidden_size", "n_embd")) // heads)
    per_rank = max(1, kv_heads // tp)
    if tp > kv_heads:
        notes.append(f"{kv_heads} KV heads on {tp} ranks: each rank keeps 1 (replicated, vLLM get_num_kv_heads)")
    kinds = _layer_kinds(config, n_layers)
    window = _get(config, "sliding_window")
    layers = [LayerKV(kind, per_rank, head_dim, nbytes, int(window) if kind == SLIDING else None) for kind in kinds]
    if SLIDING in kinds:
        notes.append(f"sliding-window layers ({kinds.count(SLIDING)} of {n_layers}, window {window}): vLLM keeps "
                     "window - 1 + max_num_batched_tokens tokens per request in them (SlidingWindowSpec)")
    return ModelKV(layers, cache_dtype, notes)


def _layer_kinds(config, n_layers: int) -> list[str]:
    """full / sliding per layer: transformers' ``layer_types`` when the config has it; else a
    ``sliding_window`` applies to every layer unless the config switches it off (Qwen2/3's
    use_sliding_window false; their max_window_layers bound is ignored when it is off)."""
    types = _get(config, "layer_types")
    if types:
        return [SLIDING if "sliding" in str(t) else FULL for t in types][:n_layers]
    window = _get(config, "sliding_window")
    if window and _get(config, "use_sliding_window", default=True):
        return [SLIDING] * n_layers
    return [FULL] * n_layers


def sglang_cell_bytes(kv: ModelKV) -> int:
    """SGLang's cell_size (bytes per token in every layer): the same product as vLLM's per-token bytes;
    it keeps every token in every layer (no sliding-window saving without its hybrid SWA pool)."""
    return sum(layer.bytes_per_token() for layer in kv.layers)

"""Weight bytes on one tensor-parallel rank as vLLM loads them ("Loading model weights took N GiB").

From the model's parameters (built on fake tensors, nothing allocated):

- column/row-parallel projections (attention q/k/v/o, MLP gate/up/down, their fused and GPT-2 forms,
  MoE experts) are split over the ranks (vllm/model_executor/layers/linear.py); K and V keep at least one
  head per rank (``QKVParallelLinear``: heads replicated when tp exceeds them);
- embeddings and the LM head are split by vocabulary, padded to a multiple of 64 rows first
  (vllm/model_executor/layers/vocab_parallel_embedding.py, ``DEFAULT_VOCAB_PADDING_SIZE = 64``); a tied
  head is the embedding (counted once);
- norms and biases of replicated layers are whole on every rank;
- plus the rotary cos/sin cache, max_position_embeddings x rotary_dim in the model dtype, shared by the
  layers (vllm/model_executor/layers/rotary_embedding.py ``RotaryEmbedding._compute_cos_sin_cache``):
  Llama-3.1-8B's 8,030,261,248 bf16 parameters (14.957 GiB) + 131072 x 128 x 2 B = 14.9888 GiB, the
  figure vLLM logs for it (github.com/vllm-project/vllm/issues/10517).
"""

from __future__ import annotations

from dataclasses import dataclass

from memest.serve.kv import DTYPE_BYTES, cdiv

VOCAB_PADDING = 64  # vocab_parallel_embedding.py DEFAULT_VOCAB_PADDING_SIZE
SPLIT = ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "gate_proj", "up_proj", "down_proj", "gate_up_proj",
         "c_attn", "c_proj", "c_fc", "w1", "w2", "w3", "dense_h_to_4h", "dense_4h_to_h", "query_key_value", "dense",
         "fc1", "fc2", "out_proj", "experts")
VOCAB = ("embed_tokens", "lm_head", "wte", "word_embeddings", "embed_out")
KV = ("k_proj", "v_proj")


@dataclass
class Weights:
    bytes: int  # on one rank, parameters + rotary cache
    parameter_bytes: int
    rope_cache_bytes: int
    parameters: int  # parameters of the model counted (one rank's when it was built split), tied ones once

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def _kind(name: str) -> str:
    parts = name.split(".")
    if any(p in VOCAB for p in parts):
        return "vocab"
    if any(p in KV for p in parts):
        return "kv"
    if any(p in SPLIT for p in parts):
        return "split"
    return "whole"


def weights_per_rank(model, config, tp: int, dtype: str, split: bool = False) -> Weights:
    """``model``: the model built on fake tensors (or the meta device); bytes as ``dtype`` on one of ``tp``
    ranks. ``split``: the model is already one rank's (its heads and MLP divided: serve/profile.py
    rank_config), so only the vocabulary split and padding remain to apply."""
    size = DTYPE_BYTES[dtype]
    heads = int(getattr(config, "num_attention_heads", None) or config.n_head)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    per_rank_kv = max(1, kv_heads // tp) / kv_heads  # share of K/V rows one rank keeps
    total_params = 0
    elements = 0
    seen: set[int] = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        key = id(p)
        if key in seen:  # tied LM head: the embedding, loaded once
            continue
        seen.add(key)
        n = p.numel()
        total_params += n
        kind = _kind(name)
        if kind == "vocab" and p.dim() == 2:
            rows = cdiv(p.shape[0], VOCAB_PADDING) * VOCAB_PADDING
            elements += cdiv(rows, tp) * p.shape[1]
        elif split:
            elements += n
        elif kind == "kv":
            elements += int(n * per_rank_kv) if tp > 1 else n
        elif kind in ("split", "vocab") and tp > 1:
            elements += cdiv(n, tp)
        else:
            elements += n
    rope = rope_cache_elements(config)
    return Weights(elements * size + rope * size, elements * size, rope * size, total_params)


def rope_cache_elements(config) -> int:
    """vLLM's cos/sin cache: max_position_embeddings x rotary_dim (cos and sin halves), for rotary models."""
    if getattr(config, "model_type", "") in ("gpt2", "gpt_neo", "opt", "bloom") or \
            getattr(config, "position_embedding_type", None) == "absolute":
        return 0
    positions = getattr(config, "max_position_embeddings", None)
    heads = getattr(config, "num_attention_heads", None)
    if not positions or not heads:
        return 0
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    rope_dim = getattr(config, "qk_rope_head_dim", None) or int(head_dim * getattr(config, "partial_rotary_factor", 1.0))
    return int(positions) * int(rope_dim)

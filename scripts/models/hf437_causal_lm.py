"""transformers 4.37's Llama and Mistral causal LMs where their memory differs from the transformers memest runs
(5.x), as AnswerDotAI/fsdp_qlora's train.py ran them for benchmarks_03_2024.md (Feb-Mar 2024; its README then pinned
transformers 4.37, excluding 4.38 and 4.39). For scripts/bench_gpu_scale.py's fsdp_qlora rows; the factories name
the model and how train.py built it (``scripts/models/hf437_causal_lm.py:llama2_7b_qlora``).

Transcribed from transformers 4.37.2 (the PyPI wheel), models/llama/modeling_llama.py (models/mistral/
modeling_mistral.py is the same in both places), the rest of the model being transformers 5's own code. 4.38.2's
Llama (peft's guides of Feb-Mar 2024) holds the same: the same head and loss, and the per-layer caches kept for
backward compatibility (``_cos_cached`` / ``_sin_cached``, in the default dtype; its forward computes the rotary
embedding from ``inv_freq``). 4.45 moved the rotary embedding to the model (no caches), 4.46 the fp32 upcast into the
loss function (the output's logits in the model's dtype); the shifted fp32 copy is still there in 4.48 (PyPI wheels).

1. The head and the loss (``LlamaForCausalLM.forward``): ``logits = logits.float()`` in the model, returned in the
   output (train.py keeps ``output`` until after ``backward``, so the fp32 logits live through the step), and
   ``CrossEntropyLoss`` over ``logits[..., :-1, :].contiguous()``, a second fp32 copy whose backward
   (``slice_backward``) makes a full-size fp32 gradient. transformers 5 returns the head's bf16 logits and shifts
   the labels instead (``ForCausalLMLoss``), so its step holds less at the loss.
2. Each attention layer's rotary cache (``LlamaRotaryEmbedding.__init__`` -> ``_set_cos_sin_cache``): ``inv_freq``
   (fp32, head_dim / 2) and ``cos_cached`` / ``sin_cached`` (max_position_embeddings x head_dim), made in torch's
   default dtype when the model is built. train.py (05ed9f2) builds the LoRA model with ``torch_dtype=bfloat16``
   (``from_pretrained`` on rank 0, ``from_config(cfg, torch_dtype=...)`` elsewhere): bf16 caches, registered here as
   the layer's buffers (FSDP1's wrap moves and broadcasts them as buffers). It builds the QLoRA model with
   ``AutoModelForCausalLM.from_config(cfg)`` under accelerate's ``init_empty_weights`` (parameters on the meta
   device, buffers real): fp32 caches, which nothing casts (``--precision bf16`` has no FSDP MixedPrecision) and
   which FSDP1's wrap moves and broadcasts with their layer like any buffer. memest's ``--precision bf16`` casts every
   floating buffer (trace/dtype.py ``cast_floating``), so these two are held in ``_Fp32Buffers``, a layer's buffer
   dict that keeps a buffer's tensor when a cast would change only its dtype: still buffers, so memest's replay of the
   wrap moves them with their unit (parallel/fsdp1.py ``load_events``) as the run did. The traced forward computes
   the rotary embedding as transformers 5 does (4.37 indexes the cache in every layer: a batch x seq x head_dim copy,
   recomputed under the run's checkpointing).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn
from torch.nn import CrossEntropyLoss
from transformers import AutoConfig
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.models.llama.modeling_llama import LlamaForCausalLM
from transformers.models.mistral.modeling_mistral import MistralForCausalLM

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = {
    "llama-2-7b": ROOT / "memest" / "data" / "models" / "llama-2-7b.json",
    "llama-2-70b": ROOT / "memest" / "data" / "models" / "llama-2-70b.json",
    "mistral-7b-v0.2": ROOT / "benchmarks" / "configs" / "mistral-7b-v0.2.json",
}
VOCAB_LOW = 0


def _forward_437(self, input_ids=None, labels=None, attention_mask=None, **kwargs):
    """``LlamaForCausalLM.forward`` of transformers 4.37.2 (no pretraining_tp split: 1 in these configs)."""
    outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
    hidden_states = outputs[0]
    logits = self.lm_head(hidden_states)
    logits = logits.float()
    loss = None
    if labels is not None:
        shift_logits = logits[..., :-1, :].contiguous()
        shift_labels = labels[..., 1:].contiguous()
        loss_fct = CrossEntropyLoss()
        shift_logits = shift_logits.view(-1, self.config.vocab_size)
        shift_labels = shift_labels.view(-1)
        shift_labels = shift_labels.to(shift_logits.device)
        loss = loss_fct(shift_logits, shift_labels)
    return CausalLMOutputWithPast(loss=loss, logits=logits)


class Llama437(LlamaForCausalLM):
    forward = _forward_437


class Mistral437(MistralForCausalLM):
    forward = _forward_437


class _Fp32Buffers(dict):
    """A module's ``_buffers`` where an assignment that would change only a buffer's dtype keeps the tensor (a
    dtype cast leaves the QLoRA runs' fp32 caches alone; a device move or a new tensor of the same dtype goes
    through): module docstring, 2."""

    def __setitem__(self, key, value):
        old = self.get(key)
        if old is not None and value is not None and value.dtype != old.dtype and value.device == old.device:
            return
        super().__setitem__(key, value)


class RotaryCache437(nn.Module):
    """``LlamaRotaryEmbedding``'s buffers as 4.37 built them (its forward is not used: see the module docstring)."""

    def __init__(self, dim: int, max_position_embeddings: int, base: float, dtype: torch.dtype):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
        t = torch.arange(max_position_embeddings, dtype=inv_freq.dtype)
        emb = torch.cat((torch.outer(t, inv_freq),) * 2, dim=-1)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        if dtype != torch.bfloat16:  # the QLoRA runs' fp32 caches: kept out of a dtype cast (module docstring)
            self._buffers = _Fp32Buffers(self._buffers)
        self.register_buffer("cos_cached", emb.cos().to(dtype), persistent=False)
        self.register_buffer("sin_cached", emb.sin().to(dtype), persistent=False)


def build(config, cache_dtype: torch.dtype, rope_theta: float) -> nn.Module:
    """4.37's causal LM for a transformers 5 Llama or Mistral ``config``, with its rotary caches in ``cache_dtype``."""
    config.use_cache = False
    cls = Mistral437 if config.model_type == "mistral" else Llama437
    model = cls(config)
    head_dim = config.hidden_size // config.num_attention_heads
    for layer in model.model.layers:
        layer.self_attn.rotary_emb = RotaryCache437(head_dim, config.max_position_embeddings, rope_theta, cache_dtype)
    return model


def _build(name: str, cache_dtype: torch.dtype) -> nn.Module:
    raw = json.loads(CONFIGS[name].read_text())
    config = AutoConfig.for_model(**{k: v for k, v in raw.items() if not k.startswith("_")})
    return build(config, cache_dtype, raw["rope_theta"])  # 4.37's config.rope_theta (5.x: config.rope_parameters)


def llama2_7b_lora() -> nn.Module:
    return _build("llama-2-7b", torch.bfloat16)


def llama2_7b_qlora() -> nn.Module:
    return _build("llama-2-7b", torch.float32)


def llama2_70b_qlora() -> nn.Module:
    return _build("llama-2-70b", torch.float32)


def llama2_70b_bf16_cache() -> nn.Module:
    """peft's Llama-2 70B guides (transformers 4.38, Feb-Mar 2024): the model loaded with torch_dtype bf16, or cast
    to bf16 by DeepSpeed, so the rotary caches are bf16."""
    return _build("llama-2-70b", torch.bfloat16)


def mistral_7b_v02_qlora() -> nn.Module:
    return _build("mistral-7b-v0.2", torch.float32)


build_model = llama2_7b_lora


def example_inputs(batch_size: int, seq_len: int = 2048):
    """train.py's batch: input_ids and labels (its dummy dataset: every row ``seq_len`` tokens), no attention mask."""
    ids = torch.randint(VOCAB_LOW, 32000, (batch_size, seq_len))
    return {"input_ids": ids, "labels": ids.clone()}

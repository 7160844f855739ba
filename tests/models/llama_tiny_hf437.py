"""A tiny Llama in transformers 4.37's form (scripts/models/hf437_causal_lm.py, the benchmark's model for
fsdp_qlora's 2024 runs): fp32 logits kept in the output, the loss over a contiguous copy of the shifted logits,
each layer's rotary cache (build_model: bf16 buffers, as the LoRA runs built it; build_fp32_cache: fp32 buffers a
dtype cast leaves alone, as the QLoRA runs held them); build_today: the same shapes in transformers 5's form."""

import importlib.util
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

_ERA = Path(__file__).resolve().parents[2] / "scripts" / "models" / "hf437_causal_lm.py"
_spec = importlib.util.spec_from_file_location("hf437_causal_lm", _ERA)
era = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(era)

LAYERS, HIDDEN, HEADS, VOCAB, MAX_POS = 2, 64, 4, 8000, 256


def _config() -> LlamaConfig:
    return LlamaConfig(hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                       num_key_value_heads=HEADS, vocab_size=VOCAB, max_position_embeddings=MAX_POS, use_cache=False,
                       tie_word_embeddings=False)


def build_model():
    return era.build(_config(), torch.bfloat16, 10000.0)


def build_fp32_cache():
    return era.build(_config(), torch.float32, 10000.0)


def build_today():
    return LlamaForCausalLM(_config())


def example_inputs(batch_size: int, seq_len: int = 32):
    ids = torch.randint(0, VOCAB, (batch_size, seq_len))
    return {"input_ids": ids, "labels": ids.clone()}

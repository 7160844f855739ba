"""transformers models built in a model file with a selective-checkpointing policy of their own
(--checkpointing selective:checkpoint_policy): build_model is tests/configs/llama-tiny.json's Llama (as
tests/models/hf_by_hand.py builds it), build_gpt2 tests/configs/gpt2-tiny.json's GPT-2."""

import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

VOCAB = 1000


def build_model():
    config = LlamaConfig(
        hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, use_cache=False,
    )
    return LlamaForCausalLM(config)


def build_gpt2():
    config = GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=128, vocab_size=VOCAB, bos_token_id=0,
                        eos_token_id=0)
    return GPT2LMHeadModel(config)


def example_inputs(batch_size, seq_len=64):
    ids = torch.randint(0, VOCAB, (batch_size, seq_len))
    return {"input_ids": ids, "labels": ids.clone()}


_SAVED = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)


def checkpoint_policy(ctx, op, *args, **kwargs):
    """Save every matmul's output (the projections, Conv1D's addmm), recompute the rest in backward."""
    return op in _SAVED  # a bool: True saves (MUST_SAVE), False recomputes (PREFER_RECOMPUTE)

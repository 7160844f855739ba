"""transformers models built in a model file with a selective-checkpointing policy of their own
(--checkpointing selective:checkpoint_policy): build_model is tests/configs/llama-tiny.json's Llama (as
tests/models/hf_by_hand.py builds it), build_gpt2 tests/configs/gpt2-tiny.json's GPT-2."""

import torch
from hf_by_hand import VOCAB, build_model, example_inputs  # noqa: F401 (the model file's build_model/example_inputs)
from transformers import GPT2Config, GPT2LMHeadModel


def build_gpt2():
    config = GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=128, vocab_size=VOCAB, bos_token_id=0,
                        eos_token_id=0)
    return GPT2LMHeadModel(config)


_SAVED = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)


def checkpoint_policy(ctx, op, *args, **kwargs):
    """Save every matmul's output (the projections, Conv1D's addmm), recompute the rest in backward."""
    return op in _SAVED  # a bool: True saves (MUST_SAVE), False recomputes (PREFER_RECOMPUTE)

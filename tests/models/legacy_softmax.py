"""Eager attention layers whose softmax is the benchmark's torch < 1.11 emulation
(scripts/models/hf_bert_large_2022.py: autograd holds the softmax input as well as its output), or
today's softmax (build_today): a test that the emulation saves what it says and that memest traces it as
the real CPU run allocates."""

import importlib.util
from pathlib import Path

import torch
from torch import nn

_ERA = Path(__file__).resolve().parents[2] / "scripts" / "models" / "hf_bert_large_2022.py"
_spec = importlib.util.spec_from_file_location("hf_bert_large_2022", _ERA)
era = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(era)  # imports torch only; transformers 4.16 is needed by its build_model alone

LAYERS, HEADS, DIM = 3, 4, 64


class Attention(nn.Module):
    def __init__(self, softmax):
        super().__init__()
        self.qkv, self.out, self.softmax = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM), softmax

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, HEADS, DIM // HEADS).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        scores = q @ k.transpose(-1, -2) / (DIM // HEADS) ** 0.5 + 0.0  # a fresh tensor, as BERT's + mask
        probs = self.softmax(scores, dim=-1)
        return self.out((probs @ v).transpose(1, 2).reshape(b, s, DIM)) + x


def build_model():
    return nn.Sequential(*(Attention(era._legacy_softmax) for _ in range(LAYERS)))


def build_today():
    return nn.Sequential(*(Attention(torch.softmax) for _ in range(LAYERS)))


def example_inputs(batch_size, seq_len=32):
    return (torch.randn(batch_size, seq_len, DIM),)

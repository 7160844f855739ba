"""A small token model whose example_inputs has a default sequence length (128)."""

import torch
from torch import nn


class TokenMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(1000, 64)
        self.mix = nn.Linear(64, 64)
        self.head = nn.Linear(64, 1000)

    def forward(self, tokens):
        return self.head(torch.relu(self.mix(self.embed(tokens))))


def build_model():
    return TokenMLP()


def example_inputs(batch_size, seq_len=128):
    return {"tokens": torch.randint(0, 1000, (batch_size, seq_len))}


def compute_loss(logits, inputs):
    return nn.functional.cross_entropy(logits.reshape(-1, 1000), inputs["tokens"].reshape(-1))

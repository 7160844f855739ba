"""A tiny LM whose output projection shares the embedding matrix (tied weights)."""

import torch
from torch import nn


class TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(2000, 128)
        self.mix = nn.Linear(128, 128)
        self.head = nn.Linear(128, 2000, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        return self.head(torch.tanh(self.mix(self.embed(tokens))))


def build_model():
    return TiedLM()


def example_inputs(batch_size, seq_len=16):
    return {"tokens": torch.randint(0, 2000, (batch_size, seq_len or 16))}


def compute_loss(logits, inputs):
    return nn.functional.cross_entropy(logits.reshape(-1, 2000), inputs["tokens"].reshape(-1))

"""One block applied several times in a forward (weights shared across calls)."""

import torch
from torch import nn


class Repeated(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(64, 256)
        self.block = nn.Sequential(nn.Linear(256, 256), nn.GELU())
        self.out = nn.Linear(256, 1)

    def forward(self, x):
        h = self.inp(x)
        for _ in range(4):
            h = h + self.block(h)
        return self.out(h)


def build_model():
    return Repeated()


def example_inputs(batch_size, seq_len=None):
    return (torch.randn(batch_size, 64),)

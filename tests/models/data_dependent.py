"""A forward with a data-dependent op: memest cannot trace it and must say so."""

import torch
from torch import nn


class Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x)
        if h.sum().item() > 0:
            h = h * 2
        return h


def build_model():
    return Gate()


def example_inputs(batch_size, seq_len=None):
    return (torch.randn(batch_size, 8),)

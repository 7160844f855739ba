"""Boolean-mask indexing (nonzero under the hood): output size depends on values."""

import torch
from torch import nn


class Select(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x)
        return h[h > 0]


def build_model():
    return Select()


def example_inputs(batch_size, seq_len=None):
    return (torch.randn(batch_size, 8),)

"""A model file whose forward calls CUDA itself (memest maps devices, but cannot run CUDA calls)."""

import torch
from torch import nn


class Synced(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        torch.cuda.synchronize()
        return self.linear(x)


def build_model():
    return Synced()


def example_inputs(batch_size, seq_len=None):
    return (torch.randn(batch_size, 8),)

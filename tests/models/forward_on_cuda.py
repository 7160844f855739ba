"""A model file whose forward makes a tensor on device='cuda': placed on memest's traced device."""

import torch
from torch import nn


class OnCuda(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        return self.linear(x) + torch.zeros(8, device="cuda")


def build_model():
    return OnCuda()


def example_inputs(batch_size, seq_len=None):
    return (torch.randn(batch_size, 8),)

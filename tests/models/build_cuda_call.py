"""A model file that calls CUDA itself while building (memest maps devices, but cannot run CUDA calls)."""

import torch
from torch import nn


def build_model():
    torch.cuda.synchronize()
    return nn.Linear(8, 8)


def example_inputs(batch_size, seq_len=None):
    return (torch.randn(batch_size, 8),)

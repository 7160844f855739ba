"""example_inputs() does not match the model: 16 features into a Linear that takes 8."""

import torch
from torch import nn


def build_model():
    return nn.Linear(8, 4)


def example_inputs(batch_size, seq_len=None):
    return (torch.randn(batch_size, 16),)

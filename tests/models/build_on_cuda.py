"""A model file that moves its model to the GPU while building it: placed on memest's traced device."""

import torch
from torch import nn


def build_model():
    return nn.Linear(8, 8).cuda()


def example_inputs(batch_size, seq_len=None):
    return (torch.randn(batch_size, 8),)

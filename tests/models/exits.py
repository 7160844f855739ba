"""A model file that calls sys.exit(0) while building: must be an error, never a passing CI gate."""

import sys

from torch import nn


def build_model():
    sys.exit(0)
    return nn.Linear(4, 4)


def example_inputs(batch_size: int, seq_len: int | None = None):
    import torch

    return (torch.randn(batch_size, 4),)

"""A model file that forgot build_model()."""

import torch


def example_inputs(batch_size, seq_len=None):
    return (torch.randn(batch_size, 8),)

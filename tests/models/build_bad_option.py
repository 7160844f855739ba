"""A model file whose build raises an error that mentions "cuda" but is not about a CUDA device."""

import torch


def build_model():
    raise ValueError("bad cuda_kernel_size option: expected an odd number, got 4")


def example_inputs(batch_size, seq_len=None):
    return (torch.randn(batch_size, 8),)

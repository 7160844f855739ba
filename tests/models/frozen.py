"""A fully frozen model (feature extraction): every parameter has requires_grad=False."""

import torch
from torch import nn


def build_model():
    model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 1024), nn.GELU(), nn.Linear(1024, 10))
    model.requires_grad_(False)
    return model


def example_inputs(batch_size, seq_len=None):
    return (torch.randn(batch_size, 256),)


def compute_loss(output, inputs):
    return nn.functional.cross_entropy(output, torch.zeros(output.shape[0], dtype=torch.long))

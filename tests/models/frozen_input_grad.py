"""A frozen model whose input requires grad (e.g. input attribution, adversarial examples): backward
runs for the input although no parameter trains."""

import torch
from torch import nn


def build_model():
    model = nn.Sequential(nn.Linear(256, 1024), nn.Tanh(), nn.Linear(1024, 10))
    model.requires_grad_(False)
    return model


def example_inputs(batch_size, seq_len=None):
    return (torch.randn(batch_size, 256, requires_grad=True),)


def compute_loss(output, inputs):
    return output.square().mean()

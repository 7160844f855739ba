"""MLP with in-place ReLUs: the in-place op must not count a new storage."""

import torch
from torch import nn


def build_model():
    return nn.Sequential(nn.Linear(256, 512), nn.ReLU(inplace=True), nn.Linear(512, 512), nn.ReLU(inplace=True), nn.Linear(512, 8))


def example_inputs(batch_size, seq_len=None):
    return (torch.randn(batch_size, 256),)

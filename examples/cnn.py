"""A small CNN with BatchNorm for 32x32 images (CIFAR-sized)."""

import torch
from torch import nn


def block(c_in: int, c_out: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, 3, padding=1, bias=False),
        nn.BatchNorm2d(c_out),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
    )


def build_model() -> nn.Module:
    return nn.Sequential(
        block(3, 32),
        block(32, 64),
        block(64, 128),
        nn.Flatten(),
        nn.Linear(128 * 4 * 4, 10),
    )


def example_inputs(batch_size: int, seq_len: int | None = None):
    return (torch.randn(batch_size, 3, 32, 32),)


def compute_loss(output: torch.Tensor, inputs) -> torch.Tensor:
    targets = torch.zeros(output.shape[0], dtype=torch.long)
    return nn.functional.cross_entropy(output, targets)

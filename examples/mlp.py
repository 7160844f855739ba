"""A small MLP classifier: the simplest model file memest understands."""

import torch
from torch import nn


def build_model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(1024, 4096),
        nn.GELU(),
        nn.Linear(4096, 4096),
        nn.GELU(),
        nn.Linear(4096, 10),
    )


def example_inputs(batch_size: int, seq_len: int | None = None):
    return (torch.randn(batch_size, 1024),)


def compute_loss(output: torch.Tensor, inputs) -> torch.Tensor:
    targets = torch.zeros(output.shape[0], dtype=torch.long)
    return nn.functional.cross_entropy(output, targets)

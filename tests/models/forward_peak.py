"""A model whose step peaks in the forward, on a temporary it does not keep (a no-grad scale estimate over a
widened copy of the input): in the plain loop the previous step's output is still referenced there, since
``out = model(x)`` releases it only when the new forward has returned."""

import torch
from torch import nn


class ForwardPeak(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(128, 2048)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            scale = x.repeat(1, 64).abs().mean()  # two batch x 8192 temporaries, freed before the projection
        return self.proj(x) * scale


def build_model() -> nn.Module:
    return ForwardPeak()


def example_inputs(batch_size: int, seq_len: int | None = None):
    return (torch.randn(batch_size, 128),)


def compute_loss(output: torch.Tensor, inputs) -> torch.Tensor:
    return output.pow(2).mean()

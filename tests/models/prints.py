"""A tiny transformer-ish MLP whose code prints and warns, as nanoGPT and minGPT do (their
constructors print the parameter count): none of it may reach memest's stdout."""

import warnings

import torch
from torch import nn

print("model file imported")


class Chatty(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(4))
        self.head = nn.Linear(64, 10)
        print(f"number of parameters: {sum(p.numel() for p in self.parameters()) / 1e6:.2f}M")

    def forward(self, x):
        print("forward called")
        warnings.warn("a warning from the model's forward", stacklevel=2)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def build_model():
    return Chatty()


def example_inputs(batch_size: int, seq_len: int | None = None):
    return (torch.randn(batch_size, 64),)


def compute_loss(output, inputs):
    print("loss computed")
    return output.float().pow(2).mean()

"""Layers that take two inputs needing gradients, as a decoder layer takes its hidden states and the
encoder output it attends to. The shared encoder output's gradient is complete only after every layer's
backward, so a hook that waits for all of a layer's input gradients (ModTracker's, mode "all") sees each
layer's hidden-state gradient long before the last one. The first layer is the widest: its backward,
run last, is the step's peak, where hidden-state gradients held that long would add."""

import torch
from torch import nn


class CrossLayer(nn.Module):
    def __init__(self, d: int, width: int) -> None:
        super().__init__()
        self.q = nn.Sequential(nn.Linear(d, width * d), nn.ReLU(), nn.Linear(width * d, d))
        self.kv = nn.Linear(d, d)

    def forward(self, h, e):
        return h + self.q(h) * self.kv(e)


class Net(nn.Module):
    def __init__(self, d: int = 64, widths=(64, 8, 8, 8)) -> None:
        super().__init__()
        self.enc = nn.Linear(d, d)
        self.embed = nn.Linear(d, d)
        self.layers = nn.ModuleList(CrossLayer(d, w) for w in widths)

    def forward(self, x):
        e = self.enc(x)
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h, e)
        return h


def build_model():
    return Net()


def example_inputs(batch_size: int, seq_len=None):
    return (torch.randn(batch_size, 64),)

"""A stack of weight-normalised dilated Conv1d layers (a vocoder / WaveNet-style residual stack):
torch.nn.utils.parametrizations.weight_norm recomputes each weight from g and v every forward."""

import torch
from torch import nn
from torch.nn.utils.parametrizations import weight_norm


class ResBlock(nn.Module):
    def __init__(self, channels: int, dilation: int):
        super().__init__()
        self.conv1 = weight_norm(nn.Conv1d(channels, channels, 7, padding=3 * dilation, dilation=dilation))
        self.conv2 = weight_norm(nn.Conv1d(channels, channels, 1))

    def forward(self, x):
        return x + self.conv2(nn.functional.leaky_relu(self.conv1(nn.functional.leaky_relu(x, 0.1)), 0.1))


def build_model():
    return nn.Sequential(
        weight_norm(nn.Conv1d(80, 96, 7, padding=3)),
        *(ResBlock(96, d) for d in (1, 3, 5)),
        weight_norm(nn.Conv1d(96, 1, 7, padding=3)),
        nn.Tanh(),
    )


def example_inputs(batch_size, seq_len=None):
    return (torch.randn(batch_size, 80, seq_len or 1024),)


def compute_loss(output, inputs):
    return output.abs().mean()

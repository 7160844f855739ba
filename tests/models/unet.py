"""A small U-Net: two conv+BN+ReLU levels down, a bottleneck, transposed convs up with skip
concatenations (the U-Net of scripts/bench_accuracy.py)."""

import torch
from torch import nn


def double(i, o):
    return nn.Sequential(
        nn.Conv2d(i, o, 3, padding=1, bias=False), nn.BatchNorm2d(o), nn.ReLU(inplace=True),
        nn.Conv2d(o, o, 3, padding=1, bias=False), nn.BatchNorm2d(o), nn.ReLU(inplace=True),
    )


class UNet(nn.Module):
    def __init__(self, c: int = 16):
        super().__init__()
        self.down1, self.down2, self.mid = double(3, c), double(c, 2 * c), double(2 * c, 4 * c)
        self.pool = nn.MaxPool2d(2)
        self.up2 = nn.ConvTranspose2d(4 * c, 2 * c, 2, stride=2)
        self.dec2 = double(4 * c, 2 * c)
        self.up1 = nn.ConvTranspose2d(2 * c, c, 2, stride=2)
        self.dec1 = double(2 * c, c)
        self.out = nn.Conv2d(c, 1, 1)

    def forward(self, x):
        d1 = self.down1(x)
        d2 = self.down2(self.pool(d1))
        m = self.mid(self.pool(d2))
        u2 = self.dec2(torch.cat([self.up2(m), d2], dim=1))
        u1 = self.dec1(torch.cat([self.up1(u2), d1], dim=1))
        return self.out(u1)


def build_model():
    return UNet(16)


def example_inputs(batch_size, seq_len=None):
    return (torch.randn(batch_size, 3, 64, 64),)


def compute_loss(output, inputs):
    return nn.functional.mse_loss(output, torch.zeros_like(output))

"""Linear probing: a frozen backbone (including a frozen BatchNorm) under a trainable linear head."""

import torch
from torch import nn


class Probe(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(256, 1024), nn.BatchNorm1d(1024), nn.ReLU(), nn.Linear(1024, 512), nn.ReLU())
        self.backbone.requires_grad_(False)
        self.head = nn.Linear(512, 10)

    def forward(self, x):
        return self.head(self.backbone(x))


def build_model():
    return Probe()


def example_inputs(batch_size, seq_len=None):
    return (torch.randn(batch_size, 256),)


def compute_loss(output, inputs):
    return nn.functional.cross_entropy(output, torch.zeros(output.shape[0], dtype=torch.long))

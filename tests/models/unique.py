"""A forward that keeps the distinct token ids of a batch (torch.unique): its size depends on values."""

import torch
from torch import nn


class DistinctEmbedding(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(100, 16)

    def forward(self, ids):
        return self.embed(torch.unique(ids))


def build_model():
    return DistinctEmbedding()


def example_inputs(batch_size, seq_len=8):
    return (torch.randint(0, 100, (batch_size, seq_len)),)

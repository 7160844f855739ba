"""A model whose module names are long, as generated code and wrappers make them."""

import torch
from torch import nn


class Wrapper(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder_backbone_with_a_very_long_descriptive_name = nn.Sequential(
            nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256)
        )
        self.classification_head_projection_layer_for_all_labels = nn.Linear(256, 1000)

    def forward(self, x):
        return self.classification_head_projection_layer_for_all_labels(
            self.encoder_backbone_with_a_very_long_descriptive_name(x)
        )


def build_model():
    return Wrapper()


def example_inputs(batch_size: int, seq_len: int | None = None):
    return (torch.randn(batch_size, 256),)

"""timm's ConvNeXt-Tiny (public model code, imported at benchmark time): depthwise 7x7 convolutions,
LayerNorm, GELU."""

import torch
from torch import nn


def build_model() -> nn.Module:
    import timm

    return timm.create_model("convnext_tiny", pretrained=False)


def example_inputs(batch_size: int, seq_len: int | None = None):
    return (torch.randn(batch_size, 3, 224, 224),)


def compute_loss(output: torch.Tensor, inputs) -> torch.Tensor:
    targets = torch.zeros(output.shape[0], dtype=torch.long, device=output.device)
    return nn.functional.cross_entropy(output, targets)

"""torchvision's ViT-B/16 (public model code, imported at benchmark time), ImageNet-sized inputs."""

import torch
from torch import nn


def build_model() -> nn.Module:
    from torchvision.models import vit_b_16

    return vit_b_16(weights=None)


def example_inputs(batch_size: int, seq_len: int | None = None):
    return (torch.randn(batch_size, 3, 224, 224),)


def compute_loss(output: torch.Tensor, inputs) -> torch.Tensor:
    targets = torch.zeros(output.shape[0], dtype=torch.long, device=output.device)
    return nn.functional.cross_entropy(output, targets)

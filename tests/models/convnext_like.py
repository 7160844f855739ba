"""A small ConvNeXt written the way timm writes one: stages = nn.Sequential of ConvNeXtStage, each with its
own blocks = nn.Sequential of ConvNeXtBlock (timm.models.convnext) — repeated blocks inside repeated blocks."""

import torch
import torch.nn.functional as F
from torch import nn


class LayerNorm2d(nn.LayerNorm):
    def forward(self, x):
        return F.layer_norm(x.permute(0, 2, 3, 1), self.normalized_shape, self.weight, self.bias, self.eps).permute(0, 3, 1, 2)


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.conv_dw = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), 1e-6))

    def forward(self, x):
        shortcut = x
        x = self.conv_dw(x).permute(0, 2, 3, 1)
        x = self.fc2(self.act(self.fc1(self.norm(x)))) * self.gamma
        return x.permute(0, 3, 1, 2) + shortcut


class ConvNeXtStage(nn.Module):
    def __init__(self, in_chs, out_chs, depth):
        super().__init__()
        if in_chs != out_chs:
            self.downsample = nn.Sequential(LayerNorm2d(in_chs), nn.Conv2d(in_chs, out_chs, 2, stride=2))
        else:
            self.downsample = nn.Identity()
        self.blocks = nn.Sequential(*[ConvNeXtBlock(out_chs) for _ in range(depth)])

    def forward(self, x):
        return self.blocks(self.downsample(x))


class ConvNeXt(nn.Module):
    def __init__(self, depths=(2, 2, 2, 2), dims=(4, 8, 16, 32), num_classes=10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, dims[0], 4, stride=4), LayerNorm2d(dims[0]))
        chs = [dims[0], *dims]
        self.stages = nn.Sequential(*[ConvNeXtStage(chs[i], chs[i + 1], depths[i]) for i in range(len(depths))])
        self.norm = nn.LayerNorm(dims[-1])
        self.head = nn.Linear(dims[-1], num_classes)

    def forward(self, x):
        x = self.stages(self.stem(x))
        return self.head(self.norm(x.mean((2, 3))))


def build_model():
    return ConvNeXt()


def example_inputs(batch_size, seq_len=None):
    return (torch.randn(batch_size, 3, 32, 32),)


def compute_loss(logits, inputs):
    return F.cross_entropy(logits, torch.zeros(logits.shape[0], dtype=torch.long))

"""ConvNeXt-like net (the layout of timm's ConvNeXt-atto, shallower): 4x4/4 patch stem, blocks of
depthwise 7x7 conv -> channels-last LayerNorm -> MLP (4x) -> layer scale, residual; 2x2/2 downsampling
convs between stages of 40, 80, 160, 320 channels."""

import torch
from torch import nn


class LayerNorm2d(nn.LayerNorm):
    """LayerNorm over channels of an NCHW tensor (permute, normalise, permute back), as timm's."""

    def forward(self, x):
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.conv_dw = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.gamma = nn.Parameter(torch.full((dim,), 1e-6))

    def forward(self, x):
        y = self.conv_dw(x).permute(0, 2, 3, 1)  # NHWC for the norm and the MLP
        y = self.mlp(self.norm(y)) * self.gamma
        return x + y.permute(0, 3, 1, 2)


class ConvNeXt(nn.Module):
    def __init__(self, dims=(40, 80, 160, 320), depths=(1, 1, 2, 1), classes=10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, dims[0], 4, stride=4), LayerNorm2d(dims[0]))
        stages = []
        for i, (dim, depth) in enumerate(zip(dims, depths, strict=True)):
            down = nn.Sequential(LayerNorm2d(dims[i - 1]), nn.Conv2d(dims[i - 1], dim, 2, stride=2)) if i else nn.Identity()
            stages.append(nn.Sequential(down, *(Block(dim) for _ in range(depth))))
        self.stages = nn.Sequential(*stages)
        self.head = nn.Sequential(nn.LayerNorm(dims[-1]), nn.Linear(dims[-1], classes))

    def forward(self, x):
        x = self.stages(self.stem(x))
        return self.head(x.mean((2, 3)))


def build_model():
    return ConvNeXt()


def example_inputs(batch_size, seq_len=None):
    return (torch.randn(batch_size, 3, 96, 96),)


def compute_loss(output, inputs):
    return nn.functional.cross_entropy(output, torch.zeros(output.shape[0], dtype=torch.long))

"""transformers' VideoMAE video classifier (VideoMAEForVideoClassification, the library's own code), shrunk: its
tubelet embedding is a Conv3d of kernel and stride 2 x 16 x 16 from 3 channels (oneDNN's 5d 1st-convolution
kernels on CPU), then 2 transformer layers over 4 x 4 x 4 tubelets of an 8-frame 64x64 clip."""

import torch
from torch import nn


def build_model():
    from transformers import VideoMAEConfig, VideoMAEForVideoClassification

    config = VideoMAEConfig(image_size=64, patch_size=16, num_frames=8, tubelet_size=2, hidden_size=96,
                            num_hidden_layers=2, num_attention_heads=4, intermediate_size=192, num_labels=5)
    return VideoMAEForVideoClassification(config)


def example_inputs(batch_size, seq_len=None):
    return (torch.randn(batch_size, 8, 3, 64, 64),)  # (batch, frames, channels, H, W)


def compute_loss(output, inputs):
    return nn.functional.cross_entropy(output.logits, torch.zeros(output.logits.shape[0], dtype=torch.long))

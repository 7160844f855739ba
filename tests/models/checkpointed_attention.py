"""timm-style blocks (attention with F.scaled_dot_product_attention(dropout_p=0.1), as timm ViT's Attention) checkpointed
with torch.utils.checkpoint(use_reentrant=False), as timm's set_grad_checkpointing() does: under --compile --target cuda
the attention is the CUDA kernel (a seeded random op Inductor does not decompose), so the partitioner wraps it in
run_and_save_rng_state / run_with_rng_state (issue 21)."""

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

D = 64


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)
        self.proj = nn.Linear(D, D)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        B, N, C = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, 4, C // 4).permute(2, 0, 3, 1, 4).unbind(0)
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=0.1 if self.training else 0.0)
        return x + self.drop(self.proj(a.transpose(1, 2).reshape(B, N, C)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(D, 10)

    def forward(self, x):
        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=False)
        return self.head(x.mean(1))


def build_model():
    return Net()


def example_inputs(batch_size, seq_len=None):
    return (torch.randn(batch_size, 16, D),)


def compute_loss(o, i):
    return F.cross_entropy(o, torch.zeros(o.shape[0], dtype=torch.long))

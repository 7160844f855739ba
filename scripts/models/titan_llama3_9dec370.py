"""torchtitan's Llama 3.1 8B at commit 9dec370 (the commit of torchtitan's end-2024 H100 benchmark,
benchmarks/llama3_h100_202412_torchtitan.md), for scripts/bench_gpu_recipes.py's model-code isolation.

scripts/models/titan_llama.py is torchtitan's later Llama 2 layout (multi-head attention, nn.RMSNorm); the 8B
of 9dec370 differs in what this file changes, each from
https://github.com/pytorch/torchtitan/blob/9dec370ad26b5f8e9a7333a0e36165018262644b/torchtitan/models/llama/model.py:
grouped-query attention (n_kv_heads 8: wk/wv of 1024 outputs, keys and values repeated by ``repeat_kv``'s
unsqueeze/expand/reshape before SDPA), torchtitan's own RMSNorm (norms.py: ``_norm(x.float()).type_as(x) *
weight``, eps 1e-5), ffn hidden from ffn_dim_multiplier 1.3 and multiple_of 1024 (14336), vocab 128256 and
rope_theta 500000 (models/llama/__init__.py, "8B"). The loss is train.py's ``cross_entropy(pred.flatten(0,
1).float(), labels.flatten(0, 1))`` with labels of the input's shape (the dataset shifts them; memory is the same).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from titan_llama import FeedForward, Transformer, _freqs_cis, _rotary  # noqa: E402

DIM, LAYERS, HEADS, KV_HEADS, VOCAB, HIDDEN, THETA, EPS = 4096, 32, 32, 8, 128256, 14336, 500000.0, 1e-5


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = EPS) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    bs, slen, n_kv, head_dim = x.shape
    return x.unsqueeze(3).expand(bs, slen, n_kv, n_rep, head_dim).reshape(bs, slen, n_kv * n_rep, head_dim)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.head_dim, self.n_rep = dim // heads, heads // kv_heads
        self.wq = nn.Linear(dim, heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(heads * self.head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        bs, seq, _ = x.shape
        xq = self.wq(x).view(bs, seq, -1, self.head_dim)
        xk = self.wk(x).view(bs, seq, -1, self.head_dim)
        xv = self.wv(x).view(bs, seq, -1, self.head_dim)
        xq, xk = _rotary(xq, xk, freqs_cis)
        keys, values = repeat_kv(xk, self.n_rep), repeat_kv(xv, self.n_rep)
        out = F.scaled_dot_product_attention(xq.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                             is_causal=True)
        return self.wo(out.transpose(1, 2).contiguous().view(bs, seq, -1))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention = Attention(DIM, HEADS, KV_HEADS)
        self.feed_forward = FeedForward(DIM, HIDDEN)
        self.attention_norm = RMSNorm(DIM)
        self.ffn_norm = RMSNorm(DIM)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama3(Transformer):
    """titan_llama.Transformer's forward and dtype handling (freqs_cis stays complex64) with 9dec370's 8B parts."""

    def __init__(self, layers: int = LAYERS, max_seq: int = 8192) -> None:
        nn.Module.__init__(self)
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.register_buffer("freqs_cis", _freqs_cis(DIM // HEADS, max_seq * 2, THETA), persistent=True)
        self.layers = nn.ModuleList(Block() for _ in range(layers))
        self.norm = RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)


def build_model() -> nn.Module:
    return Llama3()


def build_32k() -> nn.Module:
    """Table 2's 32768-token runs: train.py sets the model's max_seq_len to training.seq_len (freqs_cis sized
    from it)."""
    return Llama3(max_seq=32768)


def example_inputs(batch_size: int, seq_len: int = 8192):
    return (torch.randint(0, VOCAB, (batch_size, seq_len)),)


def compute_loss(output: torch.Tensor, inputs) -> torch.Tensor:
    return F.cross_entropy(output.flatten(0, 1).float(), inputs[0].flatten(0, 1))

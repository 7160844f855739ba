"""torchtitan's Llama decoder (the dense Llama 2/3 layout trained by pytorch/torchtitan), re-written here with
the same operations so memest can trace it without torchtitan (whose 0.3.0 wheel does not import beside torch
2.13: torchtitan.distributed needs spmd_types).

Follows https://github.com/pytorch/torchtitan/blob/main/torchtitan/models/llama/model.py (commit
0199cbc1ba671c15df501fd9aa8bb68afd4352fd; the same ops as torchtitan 0.3.0's models/llama3 + models/common):
nn.RMSNorm on the bf16 residual stream (no fp32 up-cast of its input), RoPE as complex multiplication of
x.float() by a complex64 freqs_cis buffer, F.scaled_dot_product_attention(is_causal=True), SwiGLU
w2(silu(w1 x) * w3 x). Llama-2-7B shape: dim 4096, 32 heads, ffn int(2*4*dim/3) rounded up to multiple_of 256
= 11008, vocab 32000 (torchtitan's llama2 "7B" args, multiple_of=256, no ffn_dim_multiplier).

``build_model`` is the 7B-shaped model with LAYERS layers; ``make(...)`` builds any size (tests use tiny ones).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

DIM, HEADS, VOCAB, MULTIPLE_OF = 4096, 32, 32000, 256
LAYERS = int(os.environ.get("TITAN_LLAMA_LAYERS", "2"))
ROPE_THETA = 10000.0


def ffn_hidden(dim: int, multiple_of: int = MULTIPLE_OF) -> int:
    hidden = int(2 * 4 * dim / 3)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def _freqs_cis(head_dim: int, end: int, theta: float) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2)[: head_dim // 2].float() / head_dim))
    angles = torch.outer(torch.arange(end, device=freqs.device), freqs).float()
    return torch.polar(torch.ones_like(angles), angles)  # complex64


def _rotary(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor):
    q = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    k = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    f = freqs_cis[: q.shape[1]].view(1, q.shape[1], 1, q.shape[-1])
    return torch.view_as_real(q * f).flatten(3).type_as(xq), torch.view_as_real(k * f).flatten(3).type_as(xk)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        bs, seq, _ = x.shape
        xq = self.wq(x).view(bs, seq, -1, self.head_dim)
        xk = self.wk(x).view(bs, seq, -1, self.head_dim)
        xv = self.wv(x).view(bs, seq, -1, self.head_dim)
        xq, xk = _rotary(xq, xk, freqs_cis)
        out = F.scaled_dot_product_attention(xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).contiguous().view(bs, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.attention = Attention(dim, heads)
        self.feed_forward = FeedForward(dim, hidden)
        self.attention_norm = nn.RMSNorm(dim, eps=eps)
        self.ffn_norm = nn.RMSNorm(dim, eps=eps)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, dim: int, layers: int, heads: int, hidden: int, vocab: int, max_seq: int = 4096) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.register_buffer("freqs_cis", _freqs_cis(dim // heads, max_seq * 2, ROPE_THETA), persistent=True)
        self.layers = nn.ModuleList(TransformerBlock(dim, heads, hidden) for _ in range(layers))
        self.norm = nn.RMSNorm(dim, eps=1e-5)
        self.output = nn.Linear(dim, vocab, bias=False)

    def _apply(self, fn, recurse=True):
        """Casting the model (memest --precision bf16, .to(bfloat16)) keeps freqs_cis complex64, as torchtitan's
        FSDP2 MixedPrecisionPolicy casts parameters only."""
        freqs = self._buffers.pop("freqs_cis")
        super()._apply(fn, recurse)
        self.register_buffer("freqs_cis", freqs.to(self.output.weight.device), persistent=True)
        return self

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, self.freqs_cis)
        return self.output(self.norm(h))


def make(dim: int = DIM, layers: int = LAYERS, heads: int = HEADS, vocab: int = VOCAB, hidden: int | None = None,
         max_seq: int = 4096) -> Transformer:
    return Transformer(dim, layers, heads, hidden or ffn_hidden(dim), vocab, max_seq)


def build_model() -> nn.Module:
    return make()


def example_inputs(batch_size: int, seq_len: int = 2048):
    return (torch.randint(0, VOCAB, (batch_size, seq_len)),)


def compute_loss(output: torch.Tensor, inputs) -> torch.Tensor:
    """torchtitan's cross_entropy_loss: logits up-cast to fp32, next-token labels."""
    tokens = inputs[0]
    return F.cross_entropy(output[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten(0, 1))

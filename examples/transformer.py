"""A small decoder-style language model built from torch.nn only (no transformers needed)."""

import torch
from torch import nn

VOCAB = 8000
D_MODEL = 256
LAYERS = 4
HEADS = 4


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D_MODEL)
        layer = nn.TransformerEncoderLayer(D_MODEL, HEADS, dim_feedforward=4 * D_MODEL, batch_first=True, dropout=0.0)
        self.blocks = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(D_MODEL)
        self.head = nn.Linear(D_MODEL, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq = tokens.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(seq, device=tokens.device)
        hidden = self.blocks(self.embed(tokens), mask=mask, is_causal=True)
        return self.head(self.norm(hidden))


def build_model() -> nn.Module:
    return TinyLM()


def example_inputs(batch_size: int, seq_len: int | None = 256):
    return (torch.randint(0, VOCAB, (batch_size, seq_len or 256)),)


def compute_loss(logits: torch.Tensor, inputs) -> torch.Tensor:
    tokens = inputs[0]
    return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))

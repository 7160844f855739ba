"""The examples/transformer.py language model with activation checkpointing on every block
(torch.utils.checkpoint, non-reentrant): activations inside a block are recomputed in backward."""

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformer import D_MODEL, HEADS, LAYERS, VOCAB, compute_loss, example_inputs  # noqa: F401


class CheckpointedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D_MODEL)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(D_MODEL, HEADS, dim_feedforward=4 * D_MODEL, batch_first=True, dropout=0.0)
            for _ in range(LAYERS)
        )
        self.norm = nn.LayerNorm(D_MODEL)
        self.head = nn.Linear(D_MODEL, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq = tokens.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(seq, device=tokens.device)
        hidden = self.embed(tokens)
        for block in self.blocks:
            hidden = checkpoint(block, hidden, mask, None, True, use_reentrant=False)
        return self.head(self.norm(hidden))


def build_model() -> nn.Module:
    return CheckpointedLM()

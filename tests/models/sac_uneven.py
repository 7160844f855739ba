"""Four blocks of one class that do not all run the same ops: every second block scales its hidden state through an
extra temporary, so its forward (and its recomputation under selective checkpointing) allocates more. A replayed
recomputation (trace/recompute.py) must tell the two kinds apart."""

import torch
from torch import nn

VOCAB, WIDTH, BLOCKS = 500, 64, 4


class Block(nn.Module):
    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.up(self.norm(x)))
        if self.index % 2:
            h = h * torch.sigmoid(h)  # the odd blocks: one more activation saved, one more temporary
        return x + self.down(h)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block(i) for i in range(BLOCKS))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build_model() -> nn.Module:
    return Model()


def example_inputs(batch_size: int, seq_len: int | None = 32):
    return (torch.randint(0, VOCAB, (batch_size, seq_len or 32)),)


def compute_loss(logits: torch.Tensor, inputs) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), inputs[0].reshape(-1))

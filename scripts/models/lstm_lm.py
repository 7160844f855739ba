"""A 2-layer LSTM language model (nn.LSTM: cuDNN RNN on CUDA, oneDNN on CPU)."""

import torch
from torch import nn

VOCAB = 10000


class LSTMLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 512)
        self.lstm = nn.LSTM(512, 1024, num_layers=2, batch_first=True)
        self.head = nn.Linear(1024, VOCAB)

    def forward(self, tokens):
        out, _ = self.lstm(self.embed(tokens))
        return self.head(out)


def build_model():
    return LSTMLM()


def example_inputs(batch_size: int, seq_len: int | None = 128):
    return (torch.randint(0, VOCAB, (batch_size, seq_len or 128)),)


def compute_loss(output, inputs):
    (tokens,) = inputs
    return nn.functional.cross_entropy(output.flatten(0, 1).float(), tokens.flatten())

"""Recurrent sequence regressors over (batch, seq, 48) features, one factory per variant:
``rnn_variants.py:lstm_bidir`` etc. On CPU nn.LSTM runs oneDNN's mkldnn_rnn_layer per layer and
direction; nn.GRU runs as ATen ops."""

import torch
from torch import nn

FEATURES = 48


class Regressor(nn.Module):
    def __init__(self, rnn: nn.RNNBase, use_state: bool = False):
        super().__init__()
        self.rnn, self.use_state = rnn, use_state
        self.head = nn.Linear(rnn.hidden_size * (2 if rnn.bidirectional else 1), 1)

    def forward(self, x):  # x: (batch, seq, features)
        if not self.rnn.batch_first:
            x = x.transpose(0, 1)
        out, state = self.rnn(x)
        out = self.head(out).mean()
        if self.use_state:  # gradients flow into h_n (and c_n) too
            h = state[0] if isinstance(state, tuple) else state
            out = out + h.mean()
        return out


def lstm_bidir():
    """2 layers, bidirectional, batch_first, hidden 96."""
    return Regressor(nn.LSTM(FEATURES, 96, num_layers=2, bidirectional=True, batch_first=True))


def lstm_seq_first():
    """1 layer, sequence-first input, hidden 200, the final state used too."""
    return Regressor(nn.LSTM(FEATURES, 200), use_state=True)


def lstm_wide():
    """1 layer, batch_first, hidden 256 (4H = 1024: oneDNN pads its leading dimension)."""
    return Regressor(nn.LSTM(FEATURES, 256, batch_first=True))


def gru_bidir():
    """GRU, 2 layers, bidirectional, batch_first, hidden 96."""
    return Regressor(nn.GRU(FEATURES, 96, num_layers=2, bidirectional=True, batch_first=True))


def gru_seq_first():
    return Regressor(nn.GRU(FEATURES, 128), use_state=True)


build_model = lstm_bidir


def example_inputs(batch_size, seq_len=24):
    return (torch.randn(batch_size, seq_len or 24, FEATURES),)


def compute_loss(output, inputs):
    return output

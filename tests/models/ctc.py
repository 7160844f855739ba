"""A speech-style model trained with CTC (F.ctc_loss with tensor lengths, as torchaudio recipes write it)."""

import torch
import torch.nn.functional as F
from torch import nn

CLASSES, TARGET_LEN = 20, 10


def build_model():
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, CLASSES))


def example_inputs(batch_size, seq_len=50):
    return (torch.randn(seq_len, batch_size, 16),)


def compute_loss(output, inputs):
    frames, batch = output.shape[:2]
    targets = torch.randint(1, CLASSES, (batch, TARGET_LEN))
    input_lengths = torch.full((batch,), frames, dtype=torch.long)
    target_lengths = torch.full((batch,), TARGET_LEN, dtype=torch.long)
    return F.ctc_loss(output.log_softmax(-1), targets, input_lengths, target_lengths)

"""llama32_3b_eager_loss.py's model with torchtune's CEWithChunkedOutputLoss after it (8 chunks), as the torchtune
README ladder's '+ Chunked Cross Entropy' row runs it: the model's bf16 logits split along the sequence, each
chunk upcast to fp32 and cross-entropied (reduction sum) in turn, the sum divided by the count of labelled
tokens. Transcribed from
https://github.com/meta-pytorch/torchtune/blob/1814feb17a9038e1a8053ce93111bd26774a8db6/torchtune/modules/loss/ce_chunked_output_loss.py;
torchtune compiles compute_cross_entropy (the upcast and the cross-entropy of one chunk), here it runs eager
(llama32_3b_chunked_compiled_loss.py compiles it).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llama32_3b_eager_loss import build_model, example_inputs  # noqa: E402,F401

CHUNKS = 8


def _compute_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), labels, reduction="sum", ignore_index=-100)


def chunked_loss(compute_cross_entropy):
    """CEWithChunkedOutputLoss's forward over ``compute_cross_entropy`` (eager here, compiled in
    llama32_3b_chunked_compiled_loss.py)."""

    def compute_loss(output, inputs) -> torch.Tensor:
        labels = inputs["input_ids"]
        total_elements = (labels != -100).sum()
        total = 0.0
        for logits, target in zip(output.logits.chunk(CHUNKS, dim=1), labels.chunk(CHUNKS, dim=1), strict=True):
            total += compute_cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))
        return total / total_elements

    return compute_loss


compute_loss = chunked_loss(_compute_cross_entropy)

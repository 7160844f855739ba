"""llama32_3b_chunked_loss.py with torchtune's compile_loss applied: CEWithChunkedOutputLoss's
compute_cross_entropy (one chunk's fp32 upcast and cross-entropy) compiled with torch.compile, the chunking eager,
as training.compile_loss does it
(https://github.com/meta-pytorch/torchtune/blob/1814feb17a9038e1a8053ce93111bd26774a8db6/torchtune/training/_compile.py).
For scripts/bench_gpu_recipes.py's loss-compile isolation of the '+ Fuse optimizer step into backward' row.
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


compute_cross_entropy = torch.compile(_compute_cross_entropy)


def compute_loss(output, inputs) -> torch.Tensor:
    labels = inputs["input_ids"]
    total_elements = (labels != -100).sum()
    total = 0.0
    for logits, target in zip(output.logits.chunk(CHUNKS, dim=1), labels.chunk(CHUNKS, dim=1), strict=True):
        total += compute_cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))
    return total / total_elements

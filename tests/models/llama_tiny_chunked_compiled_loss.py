"""llama_tiny_chunked_loss.py with compute_cross_entropy (one chunk's fp32 upcast and cross-entropy) compiled by
torch.compile, the chunking eager, as torchtune's training.compile_loss does
(https://github.com/meta-pytorch/torchtune/blob/1814feb17a9038e1a8053ce93111bd26774a8db6/torchtune/training/_compile.py):
the tiny stand-in of scripts/models/llama32_3b_chunked_compiled_loss.py (tests/test_compile_blocks.py)."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llama_tiny_chunked_loss import CHUNKS, _compute_cross_entropy, build_model, example_inputs  # noqa: E402,F401

compute_cross_entropy = torch.compile(_compute_cross_entropy)


def compute_loss(output, inputs) -> torch.Tensor:
    labels = inputs["input_ids"]
    total_elements = (labels != -100).sum()
    total = 0.0
    for logits, target in zip(output.logits.chunk(CHUNKS, dim=1), labels.chunk(CHUNKS, dim=1), strict=True):
        total += compute_cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))
    return total / total_elements

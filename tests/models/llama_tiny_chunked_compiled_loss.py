"""llama_tiny_chunked_loss.py with compute_cross_entropy (one chunk's fp32 upcast and cross-entropy) compiled by
torch.compile, the chunking eager, as torchtune's training.compile_loss does
(https://github.com/meta-pytorch/torchtune/blob/1814feb17a9038e1a8053ce93111bd26774a8db6/torchtune/training/_compile.py):
the tiny stand-in of scripts/models/llama32_3b_chunked_compiled_loss.py (tests/test_compile_blocks.py)."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llama_tiny_chunked_loss import _compute_cross_entropy, build_model, chunked_loss, example_inputs  # noqa: E402,F401

compute_loss = chunked_loss(torch.compile(_compute_cross_entropy))

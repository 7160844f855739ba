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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llama32_3b_chunked_loss import _compute_cross_entropy, build_model, chunked_loss, example_inputs  # noqa: E402,F401

compute_loss = chunked_loss(torch.compile(_compute_cross_entropy))

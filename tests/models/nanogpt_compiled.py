"""nanoGPT as its train.py runs it: ``model = torch.compile(model)`` (compile=True is nanoGPT's default), so
build_model returns the OptimizedModule. The model is tests/models/nanogpt.py's GPT."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from nanogpt import GPT, compute_loss, example_inputs  # noqa: E402, F401


def build_model():
    model = GPT()
    return torch.compile(model)  # requires PyTorch 2.0 (nanoGPT's train.py)


def build_decomp_partition():
    """The backend torch's docs offer to debug Inductor: its decompositions and partitioner, graphs run op by op."""
    return torch.compile(GPT(), backend="aot_eager_decomp_partition")

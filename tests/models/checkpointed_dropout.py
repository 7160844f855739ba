"""A model file that checkpoints its own blocks the way timm's ``set_grad_checkpointing()`` does (timm's
checkpoint_seq: torch.utils.checkpoint.checkpoint(..., use_reentrant=False)), with dropout inside each block, so
the checkpoint saves and restores the RNG state (under torch.compile: the run_and_save_rng_state /
run_with_rng_state higher-order ops). No timm needed."""

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

WIDTH = 512


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.drop = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH), nn.Dropout(0.1)

    def forward(self, x):
        return x + self.drop(self.fc2(torch.nn.functional.gelu(self.fc1(x))))


class Net(nn.Module):
    def __init__(self, depth: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(depth))
        self.head = nn.Linear(WIDTH, 10)
        self.grad_checkpointing = True  # timm: model.set_grad_checkpointing()

    def forward(self, x):
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.grad_checkpointing and self.training else block(x)
        return self.head(x)


def build_model() -> nn.Module:
    return Net()


def example_inputs(batch_size: int, seq_len: int | None = None):
    return (torch.randn(batch_size, WIDTH),)


def compute_loss(output: torch.Tensor, inputs) -> torch.Tensor:
    return nn.functional.cross_entropy(output, torch.zeros(output.shape[0], dtype=torch.long))


def build_compiled_fallback_random() -> nn.Module:
    """Compiled with Inductor's ``fallback_random`` (dropout's random ops kept as aten ops, as torch's own RNG draws
    them): the partitioner then wraps the checkpointed region's random ops in the run_and_save_rng_state /
    run_with_rng_state higher-order ops on CPU too (torch/_functorch/partitioners.py, functionalize_rng_ops)."""
    return torch.compile(Net(), options={"fallback_random": True})

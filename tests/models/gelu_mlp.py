"""An MLP whose activations outweigh its weights (batch 1024, width 1024): the compiled step recomputes the
GELUs in backward instead of saving their outputs (Inductor's min-cut partitioner), the eager one saves them."""

import torch
from torch import nn

WIDTH = 1024


def build_model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(256, WIDTH), nn.GELU(), nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.Linear(WIDTH, WIDTH), nn.GELU(),
        nn.Linear(WIDTH, 10),
    )


def build_compiled() -> nn.Module:
    return torch.compile(build_model())


def build_compiled_in_place() -> nn.Module:
    model = build_model()
    model.compile()  # nn.Module.compile(): compiles the module's __call__ in place
    return model


def example_inputs(batch_size: int, seq_len: int | None = None):
    return (torch.randn(batch_size, 256),)


def compute_loss(output: torch.Tensor, inputs) -> torch.Tensor:
    targets = torch.zeros(output.shape[0], dtype=torch.long)
    return nn.functional.cross_entropy(output, targets)

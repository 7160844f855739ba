"""The real torch.optim classes, configured the way the target device would run them."""

from __future__ import annotations

import torch

from ..spec import RunSpec


def make_optimizer(spec: RunSpec, params) -> torch.optim.Optimizer:
    """``--target cuda``: foreach implementations (what a CUDA run defaults to).
    ``--target cpu``: torch's own defaults for CPU tensors (single-tensor loops)."""
    cls, kwargs = optimizer_class(spec)
    return cls(params, **kwargs)


def optimizer_class(spec: RunSpec) -> tuple[type, dict]:
    """The optimizer class and its keyword arguments (ZeroRedundancyOptimizer builds it itself)."""
    kwargs: dict = {"lr": spec.lr}
    if spec.target == "cuda" and spec.optim != "adam8bit":
        if spec.fused and spec.optim in FUSED:
            kwargs["fused"] = True
        else:
            kwargs["foreach"] = True
    if spec.optim == "sgd":
        return torch.optim.SGD, kwargs
    if spec.optim == "sgd-momentum":
        return torch.optim.SGD, {"momentum": 0.9, **kwargs}
    if spec.optim == "adam":
        return torch.optim.Adam, kwargs
    if spec.optim == "adamw":
        return torch.optim.AdamW, kwargs
    if spec.optim == "adafactor":
        return torch.optim.Adafactor, kwargs
    if spec.optim == "adam8bit":
        from .adam8bit import Adam8bitModel

        return Adam8bitModel, kwargs
    raise AssertionError(spec.optim)  # RunSpec validates the name


# torch.optim classes with fused (single-kernel) implementations
FUSED = ("sgd", "sgd-momentum", "adam", "adamw")

# Bytes of optimizer state per parameter byte, for the folklore cross-check (params x n).
FOLKLORE_N = {"sgd": 2, "sgd-momentum": 3, "adam": 4, "adamw": 4, "adafactor": 2, "adam8bit": 2.5}

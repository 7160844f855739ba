"""Scalar reads (``.item()``, ``bool(t)``) on fake tensors, where values cannot change memory.

Fake tensors have no values. Where code reads one only to pick numbers — weight initialisation
(nn.init.trunc_normal_'s rejection loop), an optimizer's step size (Adafactor) — any value gives the
same allocations, so memest answers with a placeholder. In the forward, a value can change shapes or
control flow, so there it stays an error.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ITEM = torch.ops.aten._local_scalar_dense.default


def placeholder_scalar(t: torch.Tensor):
    """False for booleans (ends 'while mask.any()' loops), 1 / 1.0 otherwise (a safe divisor)."""
    if t.dtype == torch.bool:
        return False
    return 1.0 if t.dtype.is_floating_point else 1


class PlaceholderScalars(TorchDispatchMode):
    """Answer scalar reads with placeholders; every other op runs as usual."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is ITEM:
            return placeholder_scalar(args[0])
        return func(*args, **(kwargs or {}))

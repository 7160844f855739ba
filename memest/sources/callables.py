"""Python-API sources: a model factory and an inputs factory passed as callables (memest.estimate).

memest calls both under fake tensors, so nothing is allocated: ``model`` is a zero-argument callable
returning an nn.Module (a class such as ``MyNet`` or ``lambda: MyNet(cfg)``), ``inputs`` takes
``(batch_size)`` or ``(batch_size, seq_len)`` and returns a tuple of positional inputs, a dict of
keyword inputs, or one tensor.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from memest.errors import ModelLoadError
from memest.sources.base import ModelSource
from memest.sources.model_file import default_seq


def _name(fn: Callable) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__


def _positional_count(fn: Callable) -> int | None:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return None
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)


def callable_source(
    model: Callable[[], Any],
    inputs: Callable[..., Any],
    loss: Callable[[Any, Any], Any] | None = None,
    name: str | None = None,
) -> ModelSource:
    import torch

    if isinstance(model, torch.nn.Module):
        raise ModelLoadError(
            f"memest.estimate got a built {type(model).__name__} module; pass a factory instead, e.g. "
            f"memest.estimate(lambda: {type(model).__name__}(...), inputs=...), so memest builds it on fake tensors "
            "and allocates nothing"
        )
    if not callable(model):
        raise ModelLoadError(f"model must be a model factory, a model.py path or hf:NAME, not {type(model).__name__}")
    if inputs is None:
        raise ModelLoadError("a model factory needs inputs=: a callable (batch_size, seq_len=None) -> inputs")
    if not callable(inputs):
        raise ModelLoadError(
            f"inputs must be a callable (batch_size, seq_len=None) -> inputs, not {type(inputs).__name__}: memest "
            "builds the inputs itself, under fake tensors, at the batch size asked for"
        )
    if loss is not None and not callable(loss):
        raise ModelLoadError(f"loss must be a callable (output, inputs) -> tensor, not {type(loss).__name__}")
    takes_seq = _positional_count(inputs) != 1

    def example_inputs(batch_size: int, seq_len: int | None = None):
        return inputs(batch_size, seq_len) if takes_seq else inputs(batch_size)

    label = name or _name(model)
    if "<lambda>" in label:
        label = "model"  # the report names the built class beside it
    return ModelSource(
        name=label,
        build_model=model,
        example_inputs=example_inputs,
        compute_loss=loss,
        default_seq=default_seq(inputs) if takes_seq else None,
        origin=f"{label} (Python API)",
    )

"""Model files (design.md §5): ``build_model()``, ``example_inputs(batch_size, seq_len)`` and an
optional ``compute_loss(output, inputs)``; ``path.py:factory`` names another factory."""

from __future__ import annotations

import importlib.util
import inspect
import sys
from pathlib import Path

from memest.errors import ModelLoadError
from memest.sources.base import ModelSource


def _split_ref(ref: str) -> tuple[Path, str]:
    path, sep, factory = ref.rpartition(":")
    if sep and path.endswith(".py") and factory.isidentifier():
        return Path(path), factory
    return Path(ref), "build_model"


def load_model_file(ref: str) -> ModelSource:
    path, factory = _split_ref(ref)
    if not path.exists():
        raise ModelLoadError(f"model file {str(path)!r} not found; pass a .py file that defines build_model(), or hf:NAME")
    if path.suffix != ".py":
        raise ModelLoadError(f"{path}: expected a Python model file (.py) or hf:NAME / hf:config.json")
    module_name = f"memest_model_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    # importable by its name, as a model file the user imports is (importlib's recipe): torch.compile's dynamo
    # imports a function's module by name when it inlines a call whose globals differ from the caller's (a
    # checkpoint wrapper around a block's forward under --compile-scope blocks)
    sys.modules[module_name] = module
    sys.path.insert(0, str(path.parent.resolve()))
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # the user's code raised while importing
        sys.modules.pop(module_name, None)
        raise ModelLoadError(f"{path}: importing the model file raised {type(exc).__name__}: {exc}") from exc
    finally:
        sys.path.pop(0)

    build = getattr(module, factory, None)
    if not callable(build):
        raise ModelLoadError(
            f"{path}: no function {factory}(); define {factory}() -> torch.nn.Module "
            "(or name another factory as path.py:factory)"
        )
    inputs = getattr(module, "example_inputs", None)
    if not callable(inputs):
        raise ModelLoadError(
            f"{path}: no function example_inputs(batch_size, seq_len=None); define one that returns "
            "a tuple of positional inputs or a dict of keyword inputs"
        )
    loss = getattr(module, "compute_loss", None)
    seq_default = default_seq(inputs)
    return ModelSource(
        name=path.stem if factory == "build_model" else f"{path.stem}:{factory}",
        build_model=build,
        example_inputs=inputs,
        compute_loss=loss if callable(loss) else None,
        default_seq=seq_default,
        origin=str(path),
        lookup=lambda name: getattr(module, name, None),
    )


def default_seq(fn) -> int | None:
    """The default of ``seq_len`` in example_inputs, if it has one."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    if len(params) >= 2 and isinstance(params[1].default, int):
        return params[1].default
    return None

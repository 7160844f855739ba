"""Which module is running: torch's ModTracker (forward and backward hooks), plus per-module facts
(type, parameters, output shape) gathered from the model and its first forward."""

from __future__ import annotations

import torch
from torch.distributed._tools.mod_tracker import ModTracker
from torch.utils._pytree import tree_flatten

from .events import ModuleRecord, Trace


def describe_modules(model: torch.nn.Module, trace: Trace) -> dict[int, str]:
    """Fill ``trace.modules`` and return a map id(parameter) -> name of the module that owns it."""
    owner: dict[int, str] = {}
    for mod_name, module in model.named_modules(remove_duplicate=True):
        for p in module.parameters(recurse=False):
            owner.setdefault(id(p), mod_name)
        seen: set[int] = set()
        count = nbytes = 0
        for p in module.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                count += p.numel()
                nbytes += p.numel() * p.element_size()
        trace.modules[mod_name] = ModuleRecord(
            name=mod_name, type=type(module).__name__, params=count, param_bytes=nbytes
        )
    return owner


def _shape_text(output) -> tuple[str, int]:
    tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)]
    shapes = [list(t.shape) for t in tensors]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    if not shapes:
        return "", 0
    text = str(shapes[0]) if len(shapes) == 1 else ", ".join(str(s) for s in shapes[:2])
    if len(shapes) > 2:
        text += f", … ({len(shapes)} tensors)"
    return text, nbytes


class ModuleStack:
    """Context manager: ``current()`` names the innermost running module, forward or backward."""

    def __init__(self, model: torch.nn.Module, trace: Trace, wrapper: torch.nn.Module | None = None) -> None:
        self.trace = trace
        self._tracker = ModTracker()
        self._root = type(model).__name__
        if wrapper is not None:  # the step calls a wrapper (DDP) whose .module is ``model``
            self._root = f"{type(wrapper).__name__}.module"
            self._wrapper = type(wrapper).__name__
        self._cache_key: frozenset | None = None
        self._cache_val = ""
        self.record_outputs = True

    _wrapper = None

    def _fqn(self, tracker_name: str) -> str:
        if tracker_name == self._root or tracker_name == self._wrapper:
            return ""
        if tracker_name.startswith(self._root + "."):
            return tracker_name[len(self._root) + 1 :]
        return tracker_name

    def current(self) -> str:
        parents = self._tracker.parents
        key = frozenset(parents)
        if key != self._cache_key:
            names = [p for p in parents if p != "Global"]
            # deepest first; ties (e.g. two embeddings still active in backward) by name, so that
            # attribution does not depend on set order (string hashing differs between runs)
            inner = max(names, key=lambda n: (n.count("."), n), default="")
            self._cache_key, self._cache_val = key, self._fqn(inner) if inner else ""
        return self._cache_val

    def _post_forward(self, module, inputs, output) -> None:
        if not self.record_outputs:
            return
        name = self._fqn(self._tracker.get_known_fqn(module) or type(module).__name__)
        rec = self.trace.modules.get(name)
        if rec is None:
            return
        rec.calls += 1
        if rec.calls == 1:
            rec.output_shape, rec.output_bytes = _shape_text(output)

    def __enter__(self) -> "ModuleStack":
        self._tracker.register_user_hooks(post_fw_hook=self._post_forward)
        self._tracker.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._tracker.__exit__(*exc)
        self._tracker.clear_user_hooks()

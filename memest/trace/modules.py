"""Which module is running: torch's ModTracker (forward and backward hooks), plus per-module facts
(type, parameters, output shape) gathered from the model and its first forward."""

from __future__ import annotations

import torch
from torch.distributed._tools.mod_tracker import ModTracker
from torch.utils._pytree import tree_flatten

from .events import ModuleRecord, Trace


def describe_modules(model: torch.nn.Module, trace: Trace) -> dict[int, str]:
    """Fill ``trace.modules`` and return a map id(parameter) -> name of the module that owns it.

    A parameter is owned by the first module that registers it, in ``named_modules`` order; a shared
    (tied) parameter — GPT-2's ``lm_head.weight`` is ``transformer.wte.weight`` — is counted once, in
    its owner and the owner's ancestors, so the rows add up to the model."""
    owner: dict[int, str] = {}
    first_name: dict[int, str] = {}  # id(parameter) -> its first full name
    shared: dict[int, list[str]] = {}  # id(parameter) -> its other names
    for mod_name, module in model.named_modules(remove_duplicate=True):
        for p_name, p in module.named_parameters(recurse=False):
            full = f"{mod_name}.{p_name}" if mod_name else p_name
            if id(p) in owner:
                shared.setdefault(id(p), []).append(full)
            else:
                owner[id(p)], first_name[id(p)] = mod_name, full
        trace.modules[mod_name] = ModuleRecord(name=mod_name, type=type(module).__name__, params=0, param_bytes=0)
    for p in model.parameters():  # each parameter once
        name = owner[id(p)]
        parts = name.split(".") if name else []
        for depth in range(len(parts) + 1):
            rec = trace.modules.get(".".join(parts[:depth]))
            if rec is not None:
                rec.params += p.numel()
                rec.param_bytes += p.numel() * p.element_size()
    notes = [
        f"{', '.join(others)} {'is' if len(others) == 1 else 'are'} {first_name[pid]} (shared): counted once, "
        f"in {owner[pid] or 'the model'}"
        for pid, others in shared.items()
    ]
    if len(notes) > 3:
        notes = notes[:3] + [f"and {len(notes) - 3} more shared parameters, each counted once in its first module"]
    trace.notes.extend(notes)
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

    def __enter__(self) -> ModuleStack:
        self._tracker.register_user_hooks(post_fw_hook=self._post_forward)
        self._tracker.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._tracker.__exit__(*exc)
        self._tracker.clear_user_hooks()

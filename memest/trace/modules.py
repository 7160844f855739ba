"""Which module is running: torch's ModTracker (forward and backward hooks), plus per-module facts
(type, parameters, output shape) gathered from the model and its first forward."""

from __future__ import annotations

import torch
from torch.autograd.graph import register_multi_grad_hook as _torch_register_multi_grad_hook
from torch.distributed._tools import mod_tracker as _mod_tracker
from torch.distributed._tools.mod_tracker import ModTracker
from torch.utils._pytree import tree_flatten

from memest.trace.events import ModuleRecord, Trace


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
                rec.params += getattr(p, "logical_numel", None) or p.numel()  # a packed 4-bit weight: its elements
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


def _multi_grad_hook_holding_no_grads(tensors, fn):
    """``torch.autograd.graph.register_multi_grad_hook(tensors, fn, mode="all")`` without its buffer of
    gradients. torch's keeps each tensor's gradient (``buffer[id][idx] = grad``) until the last of them
    arrives; ModTracker hooks a module's inputs this way to see its backward end, so a module with several
    inputs that need gradients (a decoder layer's hidden states and the encoder's output it attends to)
    held the first input gradient alive until the last one was computed, where the real step (no hooks)
    frees it as soon as its consumers ran (measured: +0.45% on BART, +1.2% on Swin, -0.59% on Whisper's
    freed loop before; tests/test_trace_stages.py). ModTracker's callbacks only need the moment; they get None
    for every gradient. Same count as torch's: the nodes the engine will execute, on the first call of the
    graph task."""
    from torch.autograd.graph import _get_grad_fn_or_grad_acc

    n = len(tensors)  # the closure must not hold the tensors (a module's inputs: activations)
    # one tensor: the hook firing is the whole answer, so no grad_fn is held. Holding it is a cycle (node ->
    # hook -> closure -> node) that keeps a dropped output's graph, and what it saved, alive until the hooks
    # are removed, where the real step frees it when the output is dropped (LLaVA's unused last vision
    # layer: +6%). Several tensors need their nodes for the count (and keep that cycle).
    grad_fns = [_get_grad_fn_or_grad_acc(t) for t in tensors] if n > 1 else []
    count: dict[int, int] = {}
    expected: dict[int, int] = {}

    def inner_hook(_grad):
        task = torch._C._current_graph_task_id()
        seen = count.get(task, 0)
        if seen == 0:
            expected[task] = sum(map(torch._C._will_engine_execute_node, grad_fns)) if grad_fns else 1
        count[task] = seen + 1
        if seen + 1 == expected[task]:
            del count[task], expected[task]
            fn([None] * n)

    return _Handles([t.register_hook(inner_hook) for t in tensors])


class _Handles:
    """Removes a group of tensor hooks at once (torch's _MultiHandle)."""

    def __init__(self, handles: list) -> None:
        self.handles = handles

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


class _ModTracker(ModTracker):
    """torch's ModTracker, without keeping autograd graphs alive after their backward.

    To see a module's backward start and end, ModTracker hooks its inputs and outputs with
    ``register_multi_grad_hook``, and drops the handle. In mode "all" the hook's closure holds the
    gradient nodes of the hooked tensors, and a node holds its hooks: a cycle through C++ that gc
    cannot see, so every hooked node outlives its backward, and with it the nodes it points to, down
    to each AccumulateGrad and its leaf tensor. For parameters that changes nothing; for a leaf made in
    the forward (transformers' ``enable_input_require_grads`` makes the embeddings' output one, for
    peft and gradient checkpointing) it keeps the leaf and its ``.grad`` alive for the rest of the
    trace, where the real step frees them with the graph (measured: +2.2% on a tiny LoRA Llama). This
    tracker removes the hooks when their backward ends (an autograd engine callback) or on exit."""

    def __init__(self) -> None:
        super().__init__()
        self._grad_hooks: list = []

    def _register(self, tensors, fn, mode: str = "all"):
        if mode == "all":  # torch's count, without its buffer of gradients or, for one tensor, its cycle
            handle = _multi_grad_hook_holding_no_grads(tensors, fn)
        else:
            handle = _torch_register_multi_grad_hook(tensors, fn, mode=mode)
        self._grad_hooks.append(handle)
        return handle

    def _remove_grad_hooks(self) -> None:
        hooks, self._grad_hooks = self._grad_hooks, []
        for handle in hooks:
            handle.remove()

    def _maybe_set_engine_callback(self):
        if not self._has_callback:  # once per backward, as ModTracker's own callback
            torch.autograd.Variable._execution_engine.queue_callback(self._remove_grad_hooks)
        super()._maybe_set_engine_callback()

    def __enter__(self):
        _mod_tracker.register_multi_grad_hook = self._register
        return super().__enter__()

    def __exit__(self, *args):
        try:
            super().__exit__(*args)
        finally:
            _mod_tracker.register_multi_grad_hook = _torch_register_multi_grad_hook
            self._remove_grad_hooks()


class ModuleStack:
    """Context manager: ``current()`` names the innermost running module, forward or backward."""

    def __init__(self, model: torch.nn.Module, trace: Trace, wrapper: torch.nn.Module | None = None) -> None:
        self.trace = trace
        self._tracker = _ModTracker()
        self._root = type(model).__name__
        if wrapper is not None:  # the step calls a wrapper (DDP: its .module; FSDP1: _fsdp_wrapped_module) of ``model``
            child = next((name for name, m in wrapper.named_children() if m is model), "module")
            self._root = f"{type(wrapper).__name__}.{child}"
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

"""Ground truth per kernel: run a function for real under torch.profiler memory events and, for every
call of the aten ops memest models kernel scratch for (targets/cpu/), compare the bytes the real kernel
held with what memest's rule gives for the same call.

For each call: ``real_peak`` (the most bytes allocated inside the op at once, outputs included) and
``real_kept`` (bytes still allocated when it returns: its outputs), next to ``model_peak`` (the rule's
scratch + the outputs the fake kernel makes) and ``model_kept`` (the fake outputs after the rule's
output fix-ups, e.g. the LSTM workspace). The rules see the real tensors' shapes, strides and dtypes,
as they see the fake ones while tracing.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

ALLOCATION = torch._C._profiler._EventType.Allocation


@dataclass
class OpCall:
    op: str
    real_peak: int
    real_kept: int
    model_peak: int
    model_kept: int
    scratch: list[int] = field(default_factory=list)
    allocations: list[int] = field(default_factory=list)  # the real ones, in order (negative: a free)

    @property
    def exact(self) -> bool:
        return self.real_peak == self.model_peak and self.real_kept == self.model_kept


def _storage_bytes(out, inputs=()) -> int:
    """Bytes of the distinct storages in ``out`` that are not the storage of a tensor in ``inputs`` (an in-place op
    returns its ``self``: not a new allocation, as the tracker counts it)."""
    seen = {t.untyped_storage()._cdata for t in tree_flatten(inputs)[0] if isinstance(t, torch.Tensor)}
    total = 0
    for t in tree_flatten(out)[0]:
        if isinstance(t, torch.Tensor):
            key = t.untyped_storage()._cdata
            if key not in seen:
                seen.add(key)
                total += t.untyped_storage().nbytes()
    return total


class _Model(TorchDispatchMode):
    """Calls each rule on the real arguments and the op's meta kernel (what the fake tracer records)."""

    def __init__(self, scratch: dict, outputs: dict) -> None:
        super().__init__()
        self.scratch, self.outputs = scratch, outputs
        self.calls: list[tuple[str, list[int], int, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in self.scratch:
            return func(*args, **kwargs)
        scratch = [n for n in self.scratch[func](args, kwargs) if n > 0]
        meta_args = tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, args)
        meta_out = func(*meta_args, **kwargs)
        fix = self.outputs.get(func)
        late = getattr(fix, "late", ())
        if fix is not None and not late:  # (a) replaced before the tracker records them (ops on meta tensors)
            meta_out = fix(meta_args, kwargs, meta_out, lambda op, *a, **k: op(*a, **k))
        outs = (meta_out,) if isinstance(meta_out, torch.Tensor) else meta_out
        fake_bytes = _storage_bytes([t for i, t in enumerate(outs) if i not in late], meta_args)
        if fix is not None and late:  # (b) made by the kernel after its scratch is freed
            meta_out = fix(meta_args, kwargs, meta_out, _meta_empty)
        self.calls.append((func.__name__, scratch, fake_bytes, _storage_bytes(meta_out, meta_args)))
        return func(*args, **kwargs)


def _meta_empty(shape, dtype, numel=None):
    if numel is None:
        return torch.empty(shape, dtype=dtype, device="meta")
    return torch.empty(numel, dtype=dtype, device="meta").as_strided(shape, [0] * len(shape))


def _real_calls(prof, names: set[str]) -> list[tuple[str, int, int, list[int]]]:
    found = []

    def walk(event) -> None:
        if event.name in names:
            allocations, stack = [], [event]
            while stack:
                e = stack.pop()
                if e.tag == ALLOCATION:
                    allocations.append(e)
                stack.extend(e.children)
            allocations.sort(key=lambda e: e.start_time_ns)
            live = peak = 0
            sizes = [e.extra_fields.alloc_size for e in allocations]
            for size in sizes:
                live += size
                peak = max(peak, live)
            found.append((event.start_time_ns, event.name, peak, live, sizes))
            return
        for child in event.children:
            walk(child)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root)
    found.sort()
    return [f[1:] for f in found]


def measure_ops(fn: Callable[[], None], scratch: dict, outputs: dict) -> list[OpCall]:
    """Run ``fn()`` for real; one :class:`OpCall` per call of an op in ``scratch``."""
    model = _Model(scratch, outputs)
    # Python's cycle collection off while profiling: the dispatch mode's Python runs inside each op's profiler
    # event, and a collection there frees garbage of earlier code (CI: 741,088 B of another test's tensors freed
    # inside a layer norm backward read as the kernel's own frees)
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            with model:
                fn()
    finally:
        if was_enabled:
            gc.enable()
    names = {"aten::" + func.__name__.split(".")[0] for func in scratch}
    real = _real_calls(prof, names)
    if len(real) != len(model.calls):
        raise RuntimeError(f"profiler saw {len(real)} calls of {sorted(names)}, the dispatch mode {len(model.calls)}")
    rows = []
    for (name, sizes, fake_bytes, kept), (_, peak, left, allocations) in zip(model.calls, real, strict=True):
        rows.append(
            OpCall(
                op=name,
                real_peak=peak,
                real_kept=left,
                # the tracker: scratch allocated, then the fake outputs, scratch freed, then the fix-ups
                model_peak=max(sum(sizes) + fake_bytes, kept),
                model_kept=kept,
                scratch=sizes,
                allocations=allocations,
            )
        )
    return rows

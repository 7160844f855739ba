"""StorageTracker: a dispatch mode that records every new storage and, through a weakref
finalizer, the moment it is freed.

It sits above FakeTensorMode, so it sees the fake outputs of every aten op of the forward, the
backward (autograd runs its ops through the same mode stack) and the optimizer step.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry as FLOP_REGISTRY
from torch.utils.weak import WeakIdKeyDictionary

from .events import Category, Phase, StorageRecord, Trace
from .values import ITEM, placeholder_scalar


class StorageTracker(TorchDispatchMode):
    def __init__(self, trace: Trace, module_of: Callable[[], str], scratch: dict | None = None) -> None:
        super().__init__()
        # aten op -> fn(args, kwargs) -> byte sizes of kernel-internal buffers (allocated before the
        # op's outputs, freed after them) that the fake kernel does not show
        self.scratch = scratch or {}
        self.trace = trace
        self.module_of = module_of  # returns the innermost running module's name
        self.phase = Phase.SETUP
        self.iteration = 0
        self._ids: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._closed = False

    # -- bookkeeping -------------------------------------------------------------------------
    def set_phase(self, iteration: int, phase: Phase) -> None:
        self.iteration, self.phase = iteration, phase
        self.trace.phase_marks.append((len(self.trace.events), iteration, phase))

    def storage_id(self, t: torch.Tensor) -> int | None:
        return self._ids.get(t.untyped_storage())

    def register(self, t: torch.Tensor, category: Category, op: str, module: str | None = None) -> int | None:
        """Record ``t``'s storage if it is new; return its id (None for empty storages)."""
        storage = t.untyped_storage()
        sid = self._ids.get(storage)
        if sid is not None:
            return sid
        nbytes = storage.nbytes()
        if nbytes == 0:
            return None
        sid = len(self.trace.storages)
        self.trace.storages.append(
            StorageRecord(
                nbytes=nbytes,
                category=category,
                module=self.module_of() if module is None else module,
                phase=self.phase,
                op=op,
                iteration=self.iteration,
            )
        )
        self._ids[storage] = sid
        self.trace.events.append((sid, nbytes))
        weakref.finalize(storage, self._freed, sid, nbytes)
        return sid

    def _freed(self, sid: int, nbytes: int) -> None:
        if not self._closed:  # frees after the step (tearing the model down) are not part of it
            self.trace.events.append((sid, -nbytes))

    def __exit__(self, *exc):
        self._closed = True
        return super().__exit__(*exc)

    def classify(self, t: torch.Tensor, category: Category) -> None:
        sid = self.storage_id(t)
        if sid is not None:
            self.trace.storages[sid].classify(category)

    # -- dispatch ----------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is ITEM and self.phase is Phase.OPTIMIZER:
            # Adafactor reads param.norm().item() to scale its update: values cannot change memory
            return placeholder_scalar(args[0])
        scratch = self._scratch_alloc(func, args, kwargs) if func in self.scratch else ()
        out = func(*args, **(kwargs or {}))
        outputs, _ = tree_flatten(out)
        for t in outputs:
            if isinstance(t, torch.Tensor):
                self.register(t, Category.TEMPORARIES, func.__name__)
        for sid, nbytes in scratch:
            self.trace.events.append((sid, -nbytes))
        flop_fn = FLOP_REGISTRY.get(func._overloadpacket)
        if flop_fn is not None:
            key = (self.iteration, self.phase, self.module_of())
            self.trace.flops[key] = self.trace.flops.get(key, 0) + int(flop_fn(*args, **(kwargs or {}), out_val=out))
        return out

    def _scratch_alloc(self, func, args, kwargs) -> list[tuple[int, int]]:
        allocated = []
        for nbytes in self.scratch[func](args, kwargs or {}):
            if nbytes <= 0:
                continue
            sid = len(self.trace.storages)
            self.trace.storages.append(
                StorageRecord(nbytes, Category.TEMPORARIES, self.module_of(), self.phase, f"{func.__name__} (kernel scratch)", self.iteration)
            )
            self.trace.events.append((sid, nbytes))
            allocated.append((sid, nbytes))
        return allocated

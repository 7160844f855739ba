"""StepFeature: the one seam a technique plugs into the traced step (torchtitan's model-converter shape).

A feature is an object with no-op defaults; the composition root (features/registry.py) picks the
features of a spec and hands them to ``trace_step``, which calls each hook in the order of the list.
The trace core never imports a feature. One feature object serves one trace (it may keep state).

Hooks, in the order the step calls them:
  session(spec)           context around build and step (the fake process group of --world-size)
  build(built, spec)      model transforms after building and the dtype cast (LoRA, checkpointing)
  inputs(inputs, spec)    the step's inputs as built from the source, replaced (a preference batch of pairs)
  prepare(step)           after the build: wrap the model (data parallel), install a compiled forward;
                          may return a context that stays entered while the model exists
  optimizer(step)         the optimizer the step runs; the first feature that returns one wins
  rules(step)             what the storage tracker must know (TrackerRules), read when it is made
  register(step)          storages that exist before the step, registered before the model's own
  contexts(step)          context managers around the step, entered inside the tracker; each cleans up
  pack(step, t) / unpack(step, packed)
                          a tensor saved for backward, as autograd's saved_tensors_hooks see it (activation
                          offloading); called only for features with ``packs_saved = True``
  loop(model, spec)       context around the user's loop (also in real runs: validate/)
  autocast(spec, device)  the mixed-precision context, where a feature replaces torch.autocast
  after(step, phase)      after the loss, backward and the optimizer step
  host(trace, spec)       storage ids this feature keeps in host memory (nothing moves implicitly)
  finish(step)            notes for the report, once the step is traced
And two that are read, not called in order: counters() (objects whose int and dict-of-int attributes count what ops
did) and caches() (id -> (weakref, tensor) caches the ops fill), which a replayed recomputation (trace/recompute.py)
adds to as the recorded one did.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

from memest.trace.tracker import TrackerRules

__all__ = ["StepFeature", "TrackerRules"]


class StepFeature:
    """A technique's part of the traced step; every hook a no-op."""

    name = "feature"
    packs_saved = False  # True where pack/unpack are overridden (each saved tensor then goes through them)

    def session(self, spec) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def build(self, built, spec) -> None:
        """Transform ``built.model`` (and add ``built.notes``)."""

    def inputs(self, inputs, spec) -> Any:
        """The step's inputs, from those the source built (after the dtype cast)."""
        return inputs

    def prepare(self, step) -> contextlib.AbstractContextManager | None:
        return None

    def optimizer(self, step) -> Any:
        return None

    def rules(self, step) -> TrackerRules:
        return TrackerRules()

    def register(self, step) -> None:
        """Register the storages this feature made before the step (``step.tracker.register``)."""

    def contexts(self, step) -> list[contextlib.AbstractContextManager]:
        return []

    def caches(self) -> list[dict]:
        """Caches the step's ops fill, ``id(source) -> (weakref to source, tensor)``, each entry held until the cache is
        cleared (CUDA autocast's weight casts): a replayed recomputation (trace/recompute.py) fills them as the
        recorded one did."""
        return []

    def counters(self) -> list[object]:
        """Objects whose int and dict-of-int attributes count what the step's ops did (a kernel rule's calls, SDPA's
        backend choices), read after the step: a replayed recomputation (trace/recompute.py) adds to them what the
        recorded one added."""
        return []

    def pack(self, step, t) -> Any:
        """A tensor saved for backward (already marked an activation): what backward will unpack."""
        return t

    def unpack(self, step, packed) -> Any:
        """What ``pack`` returned, as backward uses it."""
        return packed

    def loop(self, model, spec) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def autocast(self, spec, device_type: str) -> contextlib.AbstractContextManager | None:
        return None

    def after(self, step, phase) -> None:
        """After ``phase`` (loss, backward, optimizer step) of every micro-step."""

    def host(self, trace, spec) -> Iterable[int]:
        return ()

    def finish(self, step) -> list[str]:
        return []


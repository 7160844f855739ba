"""Replayed recomputations: a checkpointed block's recomputation in backward, replayed from an earlier one.

Under selective activation checkpointing (``--checkpointing selective``: torch.utils.checkpoint with
``create_selective_checkpoint_contexts``, ``early_stop=False``, features/selective.py) the backward of every
checkpointed block re-runs the block's forward: each op the policy did not save runs again on the fake tensors and
the tracker records it, each op it saved is answered from SAC's cache (torch's ``_CachedTorchDispatchMode``), and
what autograd saves is handed to checkpointing's recomputation hook, which keeps it for the block's backward. For a
stack of identical blocks every recomputation after the first runs the same ops on arguments of the same metadata
and records the same storages and events in the same order. So the first recomputation with a given key is run and
its part of the trace recorded (a :class:`Template`); a later one with that key appends the same records and events
(fresh ids, the running module and phase as the ops would have named them), hands checkpointing's hook fresh fake
tensors of the recorded metadata (over new storages, or over the block's own parameters, arguments and SAC-cached
outputs, as the recorded ones were), marks SAC's cache consumed as the real one does, and returns a fresh output,
without running the ops: the trace is byte for byte the one the ops make (scripts/trace_digest.py;
tests/test_recompute.py), at a fraction of the time (benchmarks/sac.md).

A recomputation is replayed only where its key says it is the same program on the same metadata, and recorded only
where its record shows nothing a replay cannot repeat; otherwise it simply runs:

- the key: the block's class; its forward's part of the trace (its records and events relative to the block: the same
  ops on the same sizes, named by the same submodules); the shape of SAC's cache after that forward (which op calls
  were saved, with their outputs' metadata); the arguments' metadata (tensors, the plain values and containers of
  them; a ``functools.partial``'s keywords, as transformers' layers pass theirs); the block's parameters' and
  buffers' metadata; which of all these share a storage; the block's running submodules; the tracker's label, the
  grad and autocast state, the function modes, the features' counters;
- the dispatch modes are the tracking mode and SAC's replaying mode, with between them only modes that say a replay
  may pass over them (``replay_transparent``: sources/hf_values.py KnownValues, which follows a VLM's index tensors
  with their real values; what it follows of the sources is in the key, and a recording whose saved tensors or
  output it follows is not kept), the tracker records (not ignoring, not inside another op), no inference mode, no
  compilation, and the hook on top is checkpointing's recomputation hook;
- the recorded run changed nothing of the trace but its own storages and events, FLOPs (each entry that changed
  accounted for by the ops it counted, under the modules they ran in), the call counts of the block's own
  submodules, the features' counters (``StepFeature.counters``: SDPA's backend choices, kernel rules' calls) and the
  storages of SAC-cached outputs it consumed (a cached output freed once consumed); every storage it made and did
  not free is held by what it saved, its output, or a feature's weight cache (``StepFeature.caches``: CUDA
  autocast's casts of the parameters, targets/cuda/autocast.py, cleared when the recomputation's autocast region
  exits, as CUDA's); the modules running while it ran were the block's own submodules above the same outer ones
  (torch's ModTracker), which a replay sets as they were, for the names its records and FLOPs take.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils import checkpoint as _checkpoint
from torch.utils._pytree import tree_flatten, tree_unflatten

from memest.trace.events import StorageRecord
from memest.trace.replay import side_state, tracking_mode
from memest.trace.tracker import META, _new_fake, _plain_fake

# torch 2.13 torch/utils/checkpoint.py: SAC's cache entries (an op left to recompute, an entry returned once) and
# its two modes (the forward's, which fills the cache, and the recomputation's, which answers from it)
_RECOMPUTE = getattr(_checkpoint, "_RECOMPUTE", None)
_CONSUMED = getattr(_checkpoint, "_CONSUMED", None)
_CACHING = getattr(_checkpoint, "_CachingTorchDispatchMode", None)
_CACHED = getattr(_checkpoint, "_CachedTorchDispatchMode", None)
_SUPPORTED = None not in (_RECOMPUTE, _CONSUMED, _CACHING, _CACHED)

_LEAVES = (type(None), bool, int, float, str, torch.dtype, torch.device)


class _Ineligible(Exception):
    """The recomputation cannot be keyed or repeated: it runs."""


def _modes() -> tuple | None:
    """(the tracking mode, the modes above it a replay may pass over, the mode on top) of the dispatch stack, else
    None. A mode in between is passed over where its class says so (``replay_transparent``: sources/hf_values.py
    KnownValues, which follows a VLM's index tensors with their real values) and gives, through ``replay_key``, what
    it follows of a recomputation's sources, and, through ``holds``, whether it follows a tensor."""
    depth = torch._C._len_torch_dispatch_stack()
    if depth < 2 or (mode := tracking_mode(depth)) is None:
        return None
    middle = tuple(torch._C._get_dispatch_stack_at(i) for i in range(1, depth - 1))
    if not all(getattr(type(m), "replay_transparent", False) for m in middle):
        return None
    return mode, middle, torch._C._get_dispatch_stack_at(depth - 1)


@dataclass(frozen=True)
class Template:
    """One recorded recomputation, relative to its block.

    ``records``: its new storages (nbytes, category, op, saved_for_backward, host, saved_copy, stream, the block's own
    running submodules when it was made); ``events``: in order, ("new", position, delta) over those, or ("sac", source)
    for a SAC-cached output freed once consumed; ``kept``: the positions it did not free; ``workspaces``: its kernels'
    workspace ranges by position; ``flops``: (running submodules, FLOPs) per op that counted some; ``calls``:
    (submodule, calls added) where ModuleStack counted calls (``counted_calls``); ``inner_end``: the block's running
    submodules after it; ``counts``: per feature counter, (attribute, key or None, added); ``saved``: what it handed
    checkpointing's hook, in order, ``casts``: per feature weight cache (StepFeature.caches) the casts it cached,
    (source, tensor), and
    ``output``: its output (leaves, tree), each tensor a (where, view) pair (:func:`_view_of`): where ("new",
    position), a source (an argument, a parameter or buffer, a SAC-cached output) or "empty"; ``consumed``: SAC's cache
    entries it consumed."""

    records: tuple
    events: tuple
    kept: frozenset
    workspaces: dict
    flops: tuple
    calls: tuple
    counted_calls: bool
    inner_end: frozenset
    counts: tuple
    saved: tuple
    casts: tuple
    output: tuple
    consumed: tuple


class Recomputes:
    """The templates of one trace: ``region(fn, name, module)`` gives the function to hand to one
    ``torch.utils.checkpoint`` call of the block ``module`` (named ``name``); ``calls`` / ``replayed`` count the
    recomputations that reached it and those replayed."""

    enabled = True  # False: every recomputation runs (tests/test_recompute.py compares the two)

    def __init__(self) -> None:
        self.templates: dict = {}
        self.failed: set = set()
        self.calls = 0
        self.replayed = 0
        self.counters: Callable[[], list] = list  # the features' counters (StepFeature.counters)
        self.caches: Callable[[], list] = list  # the features' weight caches (StepFeature.caches)

    def region(self, fn: Callable, name: str, module: nn.Module) -> Callable:
        if not _SUPPORTED or not self.enabled:
            return fn
        return _Region(self, fn, name, module)


class _Region:
    """One checkpoint call's function: its first call is the forward (its part of the trace kept for the key), every
    later one a recomputation."""

    def __init__(self, owner: Recomputes, fn: Callable, name: str, module: nn.Module) -> None:
        self.owner, self.fn, self.name, self.module = owner, fn, name, module
        self.runs = 0
        self.fingerprint = None
        self.storage = None  # SAC's cache (shared by its two modes)

    def __call__(self, *args, **kwargs):
        self.runs += 1
        if self.runs == 1:
            return self._forward(args, kwargs)
        return self._recompute(args, kwargs)

    def _forward(self, args, kwargs):
        modes = _modes()
        if modes is None or not isinstance(modes[2], _CACHING):
            return self.fn(*args, **kwargs)
        mode, _, top = modes
        trace = mode.tracker.trace
        first_storage, first_event = len(trace.storages), len(trace.events)
        out = self.fn(*args, **kwargs)
        self.fingerprint = _fingerprint(trace, first_storage, first_event, self.name)
        self.storage = top.storage
        return out

    def _recompute(self, args, kwargs):
        owner = self.owner
        owner.calls += 1
        modes = _modes()
        if modes is None or self.fingerprint is None or torch.compiler.is_compiling() or not torch.is_grad_enabled():
            return self.fn(*args, **kwargs)
        mode, middle, _ = modes
        try:
            key, sources, running, pack = self._key(modes, args, kwargs)
        except _Ineligible:
            return self.fn(*args, **kwargs)
        template = owner.templates.get(key)
        if template is not None and (template.counted_calls or not running.stack.record_outputs):
            owner.replayed += 1
            return _replay(mode, template, sources, running, pack, self.storage, owner)
        if template is not None or key in owner.failed:  # a template of a step that counted no module calls
            sources.clear()
            return self.fn(*args, **kwargs)
        out, template = _Recording(mode, self, sources, running, pack, middle).run(args, kwargs)
        if template is None:
            owner.failed.add(key)
        else:
            owner.templates[key] = template
        return out

    def _key(self, modes, args, kwargs) -> tuple:
        """(the key, the sources: place -> tensor, the running modules, checkpointing's pack hook)."""
        mode, middle, cached = modes
        if not isinstance(cached, _CACHED) or cached.storage is not self.storage or torch.is_inference_mode_enabled():
            raise _Ineligible
        pack = (torch._C._autograd._top_saved_tensors_default_hooks(False) or (None,))[0]
        if pack is None or "_recomputation_hook" not in getattr(pack, "__qualname__", ""):
            raise _Ineligible
        tracker = mode.tracker
        stack = getattr(tracker.module_of, "__self__", None)
        if stack is None or not hasattr(stack, "_tracker"):
            raise _Ineligible  # the running module is not named by memest's ModuleStack
        running = _Running(stack, self.name)
        sources: dict = {}  # place -> tensor (dropped once the replay or the recording has read them)
        partial_key = None
        if isinstance(self.fn, functools.partial):  # transformers' layers: partial(forward, layer, **kwargs)
            if self.fn.args != (self.module,):
                raise _Ineligible
            partial_key = _value_key(self.fn.keywords, mode, sources, ("partial",))
        arg_key = _value_key(args, mode, sources, ("arg",))
        kwarg_key = _value_key(kwargs, mode, sources, ("kwarg",))
        params = []
        for rel, t in (*self.module.named_parameters(), *self.module.named_buffers()):
            params.append((rel, _tensor_key(t, mode, allow_subclass=True)))
            sources[("param", rel)] = t
        sac = _sac_key(self.storage, mode, sources)
        autocast = tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda"))
        functions = (tuple(type(m) for m in torch.overrides._get_current_function_mode_stack())
                     if torch._C._len_torch_function_stack() else ())
        # what the modes between the tracking mode and SAC's follow of the sources (KnownValues: real index values)
        known = tuple((type(m), m.replay_key(list(sources.values()))) for m in middle)
        key = (type(self.module), self.fingerprint, sac, known, running.split(running.parents)[1],
               tuple(type(c) for c in self.owner.counters()), len(self.owner.caches()), partial_key, arg_key, kwarg_key, tuple(params),
               _alias_key(tracker, sources), tracker.label, autocast, torch.is_autocast_cache_enabled(), functions)
        return key, sources, running, pack


# -- the key ------------------------------------------------------------------------------------------------------
def _relative(module: str, block: str) -> tuple:
    """("" or ".sub",) for the block or a submodule of it; ("outside", module) for any other module."""
    if module == block:
        return ("",)
    if module.startswith(block + "."):
        return (module[len(block):],)
    return ("outside", module)


def _fingerprint(trace, first_storage: int, first_event: int, block: str) -> tuple:
    """The forward's part of the trace, relative to the block: its records (module relative to the block) and events
    (by position among its storages, or a storage made before it by its size)."""
    records = tuple((r.nbytes, r.category, r.op, _relative(r.module, block), r.saved_for_backward, r.host,
                     r.saved_copy, r.stream) for r in trace.storages[first_storage:])
    events = tuple((sid - first_storage, delta) if sid >= first_storage else ("before", delta)
                   for sid, delta in trace.events[first_event:])
    return records, events


def _tensor_key(t, mode, allow_subclass: bool = False) -> tuple:
    if type(t) is not FakeTensor and not (allow_subclass and isinstance(t, FakeTensor)):
        raise _Ineligible
    if not _plain_fake(t, mode) or t.is_conj() or t.is_neg():
        raise _Ineligible
    return (type(t), t.shape, t.stride(), t.dtype, t.storage_offset(), t.untyped_storage().nbytes(), t.requires_grad,
            t.fake_device)


def _value_key(a, mode, sources: dict, where: tuple):
    """A hashable key of an argument's metadata, its tensors added to ``sources`` under ``where`` + their place."""
    kind = type(a)
    if kind in _LEAVES:
        return (kind, a)
    if isinstance(a, torch.Tensor):
        sources[where] = a
        return _tensor_key(a, mode)
    if kind in (tuple, list):
        return (kind, *(_value_key(v, mode, sources, (*where, i)) for i, v in enumerate(a)))
    if kind is dict and all(type(k) is str for k in a):
        return (dict, *((k, _value_key(v, mode, sources, (*where, k))) for k, v in a.items()))
    raise _Ineligible


def _sac_key(storage, mode, sources: dict) -> tuple:
    """The shape of SAC's cache: per op and call, recomputed or its saved output's structure and metadata (each
    cached tensor added to ``sources`` as ("sac", op, call, leaf))."""
    if storage is None:
        raise _Ineligible
    key = []
    for op, entries in storage.items():
        calls = []
        for idx, entry in entries.items():
            if entry is _RECOMPUTE:
                calls.append((idx, "recompute"))
                continue
            if entry is _CONSUMED:
                raise _Ineligible
            leaves, spec = tree_flatten(entry)
            items = []
            for i, wrapper in enumerate(leaves):
                value = getattr(wrapper, "val", wrapper)
                if isinstance(value, torch.Tensor):
                    sources[("sac", op, idx, i)] = value
                    items.append(_tensor_key(value, mode))
                elif type(value) in _LEAVES:
                    items.append((type(value), value))
                else:
                    raise _Ineligible
            calls.append((idx, str(spec), tuple(items)))
        key.append((op, tuple(calls)))
    return tuple(key)


def _alias_key(tracker, sources: dict) -> tuple:
    """For each source in order, the place of the first source over its storage."""
    first: dict = {}
    return tuple(first.setdefault(sid, where) if (sid := tracker.storage_id(t)) is not None else None
                 for where, t in sources.items())


def _by_storage(tracker, sources: dict) -> dict:
    """storage id -> the place of the first source over it (a function of its own: no loop variable of the
    recording's frame keeps a tensor alive, which would move its free)."""
    by_sid: dict = {}
    for where, t in sources.items():
        sid = tracker.storage_id(t)
        if sid is not None:
            by_sid.setdefault(sid, where)
    return by_sid


class _Running:
    """The running modules as torch's ModTracker holds them (``parents``, names prefixed by the root's class name)
    and ModuleStack names them, split into the block's own submodules (relative: "" for the block, ".sub") and the
    others."""

    def __init__(self, stack, block: str) -> None:
        self.stack, self.block = stack, block
        self.parents = stack._tracker.parents
        self.prefix = f"{stack._root}.{block}" if block else stack._root  # ModTracker's name of the block

    def inner(self, name: str) -> str | None:
        fqn = self.stack._fqn(name)
        if fqn == self.block:
            return ""
        if fqn.startswith(self.block + "."):
            return fqn[len(self.block):]
        return None

    def split(self, parents) -> tuple[frozenset, frozenset]:
        outer, inside = [], []
        for p in parents:
            rel = self.inner(p)
            if rel is None:
                outer.append(p)
            else:
                inside.append(rel)
        return frozenset(outer), frozenset(inside)

    def label(self, outer: frozenset, inside: frozenset) -> str:
        """The module ModuleStack names while ``outer`` and the block's ``inside`` submodules run (``parents`` left
        so)."""
        self.parents.clear()
        self.parents.update(outer)
        self.parents.update(self.prefix + rel for rel in inside)
        return self.stack.current()


# -- recording ----------------------------------------------------------------------------------------------------
class _Recording:
    """One recomputation run with its part of the trace read (:meth:`run`)."""

    def __init__(self, mode, region: _Region, sources: dict, running: _Running, pack, middle: tuple = ()) -> None:
        self.mode, self.region, self.running, self.pack = mode, region, running, pack
        self.middle = middle  # modes between the tracking mode and SAC's (replay_transparent)
        self.followed: list = []  # per saved tensor: whether such a mode follows it
        self.tracker = mode.tracker
        self.trace = self.tracker.trace
        self.by_sid = _by_storage(self.tracker, sources)
        sources.clear()
        self.snaps: list = []  # (storages so far, running modules) at each module_of call
        self.flop_adds: list = []  # (running modules, FLOPs) per op that counted some
        self.saved: list = []  # what checkpointing's hook was handed: (storage id, view) each

    def run(self, args, kwargs):
        """(the recomputation's output, a Template or None where a replay could not repeat it)."""
        tracker, trace = self.tracker, self.trace
        self.outer, _ = self.running.split(self.running.parents)
        self.first_storage, self.first_event = len(trace.storages), len(trace.events)
        self.side = side_state(tracker)
        self.calls_before = {n: rec.calls for n, rec in trace.modules.items()}
        self.flops_before = dict(trace.flops)
        self.casts_before = [set(cache) for cache in self.region.owner.caches()]
        self.counters = self.region.owner.counters()
        self.counts_before = [_counts(c) for c in self.counters]
        self.sac_before = [(op, idx) for op, entries in self.region.storage.items() for idx, e in entries.items()
                           if e is not _RECOMPUTE]
        module_of, count_flops = tracker.module_of, tracker._count_flops
        parents, snaps, flop_adds = self.running.parents, self.snaps, self.flop_adds

        def named():
            snaps.append((len(trace.storages), frozenset(parents)))
            return module_of()

        def counted(func, f_args, f_kwargs, out):
            key = (tracker.iteration, tracker.phase, module_of())
            before = trace.flops.get(key)
            count_flops(func, f_args, f_kwargs, out)
            if trace.flops.get(key) != before:
                flop_adds.append((frozenset(parents), trace.flops[key] - (before or 0)))

        def packing(x):  # what describes it, not the tensor (holding it would keep its storage alive)
            self.saved.append(_view_of(tracker, self.mode, x))
            self.followed.append(any(m.holds(x) for m in self.middle))
            return self.pack(x)

        tracker.module_of, tracker._count_flops = named, counted
        try:
            with torch.autograd.graph.saved_tensors_hooks(packing, lambda x: x):
                out = self.region.fn(*args, **kwargs)
        finally:
            tracker.module_of, tracker._count_flops = module_of, count_flops
        try:
            return out, self._template(out)
        except _Ineligible:
            return out, None

    def _inside(self, parents: frozenset) -> frozenset:
        outer, inside = self.running.split(parents)
        if outer != self.outer:
            raise _Ineligible  # the recomputation changed which modules outside its block run
        return inside

    def _template(self, out) -> Template:
        tracker, trace = self.tracker, self.trace
        if side_state(tracker) != self.side:
            raise _Ineligible
        records, events, kept = self._storages()
        flops = self._flops()
        calls = self._calls()
        inner_end = self._inside(frozenset(self.running.parents))
        held: set = set()
        saved = tuple(self._located(seen, kept, held) for seen in self.saved)
        leaves, spec = tree_flatten(out)
        output = tuple(self._located(_view_of(tracker, self.mode, v), kept, held) if isinstance(v, torch.Tensor)
                       else _plain(v) for v in leaves)
        followed = self.followed + [any(m.holds(v) for m in self.middle) if isinstance(v, torch.Tensor) else False
                                    for v in leaves]
        if any(f and where[0] == "new" for f, (where, _) in zip(followed, saved + output, strict=True)
               if where != "value"):
            raise _Ineligible  # a mode follows a tensor made here, which a replay would hand over fresh, unfollowed
        casts = self._casts(kept, held)
        if kept - held:
            raise _Ineligible  # a storage made here that outlives it, held by something a replay cannot hold
        consumed = tuple(self.sac_before)
        if any(self.region.storage[op][idx] is not _CONSUMED for op, idx in consumed):
            raise _Ineligible
        workspaces = {sid - self.first_storage: v for sid, v in trace.workspace_ranges.items()
                      if sid >= self.first_storage}
        counts = _count_deltas(self.counts_before, [_counts(c) for c in self.counters])
        return Template(records, events, frozenset(kept), workspaces, flops, calls, self.running.stack.record_outputs,
                        inner_end, counts, saved, casts, (output, spec), consumed)

    def _storages(self) -> tuple[tuple, tuple, set]:
        """(records, events, positions kept): each new storage made once, in order, freed at most once; a storage
        made before, only a SAC-cached output freed once consumed."""
        trace, first_storage = self.trace, self.first_storage
        made_at = dict(self.snaps)  # storages so far -> the running modules at the last module_of call then
        new = trace.storages[first_storage:]
        records = []
        for i, r in enumerate(new):
            parents = made_at.get(first_storage + i)
            if parents is None:
                raise _Ineligible  # a record named by someone else than the tracker's module_of
            records.append((r.nbytes, r.category, r.op, r.saved_for_backward, r.host, r.saved_copy, r.stream,
                            self._inside(parents)))
        events, allocated, freed = [], 0, set()
        for sid, delta in trace.events[self.first_event:]:
            rel = sid - first_storage
            if rel < 0:
                where = self.by_sid.get(sid)
                if where is None or where[0] != "sac" or delta != -trace.storages[sid].nbytes:
                    raise _Ineligible
                events.append(("sac", where))
            elif delta > 0:
                if rel != allocated or delta != new[rel].nbytes:
                    raise _Ineligible
                allocated += 1
                events.append(("new", rel, delta))
            elif rel >= allocated or rel in freed or -delta != new[rel].nbytes:
                raise _Ineligible
            else:
                freed.add(rel)
                events.append(("new", rel, delta))
        if allocated != len(new):
            raise _Ineligible
        return tuple(records), tuple(events), set(range(len(new))) - freed

    def _flops(self) -> tuple:
        """(running submodules, FLOPs) per counting op; every FLOP entry that changed accounted for by them."""
        trace, tracker = self.trace, self.tracker
        totals: dict = {}
        for parents, n in self.flop_adds:
            key = (tracker.iteration, tracker.phase, _named(self.running, parents))
            totals[key] = totals.get(key, 0) + n
        for key in set(trace.flops) | set(self.flops_before):
            if trace.flops.get(key, 0) - self.flops_before.get(key, 0) != totals.get(key, 0):
                raise _Ineligible
        return tuple((self._inside(parents), n) for parents, n in self.flop_adds)

    def _calls(self) -> tuple:
        """(submodule relative to the block, calls added): the block's own submodules only."""
        calls = []
        for name, rec in self.trace.modules.items():
            added = rec.calls - self.calls_before.get(name, 0)
            if added:
                rel = _relative(name, self.region.name)
                if len(rel) != 1:
                    raise _Ineligible
                calls.append((rel[0], added))
        return tuple(calls)

    def _located(self, seen, kept: set, held: set) -> tuple:
        """A tensor's (where, view): over a storage made here and kept (its position), a source, or empty."""
        if seen is None:
            raise _Ineligible
        sid, view = seen
        if sid is None:
            return ("empty", view)
        rel = sid - self.first_storage
        if rel >= 0:
            if rel not in kept:
                raise _Ineligible
            held.add(rel)
            return (("new", rel), view)
        where = self.by_sid.get(sid)
        if where is None:
            raise _Ineligible
        return (where, view)

    def _casts(self, kept: set, held: set) -> tuple:
        """The weight casts cached here, per cache (StepFeature.caches): (the parameter's place, the cast)."""
        casts = []
        caches = self.region.owner.caches()
        if len(caches) != len(self.casts_before):
            raise _Ineligible
        for cache, before in zip(caches, self.casts_before, strict=True):
            added = []
            for key, (ref, cast) in cache.items():
                if key in before:
                    continue
                source = ref()
                where = self.by_sid.get(self.tracker.storage_id(source)) if source is not None else None
                if where is None or where[0] != "param":
                    raise _Ineligible
                added.append((where, self._located(_view_of(self.tracker, self.mode, cast), kept, held)))
            casts.append(tuple(added))
        return tuple(casts)


def _named(running: _Running, parents: frozenset) -> str:
    """The module ModuleStack names for ModTracker's ``parents`` (``parents`` restored after)."""
    live = running.parents
    kept = set(live)
    try:
        live.clear()
        live.update(parents)
        return running.stack.current()
    finally:
        live.clear()
        live.update(kept)


def _view_of(tracker, mode, t) -> tuple | None:
    """(storage id, (sizes, strides, offset, dtype, device)) of a plain fake tensor, or None."""
    if type(t) is not FakeTensor or not _plain_fake(t, mode) or t.is_conj() or t.is_neg():
        return None
    sid = tracker.storage_id(t)
    if sid is None and t.untyped_storage().nbytes():
        return None
    return sid, (tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype, t.fake_device)


def _plain(v) -> tuple:
    if type(v) not in _LEAVES:
        raise _Ineligible
    return ("value", v)


def _counts(obj) -> dict:
    """A counter object's int and dict-of-int attributes."""
    out = {}
    for name, value in vars(obj).items():
        if type(value) is int:
            out[name] = value
        elif isinstance(value, dict) and all(type(v) is int for v in value.values()):
            out[name] = dict(value)
    return out


def _count_deltas(before: list, after: list) -> tuple:
    """Per counter, (attribute, key or None for an int, added) for each count that changed."""
    deltas = []
    for b, a in zip(before, after, strict=True):
        changes = []
        for name, value in a.items():
            if type(value) is int:
                if value != b.get(name, 0):
                    changes.append((name, None, value - b.get(name, 0)))
            else:
                old = b.get(name, {})
                changes += [(name, k, v - old.get(k, 0)) for k, v in value.items() if v != old.get(k, 0)]
        deltas.append(tuple(changes))
    return tuple(deltas)


# -- replaying ----------------------------------------------------------------------------------------------------
def _replay(mode, template: Template, sources: dict, running: _Running, pack, storage: dict, owner: Recomputes):
    """The recorded recomputation's records and events appended anew, its counts added, checkpointing's hook handed
    fresh tensors of what it saved, SAC's cache consumed, and a fresh output returned."""
    try:
        outer, _ = running.split(running.parents)
        owners = _replay_storages(mode, template, sources, running, outer, storage)
        _replay_counts(mode.tracker, template, running, outer, owner.counters())
        return _replay_tensors(mode, template, sources, owners, pack, storage, owner.caches())
    finally:
        sources.clear()


def _replay_storages(mode, template: Template, sources: dict, running: _Running, outer: frozenset,
                     storage: dict) -> dict:
    """The records and events, in order; returns one fake tensor over each kept storage, by position."""
    tracker = mode.tracker
    trace = tracker.trace
    first = len(trace.storages)
    phase, iteration, events, storages = tracker.phase, tracker.iteration, trace.events, trace.storages
    owners: dict[int, FakeTensor] = {}
    cpu = torch.device("cpu")
    for event in template.events:
        if event[0] == "sac":  # a cached output freed once consumed: dropped from the cache, the tracker sees it go
            where = event[1]
            before = len(events)
            sources.pop(where, None)
            storage[where[1]][where[2]] = _CONSUMED
            if len(events) != before + 1:
                raise RuntimeError("memest: a replayed recomputation kept a SAC-cached output the recorded one freed "
                                   "(trace/recompute.py)")
            continue
        _, rel, delta = event
        if delta < 0:
            events.append((first + rel, delta))
            continue
        nbytes, category, op, saved, host, saved_copy, stream, inside = template.records[rel]
        module = running.label(outer, inside)
        if rel in template.kept:
            with torch._C._DisableTorchDispatch():
                meta = torch.empty(nbytes, dtype=torch.uint8, device=META)
            owners[rel] = _new_fake(mode, meta, cpu)
            rec = storages[tracker.register(owners[rel], category, op, module=module)]
            rec.saved_for_backward, rec.host, rec.saved_copy = saved, host, saved_copy
        else:
            storages.append(StorageRecord(nbytes, category, module, phase, op, iteration, saved, host, saved_copy,
                                          stream))
            events.append((first + rel, delta))
    for rel, value in template.workspaces.items():
        trace.workspace_ranges[first + rel] = value
    return owners


def _replay_counts(tracker, template: Template, running: _Running, outer: frozenset, counters: list) -> None:
    """FLOPs under the modules the ops ran in, module calls (where counted), the features' counters, and the running
    modules as the recomputation left them."""
    trace = tracker.trace
    for inside, n in template.flops:
        key = (tracker.iteration, tracker.phase, running.label(outer, inside))
        trace.flops[key] = trace.flops.get(key, 0) + n
    running.label(outer, template.inner_end)
    if running.stack.record_outputs:  # ModuleStack counts calls in the first traced step only
        for rel, added in template.calls:
            trace.modules[running.block + rel].calls += added
    for counter, changes in zip(counters, template.counts, strict=True):
        for name, key, added in changes:
            if key is None:
                setattr(counter, name, getattr(counter, name) + added)
            else:
                table = getattr(counter, name)
                table[key] = table.get(key, 0) + added


def _replay_tensors(mode, template: Template, sources: dict, owners: dict, pack, storage: dict, caches: list):
    """The weight casts cached again, SAC's cache consumed, checkpointing's hook handed what was saved; the
    output."""

    def make(desc):
        where, (shape, stride, offset, dtype, device) = desc
        with torch._C._DisableTorchDispatch():
            if where == "empty":
                meta = torch.empty_strided(shape, stride, dtype=dtype, device=META)
            else:
                base = owners[where[1]] if where[0] == "new" else sources[where]
                meta = torch.empty(0, dtype=dtype, device=META).set_(base.untyped_storage(), offset, shape, stride)
        return _new_fake(mode, meta, device)

    for cache, casts in zip(caches, template.casts, strict=True):
        for where, desc in casts:
            source = sources[where]
            cache[id(source)] = (weakref.ref(source), make(desc))
    saved = [make(desc) for desc in template.saved]
    leaves, spec = template.output
    out = tree_unflatten([make(d) if d[0] != "value" else d[1] for d in leaves], spec)
    for op, idx in template.consumed:
        storage[op][idx] = _CONSUMED
    owners.clear()
    sources.clear()
    x = None
    for i in range(len(saved)):  # in order; none held here once handed over
        x, saved[i] = saved[i], None
        pack(x)
    x = None
    return out

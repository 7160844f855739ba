"""Replayed calls: a library function whose recorded memory events repeat, replayed from its first call.

torchao's float8 training runs, for every float8 Linear, the same small functions again and again: a dynamic cast
(``hp_tensor_to_float8_dynamic``: abs, amax, the scale's float64 arithmetic, the scaled copy, the saturating
clamp, the float8 copy; 11 aten ops) three times per forward and backward, and the float8 matmul (the aten.mm
handler of ``Float8TrainingTensor``: the operands' layout, the inverse scales, ``_scaled_mm``). For the same
argument metadata (shapes, strides, dtypes, the float8 config) every call runs the same ops and allocates and
frees the same storages in the same order. So the first call with a given key runs and its part of the trace is
recorded (a :class:`Template`); a later call with that key appends the same storage records and events (fresh ids,
the running module, phase and iteration, as the ops would have recorded them) and returns fresh fake outputs of
the recorded metadata, without running the ops: the trace is byte for byte the one the ops make
(scripts/trace_digest.py; tests/test_replay.py), at a fraction of the time (benchmarks/fp8-trace-speed.md).

With ``--optim-in-backward`` (one torch.optim optimizer per parameter, features/optim_in_backward.py) the same holds
for torch.optim's update functions (``_multi_tensor_adam``, ``_single_tensor_adam``, SGD's): one call per parameter,
for parameters of a few shapes, each allocating and freeing the same temporaries and updating its arguments in place
(no event: in-place writes allocate nothing). Their step counters are constant fake tensors (``torch.tensor(0.0)``,
whose value FakeTensorMode keeps and the update bumps in place and reads with ``item()``): such a constant is keyed
by its value, and a replay leaves in it the value the recorded call left (the same value before, the same ops).

A call is replayed only where nothing else could see the ops it skips, and recorded only where its record
shows nothing a template cannot repeat; otherwise it simply runs:

- its tensors are plain fake tensors of the tracking mode (or wrapper subclasses of them, flattened by
  ``__tensor_flatten__``), its other arguments plain values (numbers, strings, dtypes, devices, enum members,
  classes, aten ops, and tuples, lists, dicts and frozen dataclasses of them): the key is made of these (a tensor's
  sizes, strides, dtype, offset, storage size, device, requires_grad; a constant fake tensor's value too, for a
  plain function only, and only while the call leaves it a constant), plus the tracker's label, the grad mode and
  the function modes on the stack;
- the tracking mode is the only dispatch mode (no selective-checkpointing or other mode that records ops), the
  tracker records (not ignoring, not inside another op), not under inference mode, not while Dynamo compiles,
  and autograd records no graph (grad mode off, or no argument requires grad);
- the first call left no event on a storage made before it (nothing freed or resized: a storage's role changes
  only through autograd's pack hooks, which need a graph being recorded, or through the step's own code between
  ops), left every other record of the trace as it was (phase marks, notes, stream marks, ...; FLOPs only under
  the running module), and returned one tensor, plain or a wrapper subclass, whose storages it made whole and did
  not free (or returned None), every other storage it made freed before it returned.

What it saves and costs (benchmarks/fp8-trace-speed.md): a replayed torchao cast costs about 40 us against 400 us
run (the key about 6 us, the replay about 35: two fake outputs made and registered, the records appended).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.overrides import _get_current_function_mode_stack

from memest.trace.events import StorageRecord
from memest.trace.tracker import META, TrackingFakeMode, _new_fake, _plain_fake

_LEAF_KINDS = {type(None): True, str: True, torch.dtype: True, torch.device: True, bool: False, int: False,
               float: False}


class _Ineligible(Exception):
    """The call cannot be keyed: it runs."""


@dataclass(frozen=True)
class _Slot:
    """A plain tensor of the output, owning a storage of its own: what a fresh fake tensor needs."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device


@dataclass(frozen=True)
class Template:
    """One recorded call: its new storages (``records``, by position), its events over them in order (position,
    delta), which positions hold the output's storages (``outputs``: position -> slot), how to rebuild the output
    from its slots (``structure``: ("plain", slot), ("wrapper", class, inner names, context, outer size, outer stride,
    slots), ("none",), ("sequence", type, structures)), the FLOPs it added under the running module (None: it added
    no FLOP entry), its kernels' workspace ranges, and for an autograd Function's forward what it did to its
    ``ctx`` (``ctx``: the positions of the arguments it saved for backward, and each attribute it set with the
    position of the argument it is, or its plain value), and the values it left in the constant fake tensors among its
    arguments (``constants``, in the order the key met them)."""

    records: tuple[tuple, ...]  # (nbytes, category, op, saved_for_backward, host, saved_copy)
    events: tuple[tuple[int, int], ...]
    outputs: dict[int, int]
    slots: tuple[_Slot, ...]
    structure: tuple
    flops: int | None
    workspaces: dict[int, tuple]
    ctx: tuple | None = None
    constants: tuple = ()  # the values the call left in the constant fake tensors among its arguments, key order


class Replays:
    """The templates of one trace (they hold the running trace's kernel rules and target): ``wrap(fn)`` gives the
    replaying version of ``fn``; ``calls`` / ``replayed`` count the calls that reached it and those replayed."""

    def __init__(self) -> None:
        self.templates: dict = {}
        self.failed: set = set()  # keys whose recorded call a template cannot repeat
        self.calls = 0
        self.replayed = 0
        self._known: dict[int, tuple] = {}  # id -> (immutable argument value, its key): Replays._value_key
        self._tensors = 0
        self._constants: list[FakeTensor] = []  # the constant fake tensors met by the key being made
        # type -> True (a value keyed by itself: None, strings, dtypes, devices, and the classes of the enum members,
        # classes and ops met) or False (a number: 1, True and 1.0 are equal keys, so its type is part of it)
        self._leaf_kinds: dict[type, bool] = dict(_LEAF_KINDS)

    def wrap(self, fn: Callable, name: str) -> Callable:
        @functools.wraps(fn)
        def replaying(*args, **kwargs):
            if torch.compiler.is_compiling():  # Dynamo tracing a model file that compiles itself: torchao's own code
                return fn(*args, **kwargs)
            self.calls += 1
            # the key and the replay ask tensors for metadata and make fake tensors: below the function modes (the
            # traced device's, trace/devices.py, would see every tensor method called here)
            with torch._C.DisableTorchFunction():
                mode, key, template, constants = self._lookup(fn, name, args, kwargs, constants_ok=True)
                if template is not None:
                    self.replayed += 1
                    out = _replay(mode, template)
                    _set_constants(constants, template.constants)
                    return out
            if key is None:
                return fn(*args, **kwargs)
            return self._recorded(mode, key, lambda: fn(*args, **kwargs), constants=constants)

        replaying.__wrapped__ = fn
        return replaying

    def wrap_forward(self, fn: Callable, name: str) -> Callable:
        """An autograd Function's ``forward(ctx, *args)``, replayed with what it does to ``ctx``: the arguments it
        saves for backward saved again (autograd packs them after forward, as for the call itself) and the
        attributes it sets set again; the key is kept on ``ctx`` for the backward's."""

        @functools.wraps(fn)
        def forward(ctx, *args, **kwargs):
            if torch.compiler.is_compiling():
                return fn(ctx, *args, **kwargs)
            self.calls += 1
            with torch._C.DisableTorchFunction():
                mode, key, template, _ = self._lookup(fn, name, args, kwargs)
                if template is not None:
                    self.replayed += 1
                    _redo_ctx(ctx, template.ctx, args)
                    setattr(ctx, _CTX_KEY, key)
                    return _replay(mode, template)
            if key is None:
                return fn(ctx, *args, **kwargs)
            effects: list = []
            out = self._recorded(mode, key, lambda: _with_ctx_recorded(fn, ctx, args, kwargs, effects),
                                 plain=lambda: fn(ctx, *args, **kwargs),
                                 complete=lambda t: None if effects[0] is None else dataclasses.replace(t, ctx=effects[0]))
            setattr(ctx, _CTX_KEY, key)
            return out

        forward.__wrapped__ = fn
        return forward

    def wrap_backward(self, fn: Callable, name: str) -> Callable:
        """An autograd Function's ``backward(ctx, *grads)``, keyed by its forward's key (what it saved and set on
        ``ctx``), the gradients and ``ctx.needs_input_grad``; replayed only where autograd's node itself holds every
        saved tensor (what the pack hook returned is a tensor: memest's own hook, not checkpointing's handle nor an
        offloaded copy), so that the backward's body cannot free one by dropping it (a checkpointed block's
        recomputed tensors are held by the body alone once unpacked). A replay reads ``ctx.saved_tensors``, as the
        backward itself does first (the unpack hooks run)."""

        @functools.wraps(fn)
        def backward(ctx, *grads):
            if torch.compiler.is_compiling():
                return fn(ctx, *grads)
            self.calls += 1
            forward_key = getattr(ctx, _CTX_KEY, None)
            if forward_key is not None and not all(isinstance(r.data, torch.Tensor) for r in ctx._raw_saved_tensors):
                forward_key = None  # saved tensors the node does not hold (checkpointing, offloading): it runs
            key = None
            with torch._C.DisableTorchFunction():
                template = None
                if forward_key is not None:
                    mode, key, template, _ = self._lookup(fn, name, grads, {},
                                                          (forward_key, tuple(ctx.needs_input_grad)))
                if template is not None:
                    self.replayed += 1
                    ctx.saved_tensors  # noqa: B018 (the unpack hooks run, as in the backward's first line)
                    return _replay(mode, template)
            if key is None:
                return fn(ctx, *grads)
            return self._recorded(mode, key, lambda: fn(ctx, *grads))

        backward.__wrapped__ = fn
        return backward

    def _recorded(self, mode, key, call: Callable, plain: Callable | None = None,
                  complete: Callable = lambda template: template, constants: tuple = ()):
        """``call()``'s output, its part of the trace kept as ``key``'s template (``complete(template)``: the
        template as stored, with the values the call left in ``constants``; None where it cannot be repeated: the
        key then fails); for a key that failed before, ``plain()`` (``call`` by default) simply runs."""
        if key in self.failed:
            return (plain or call)()
        out, template = _record(mode, call)
        template = None if template is None else complete(template)
        if template is not None and constants:
            after = _constant_values(constants)
            template = None if after is None else dataclasses.replace(template, constants=after)
        if template is None:
            self.failed.add(key)
        else:
            self.templates[key] = template
        return out

    def _lookup(self, fn, name, args, kwargs, more: tuple = (), constants_ok: bool = False) -> tuple:
        """(mode, key, its template or None, the constant fake tensors among the arguments in key order), or
        (None, None, None, ()) for a call that simply runs: not eligible (``_key``; constant fake tensors only where
        ``constants_ok``), or arguments a key cannot be made of (an unhashable value where a plain one was expected):
        a replay is only ever a shortcut."""
        try:
            mode, key = self._key(fn, name, args, kwargs)
            if self._constants and not constants_ok:
                raise _Ineligible
            key = (key, *more) if more else key
            return mode, key, self.templates.get(key), tuple(self._constants)
        except (_Ineligible, TypeError):
            return None, None, None, ()
        finally:
            self._constants = []  # holds no fake tensor past the key (the tracker sees a storage freed when its last
            # tensor goes)

    def _key(self, fn, name, args, kwargs):
        mode = tracking_mode(1)
        if mode is None or torch.is_inference_mode_enabled():
            raise _Ineligible
        grad = torch.is_grad_enabled()
        functions = (tuple(type(m) for m in _get_current_function_mode_stack())
                     if torch._C._len_torch_function_stack() else ())
        key = (name, self._value_key(args, mode, grad), self._value_key(kwargs, mode, grad), mode.tracker.label, grad,
               functions)
        return mode, key

    def _value_key(self, a, mode: TrackingFakeMode, grad: bool):
        """A hashable key of an argument's metadata; raises :class:`_Ineligible` for anything else. The key of an
        immutable value without tensors (a tuple, a frozen dataclass: torchao's configs, the same objects call after
        call) is kept by identity, the value held so its id stays its own (``_tensors`` counts the tensors met)."""
        kind = type(a)
        if kind is FakeTensor:
            if a.constant is not None:
                return self._constant_key(a, mode, grad)
            if not _plain_fake(a, mode) or a.is_conj() or a.is_neg() or (grad and a.requires_grad):
                raise _Ineligible
            self._tensors += 1
            return (a.shape, a.stride(), a.dtype, a.storage_offset(), a.untyped_storage().nbytes(), a.requires_grad,
                    a.fake_device)
        leaf = self._leaf_kinds.get(kind)
        if leaf is not None:
            return a if leaf else (kind, a)
        known = self._known.get(id(a))
        if known is not None and known[0] is a:
            return known[1]
        if isinstance(a, (type, enum.Enum, torch._ops.OpOverload)):  # classes, members, ops: keyed by themselves
            self._leaf_kinds[kind] = True
            return a
        tensors = self._tensors
        if isinstance(a, torch.Tensor):
            flatten = getattr(a, "__tensor_flatten__", None)
            if flatten is None or (grad and a.requires_grad) or a.grad_fn is not None:
                raise _Ineligible
            self._tensors += 1
            names, ctx = flatten()
            ctx = (self._items_key(ctx.items(), mode, grad) if type(ctx) is dict else self._value_key(ctx, mode, grad))
            return (kind, tuple(names), ctx, a.shape, a.stride(), a.requires_grad,
                    tuple(self._value_key(getattr(a, n), mode, grad) for n in names))
        if isinstance(a, (tuple, list)):
            key = (kind, *self._values_key(a, mode, grad))
        elif kind is dict:
            return (dict, *self._items_key(a.items(), mode, grad))  # mutable: not kept
        elif getattr(kind, "__dataclass_params__", None) is not None and kind.__dataclass_params__.frozen:
            key = (kind, *self._values_key([getattr(a, f.name) for f in dataclasses.fields(a)], mode, grad))
        else:
            raise _Ineligible
        if self._tensors == tensors and kind is not list:
            self._known[id(a)] = (a, key)
        return key

    def _constant_key(self, a: FakeTensor, mode: TrackingFakeMode, grad: bool) -> tuple:
        """A small constant fake tensor (torch.optim's ``state_steps``: ``torch.tensor(0.0)``, whose value FakeTensorMode
        keeps and an update changes in place): keyed by its metadata and its value, which a replay then sets to the
        value the recorded call left (the same value before, the same ops: the same value after)."""
        if (a.fake_mode is not mode or a.layout != torch.strided or a._has_symbolic_sizes_strides
                or a.numel() > MAX_CONSTANT_NUMEL or (grad and a.requires_grad)):
            raise _Ineligible
        self._tensors += 1
        self._constants.append(a)
        with torch._C._DisableTorchDispatch():
            values = tuple(a.constant.flatten().tolist())
        return ("constant", a.shape, a.stride(), a.dtype, a.storage_offset(), a.fake_device, values)

    def _values_key(self, values, mode: TrackingFakeMode, grad: bool) -> list:
        """The keys of ``values``, plain ones made here (one call less each: most arguments are plain)."""
        keys = []
        leaf_kinds = self._leaf_kinds
        for v in values:
            leaf = leaf_kinds.get(type(v))
            keys.append(self._value_key(v, mode, grad) if leaf is None else v if leaf else (type(v), v))
        return keys

    def _items_key(self, items, mode: TrackingFakeMode, grad: bool) -> tuple:
        keys, values = zip(*items, strict=True) if items else ((), ())
        return tuple(zip(keys, self._values_key(values, mode, grad), strict=True))


# a constant argument is keyed by its values: FakeTensorMode keeps constants of one element (CONSTANT_NUMEL_LIMIT,
# torch 2.13 torch/_subclasses/fake_tensor.py: torch.tensor(0.0), a step counter); a larger one is not replayed
MAX_CONSTANT_NUMEL = 16


def _constant_values(constants: tuple) -> tuple | None:
    """What ``constants`` hold now (copies), or None where the call left one without its value (FakeTensorMode drops
    a constant an op wrote with a non-constant)."""
    with torch._C._DisableTorchDispatch():
        if any(c.constant is None for c in constants):
            return None
        return tuple(c.constant.clone() for c in constants)


def _set_constants(constants: tuple, values: tuple) -> None:
    """Each constant fake tensor given the value the recorded call left in it."""
    with torch._C._DisableTorchDispatch():
        for c, value in zip(constants, values, strict=True):
            c.constant.copy_(value)


def tracking_mode(depth: int) -> TrackingFakeMode | None:
    """The tracking mode at the bottom of a dispatch stack ``depth`` modes deep, recording (not ignoring, not inside
    another op; no symbolic shapes, no real-tensor propagation); else None."""
    if torch._C._len_torch_dispatch_stack() != depth:
        return None
    mode = torch._C._get_dispatch_stack_at(0)
    if not isinstance(mode, TrackingFakeMode) or mode.tracker is None or mode._inside or mode.tracker.ignoring:
        return None
    if mode.shape_env is not None or mode.propagate_real_tensors:
        return None
    return mode


def side_state(tracker) -> tuple:
    """Everything a call may change in the trace or the tracker besides its own storages, events and FLOPs."""
    trace = tracker.trace
    return (len(trace.phase_marks), len(trace.notes), len(trace.stream_marks), len(trace.empty_caches),
            len(trace.held_outputs), len(trace.host_events), len(trace.load_events), len(trace.owner_module),
            tuple(trace.bounded_ops.items()), tuple(trace.attention_backends.items()), len(trace.uncounted_flop_ops),
            len(trace.modules), tracker.phase, tracker.iteration, tracker.label, len(tracker._lineage))


def _record(mode: TrackingFakeMode, call: Callable):
    """Run ``call()`` and read its part of the trace: (its output, a Template or None where it cannot be repeated)."""
    tracker = mode.tracker
    trace = tracker.trace
    first_storage, first_event = len(trace.storages), len(trace.events)
    side = side_state(tracker)
    where = (tracker.module_of(), tracker.phase, tracker.iteration, tracker.stream())
    flop_key = (tracker.iteration, tracker.phase, where[0])
    flops_before = (len(trace.flops), trace.flops.get(flop_key))
    out = call()
    try:
        return out, _template(mode, out, first_storage, first_event, side, where, flop_key, flops_before)
    except _Ineligible:
        return out, None


def _template(mode, out, first_storage, first_event, side, where, flop_key, flops_before) -> Template:
    tracker = mode.tracker
    trace = tracker.trace
    if side_state(tracker) != side or tracker.module_of() != where[0] or tracker.stream() != where[3]:
        raise _Ineligible
    # FLOPs are counted under (iteration, phase, running module), all three unchanged through the call: only its key
    # can have been added or grown
    count, before = flops_before
    after = trace.flops.get(flop_key)
    if len(trace.flops) != count + (before is None and after is not None):
        raise _Ineligible
    flops = None if after == before else after - (before or 0)
    new = trace.storages[first_storage:]
    if any((r.module, r.phase, r.iteration, r.stream) != where for r in new):
        raise _Ineligible
    events, freed = _events(trace.events[first_event:], new, first_storage)
    outputs: dict[int, int] = {}
    slots: list[_Slot] = []
    structure = _output(mode, out, first_storage, freed, outputs, slots)
    if set(range(len(new))) - freed - set(outputs):
        raise _Ineligible  # a storage made here that outlives the call without being its output
    records = tuple((r.nbytes, r.category, r.op, r.saved_for_backward, r.host, r.saved_copy) for r in new)
    workspaces = {sid - first_storage: v for sid, v in trace.workspace_ranges.items() if sid >= first_storage}
    return Template(records, events, outputs, tuple(slots), structure, flops, workspaces)


def _events(events: list, new: list, first_storage: int) -> tuple[tuple, set[int]]:
    """The call's events by position among its new storages, and the positions it freed: each storage made once,
    in order, and freed at most once; none made before the call touched."""
    relative = []
    allocated = 0
    freed: set[int] = set()
    for sid, delta in events:
        rel = sid - first_storage
        if rel < 0:
            raise _Ineligible  # a storage made before the call changed during it
        if delta > 0:
            if rel != allocated or delta != new[rel].nbytes:
                raise _Ineligible
            allocated += 1
        elif rel >= allocated or rel in freed or -delta != new[rel].nbytes:
            raise _Ineligible
        else:
            freed.add(rel)
        relative.append((rel, delta))
    if allocated != len(new):
        raise _Ineligible
    return tuple(relative), freed


def _output(mode, out, first_storage: int, freed: set[int], outputs: dict[int, int], slots: list) -> tuple:
    """The structure of ``out`` (Template.structure), its plain tensors added to ``slots`` and their storages'
    positions to ``outputs``: a tensor, plain or a wrapper subclass of plain fake tensors, None, or a tuple or list
    of them (a backward's gradients); each tensor owning a whole storage made by the call and not freed by it."""
    if out is None:
        return ("none",)
    if type(out) in (tuple, list):
        return ("sequence", type(out), tuple(_output(mode, o, first_storage, freed, outputs, slots) for o in out))
    if type(out) is FakeTensor:
        return ("plain", _slot(mode, out, first_storage, freed, outputs, slots))
    if isinstance(out, torch.Tensor) and hasattr(out, "__tensor_flatten__"):
        names, ctx = out.__tensor_flatten__()
        inner = [getattr(out, n) for n in names]
        if out.requires_grad or any(type(t) is not FakeTensor for t in inner):
            raise _Ineligible
        return ("wrapper", type(out), tuple(names), ctx, tuple(out.shape), tuple(out.stride()),
                tuple(_slot(mode, t, first_storage, freed, outputs, slots) for t in inner))
    raise _Ineligible


def _slot(mode, t, first_storage: int, freed: set[int], outputs: dict[int, int], slots: list) -> int:
    if not _plain_fake(t, mode) or t.requires_grad or t.grad_fn is not None:
        raise _Ineligible
    sid = mode.tracker.storage_id(t)
    nbytes = t.untyped_storage().nbytes()
    if t.storage_offset() or nbytes != _strided_nbytes(t) or (nbytes and (sid is None or sid < first_storage)):
        raise _Ineligible  # a view (of an argument, or into a larger storage), or a storage not made here
    if sid is not None:
        rel = sid - first_storage
        if rel in freed or rel in outputs:
            raise _Ineligible
        outputs[rel] = len(slots)
    slots.append(_Slot(tuple(t.shape), tuple(t.stride()), t.dtype, t.fake_device))
    return len(slots) - 1


def _strided_nbytes(t: torch.Tensor) -> int:
    """The bytes of a fresh ``empty_strided`` of ``t``'s sizes and strides (offset 0)."""
    if t.numel() == 0:
        return 0
    return (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))) * t.element_size()


def _fresh(mode: TrackingFakeMode, slots: tuple[_Slot, ...]) -> list[FakeTensor]:
    """New fake tensors of ``slots``, made as FakeTensorMode's cache makes an op's output (a meta tensor in a
    FakeTensor: tracker.py ``_get_output_tensor_from_cache_entry``)."""
    with torch._C._DisableTorchDispatch():
        metas = [torch.empty_strided(s.shape, s.stride, dtype=s.dtype, device=META) for s in slots]
    return [_new_fake(mode, meta, s.device) for meta, s in zip(metas, slots, strict=True)]


def _replay(mode: TrackingFakeMode, template: Template):
    """The recorded call's records and events appended anew, and a fresh output of its metadata (run below the
    function modes: ``Replays.wrap``)."""
    tracker = mode.tracker
    trace = tracker.trace
    inner = _fresh(mode, template.slots)
    first = len(trace.storages)
    module, phase, iteration, stream = tracker.module_of(), tracker.phase, tracker.iteration, tracker.stream()
    storages, events, records, outputs = trace.storages, trace.events, template.records, template.outputs
    for rel, delta in template.events:
        if delta < 0:
            events.append((first + rel, delta))
            continue
        nbytes, category, op, saved, host, saved_copy = records[rel]
        slot = outputs.get(rel)
        if slot is not None:
            tracker.register(inner[slot], category, op)
        else:
            storages.append(StorageRecord(nbytes, category, module, phase, op, iteration, saved, host, saved_copy,
                                          stream))
            events.append((first + rel, delta))
    for rel, value in template.workspaces.items():
        trace.workspace_ranges[first + rel] = value
    if template.flops is not None:
        key = (iteration, phase, module)
        trace.flops[key] = trace.flops.get(key, 0) + template.flops
    return _build(template.structure, inner)


def _build(structure: tuple, inner: list):
    """The output of Template.structure from the fresh tensors of its slots."""
    kind = structure[0]
    if kind == "plain":
        return inner[structure[1]]
    if kind == "wrapper":
        _, cls, names, ctx, size, stride, positions = structure
        return cls.__tensor_unflatten__({n: inner[i] for n, i in zip(names, positions, strict=True)}, ctx, size, stride)
    if kind == "none":
        return None
    return structure[1](_build(s, inner) for s in structure[2])


_CTX_KEY = "_memest_replay_key"  # an autograd Function's ctx: its forward's key (Replays.wrap_forward)
_CTX_CALLS = ("mark_dirty", "mark_non_differentiable", "set_materialize_grads", "save_for_forward")


def _with_ctx_recorded(fn, ctx, args, kwargs, effects: list):
    """``fn(ctx, *args, **kwargs)`` with what it does to ``ctx`` put in ``effects[0]``: (positions of the saved
    arguments, ((attribute, ("argument", position) or ("value", value)), ...)), or None where a replay could not do
    the same (a tensor saved that is not an argument, an attribute that is neither an argument nor a plain value,
    any other ctx call)."""
    saved: list = []
    others: list = []
    before = set(vars(ctx))
    ctx.save_for_backward = lambda *tensors: (saved.append(tensors), type(ctx).save_for_backward(ctx, *tensors))
    for call in _CTX_CALLS:
        setattr(ctx, call, functools.partial(_other_call, others, getattr(type(ctx), call), ctx))
    try:
        out = fn(ctx, *args, **kwargs)
    finally:
        for attr in ("save_for_backward", *_CTX_CALLS):
            delattr(ctx, attr)
    effects.append(_ctx_effects(ctx, args, saved, others, before))
    return out


def _other_call(others: list, method, ctx, *a, **k):
    others.append(method)
    return method(ctx, *a, **k)


def _ctx_effects(ctx, args, saved: list, others: list, before: set) -> tuple | None:
    if others or len(saved) > 1:
        return None
    positions = []
    for t in saved[0] if saved else ():
        position = next((i for i, a in enumerate(args) if a is t), None)
        if position is None:
            return None
        positions.append(position)
    attrs = []
    for name in sorted(set(vars(ctx)) - before):
        value = getattr(ctx, name)
        position = next((i for i, a in enumerate(args) if a is value), None)
        if position is not None:
            attrs.append((name, ("argument", position)))
        elif type(value) in _LEAF_KINDS or isinstance(value, enum.Enum):
            attrs.append((name, ("value", value)))
        else:
            return None
    return tuple(positions), tuple(attrs)


def _redo_ctx(ctx, effects: tuple, args) -> None:
    positions, attrs = effects
    ctx.save_for_backward(*(args[i] for i in positions))
    for name, (kind, value) in attrs:
        setattr(ctx, name, args[value] if kind == "argument" else value)


@contextlib.contextmanager
def replaying(replays: Replays, patches: list[tuple[object, object, str]]) -> Iterator[Replays]:
    """While entered, each ``(holder, name, label)`` is replaced by its replaying version: ``holder`` a module (an
    attribute ``name``), a class (a static method ``name``; an autograd Function's ``forward`` and ``backward`` with
    what they do to ``ctx``) or a dict (an entry ``name``). Always restored."""
    undo = []
    try:
        for holder, name, label in patches:
            if isinstance(holder, dict):
                fn = holder[name]
                holder[name] = replays.wrap(fn, label)
                undo.append(functools.partial(holder.__setitem__, name, fn))
            elif isinstance(holder, type) and isinstance(holder.__dict__.get(name), staticmethod):
                raw = holder.__dict__[name]
                wrap = replays.wrap
                if issubclass(holder, torch.autograd.Function) and name in ("forward", "backward"):
                    wrap = replays.wrap_forward if name == "forward" else replays.wrap_backward
                setattr(holder, name, staticmethod(wrap(raw.__func__, label)))
                undo.append(functools.partial(setattr, holder, name, raw))
            else:
                fn = getattr(holder, name)
                setattr(holder, name, replays.wrap(fn, label))
                undo.append(functools.partial(setattr, holder, name, fn))
        yield replays
    finally:
        for restore in reversed(undo):
            restore()

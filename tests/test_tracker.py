"""The tracker's shortcuts (trace/tracker.py) record what the fake mode's full dispatch records, field for field:
``StorageTracker.empty_like`` against ``torch.empty_like`` dispatched into the mode, and the metadata queries
(``prim.device``, sizes, strides) that ``TrackingFakeMode`` answers before the tracker against FakeTensorMode's own
answer, TrackingFakeMode's dispatch cache key and output rebuilt from the cache against FakeTensorMode's, and its
answers to aten.contiguous and to ops on unrecognised tensor subclasses against torch's path. The
whole-trace check (every StorageRecord, event, FLOP count of 13 steps unchanged by these shortcuts:
scripts/trace_digest.py) is in benchmarks/trace-speed.md."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from memest.trace.events import Trace
from memest.trace.tracker import StorageTracker, TrackerRules, TrackingFakeMode

LAYOUTS = {
    "contiguous": lambda x: x,
    "transposed": lambda x: x[0].t(),
    "strided slice": lambda x: x[:, ::2],
    "permuted": lambda x: x.permute(2, 0, 1),
    "expanded": lambda x: x[:1].expand(3, 64, 128),
    "offset view": lambda x: x[1:2, 3:5],
    "channels_last": lambda x: x.reshape(2, 4, 16, 128).to(memory_format=torch.channels_last),
    "size-1 dims": lambda x: x[:1, :1],
    "4-d, contiguous and channels_last": lambda x: x.reshape(2, 1, 64, 128),
    "4-d, size-1 spatial": lambda x: x.reshape(2, 8192, 1, 1)[:, ::2],
    "4-d, empty": lambda x: x.reshape(2, 4, 16, 128)[:, :, :0],
    "5-d": lambda x: x.reshape(2, 2, 2, 16, 128),
    "1-d strided": lambda x: x.flatten()[::3],
    "empty": lambda x: x[:0],
    "bf16": lambda x: x.to(torch.bfloat16),
    "scalar": lambda x: x.sum(),
}


def _facts(t: torch.Tensor) -> tuple:
    return (type(t), t.shape, t.stride(), t.storage_offset(), t.dtype, t.device, t.requires_grad, t.is_contiguous(),
            t.untyped_storage().nbytes())


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("label", [None, "FSDP all-gather"])
def test_empty_like_records_what_the_dispatched_op_records(layout, label):
    mode = TrackingFakeMode()
    with mode:
        base = torch.randn(2, 64, 128, requires_grad=True)
        t = LAYOUTS[layout](base)
        traces = []
        outs = []
        for make in (torch.empty_like, None):
            trace = Trace()
            tracker = StorageTracker(trace, lambda: "block.0", mode)
            with tracker:
                tracker.label = label
                outs.append(make(t) if make is not None else tracker.empty_like(t))
            traces.append(trace)
    dispatched, direct = outs
    assert isinstance(direct, FakeTensor)
    assert _facts(direct) == _facts(dispatched)
    assert [dataclasses.asdict(r) for r in traces[1].storages] == [dataclasses.asdict(r) for r in traces[0].storages]
    assert traces[1].events == traces[0].events
    assert traces[1].flops == traces[0].flops


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_made_like_records_what_a_copy_to_the_same_device_records(layout):
    """``StorageTracker.made_like(t, aten._to_copy)``, the host copy and the copy back of save_on_cpu's hooks on a
    modelled GPU (features/activation_offload.py ``_DeviceMoves``), against ``t.to("cpu", copy=True)`` dispatched;
    ``made_empty`` against the pinned variant's ``torch.empty(size, dtype=, layout=, pin_memory=False)``."""
    mode = TrackingFakeMode()
    with mode, torch.no_grad():
        t = LAYOUTS[layout](torch.randn(2, 64, 128))
        traces, outs = [], []
        for direct in (False, True):
            trace = Trace()
            tracker = StorageTracker(trace, lambda: "block.0", mode)
            with tracker:
                if direct:
                    outs.append((tracker.made_like(t, torch.ops.aten._to_copy.default),
                                 tracker.made_empty(t.size(), t.dtype)))
                else:
                    outs.append((t.to("cpu", copy=True),
                                 torch.empty(t.size(), dtype=t.dtype, layout=t.layout, pin_memory=False)))
            traces.append(trace)
    for dispatched, made in zip(*outs, strict=True):
        assert isinstance(made, FakeTensor) and _facts(made) == _facts(dispatched)
    assert [dataclasses.asdict(r) for r in traces[1].storages] == [dataclasses.asdict(r) for r in traces[0].storages]
    assert traces[1].events == traces[0].events


def test_empty_like_outside_a_tracked_step_is_the_op():
    """Not entered (no step is tracked): the op itself, recorded by nobody."""
    mode = TrackingFakeMode()
    with mode:
        t = torch.randn(4, 8)
        tracker = StorageTracker(Trace(), lambda: "", mode)
        out = tracker.empty_like(t)
    assert _facts(out) == _facts(t.new_empty(4, 8).detach())
    assert tracker.trace.storages == []


def test_metadata_queries_answered_as_the_fake_mode_answers_them():
    """prim.device and sizes / strides: TrackingFakeMode's answer equals FakeTensorMode's and the tracker never sees
    the query (nothing to record: no allocation, no FLOPs)."""
    seen: list = []

    class Watching(StorageTracker):
        def dispatch(self, func, types, args, kwargs, run):
            seen.append(func)
            return super().dispatch(func, types, args, kwargs, run)

    queries = [torch.ops.prim.device.default, torch.ops.aten.size.default, torch.ops.aten.stride.default,
               torch.ops.aten.storage_offset.default]
    answers = []
    for mode in (FakeTensorMode(), TrackingFakeMode()):
        with mode:
            t = torch.randn(3, 5)[:, 1:]
            with Watching(Trace(), lambda: "", mode) if isinstance(mode, TrackingFakeMode) else contextlib.nullcontext():
                answers.append([q(t) for q in queries])
                t + 1  # an op the tracker sees
    assert answers[1] == answers[0] == [torch.device("cpu"), [3, 4], [5, 1], 1]
    assert not [f for f in seen if f in queries]
    assert seen == [torch.ops.aten.add.Tensor]


def test_record_function_ops_run_as_the_fake_mode_runs_them():
    """torch.profiler.record_function's enter and exit ops (torch.optim's step and zero_grad, FSDP2's collectives):
    the same profiler object as FakeTensorMode's answer, and nothing recorded (no tensor in or out)."""
    seen: list = []

    class Watching(StorageTracker):
        def dispatch(self, func, types, args, kwargs, run):
            seen.append(func)
            return super().dispatch(func, types, args, kwargs, run)

    enter = torch.ops.profiler._record_function_enter_new.default
    made = []
    for mode in (FakeTensorMode(), TrackingFakeMode()):
        trace = Trace()
        with mode:
            t = torch.randn(3, 5)
            with Watching(trace, lambda: "", mode) if isinstance(mode, TrackingFakeMode) else contextlib.nullcontext():
                handle = enter("memest", None)
                with torch.profiler.record_function("memest"):
                    t + 1
                torch.ops.profiler._record_function_exit._RecordFunction(handle)
        made.append((type(handle), handle._type().qualified_name()))
    assert made[0] == made[1] == (torch.ScriptObject, "__torch__.torch.classes.profiler._RecordFunction")
    assert seen == [torch.ops.aten.add.Tensor]
    assert len(trace.storages) == 1 and trace.storages[0].op == "add.Tensor"


def _key(prep, mode, args) -> tuple[list, str | None]:
    """The cache-key values ``prep`` appends for ``args`` (or the bypass it raises)."""
    from torch._subclasses.fake_tensor import _CacheKeyState

    result: list = []
    try:
        prep(mode, result, args, _CacheKeyState(None), [])
    except Exception as exc:  # torch's _BypassDispatchCache: the same reason from both
        return result, repr(exc)
    return result, None


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_cache_key_is_the_fake_modes(layout):
    """TrackingFakeMode._prep_args_for_hash appends the values FakeTensorMode's does, of the same types (1 and 1.0,
    True and 1 differ only by type), for a fake tensor of every layout with the argument kinds ops take (numbers,
    None, lists, tuples, a dict of kwargs, dtypes, devices, a memory format), plus requires_grad, inference, float8,
    conjugate and constant tensors."""
    mode = TrackingFakeMode()
    with mode:
        t = LAYOUTS[layout](torch.randn(2, 64, 128, requires_grad=True))
        others = [t.detach().to(torch.float8_e4m3fn), torch.randn(2, 2, dtype=torch.complex64).conj(),
                  torch.tensor(2.0)]  # the last holds a constant: torch bypasses its cache
        with torch.inference_mode():
            others.append(torch.randn(3, 3))
    for arg in (t, *others):
        args = (arg, 1, 1.0, True, None, [1, 2], (3, (4,)), {"dim": 1, "keepdim": False}, torch.float16,
                torch.device("cpu"), "name", torch.channels_last, torch.strided)
        fast, torchs = _key(TrackingFakeMode._prep_args_for_hash, mode, args), _key(
            FakeTensorMode._prep_args_for_hash, mode, args)
        assert fast == torchs
        assert [type(v) for v in fast[0]] == [type(v) for v in torchs[0]]


OPS = {
    "mul": lambda x, w: x * 2,
    "t (view)": lambda x, w: x.t(),
    "view": lambda x, w: x.view(4, 16),
    "offset slice (view)": lambda x, w: x[1:],
    "detach (view)": lambda x, w: x.detach(),
    "mm": lambda x, w: x @ w,
    "max.dim (two outputs)": lambda x, w: torch.max(x, 1),
    "amax": lambda x, w: x.abs().max(),
    "float8 cast": lambda x, w: w.to(torch.float8_e4m3fn),
    "clamp reciprocal": lambda x, w: w.clamp(min=1e-12).reciprocal(),
    "channels_last add": lambda x, w: x.reshape(2, 2, 2, 8).to(memory_format=torch.channels_last) + 1,
    "split (views)": lambda x, w: torch.split(w, 4, 1),
    "in-place": lambda x, w: w.detach().mul_(2),
}


def _output_facts(out) -> list:
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return [(*_facts(t), t.is_leaf, t.is_inference(), str(torch._C._dispatch_keys(t)),
             sorted((k, repr(v)) for k, v in t.__dict__.items())) for t in outs]


@pytest.mark.parametrize("op", sorted(OPS))
def test_cached_output_is_the_fake_modes(op):
    """An op's output rebuilt from FakeTensorMode's cache by TrackingFakeMode (its own
    _get_output_tensor_from_cache_entry and fake-tensor constructor) equals torch's rebuild: type, sizes, strides,
    offset, dtype, device, requires_grad, leaf, dispatch keys, every attribute of the FakeTensor; a view's output
    holds its input's storage."""
    mode = TrackingFakeMode()
    outs = []
    with mode:
        x = torch.randn(8, 8, requires_grad=True)
        w = torch.randn(8, 16)
        OPS[op](x, w)  # fills the cache entry
        for rebuild in (FakeTensorMode._get_output_tensor_from_cache_entry, None):
            hits = FakeTensorMode.cache_hits
            with pytest.MonkeyPatch.context() as patch:
                if rebuild is not None:
                    patch.setattr(TrackingFakeMode, "_get_output_tensor_from_cache_entry", rebuild)
                outs.append(OPS[op](x, w))
            assert FakeTensorMode.cache_hits > hits  # rebuilt from the cache
    torchs, fast = outs
    assert _output_facts(fast) == _output_facts(torchs)
    inputs = {"x": x.untyped_storage()._cdata, "w": w.untyped_storage()._cdata}
    for a, b in zip(*(o if isinstance(o, tuple) else (o,) for o in outs), strict=True):
        assert [k for k, s in inputs.items() if a.untyped_storage()._cdata == s] == [
            k for k, s in inputs.items() if b.untyped_storage()._cdata == s]
        assert (a._base is None) == (b._base is None)


def _traced(mode: TrackingFakeMode, op, fast: bool, fast_path: str, result: bool):
    """``op()`` dispatched in a tracked step of ``mode``, with TrackingFakeMode's ``fast_path`` on, or forced to
    ``result`` (torch's own path); the output and the trace."""
    trace = Trace()
    with pytest.MonkeyPatch.context() as patch:
        if not fast:
            patch.setattr(TrackingFakeMode, fast_path, lambda self, *a: result)
        with StorageTracker(trace, lambda: "block.0", mode):
            out = op()
    return out, trace


def _same_trace(a: Trace, b: Trace) -> None:
    assert [dataclasses.asdict(r) for r in a.storages] == [dataclasses.asdict(r) for r in b.storages]
    assert a.events == b.events
    assert a.flops == b.flops


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_contiguous_is_the_fake_modes(layout):
    """aten.contiguous below autograd (as torchao's float8 mm calls it) answered by TrackingFakeMode (the input
    itself, or its clone) equals FakeTensorMode's decomposition: the same tensor object where the input is
    contiguous, else the same output facts and the same trace record."""
    mode = TrackingFakeMode()
    with mode:
        t = LAYOUTS[layout](torch.randn(2, 64, 128, requires_grad=True))
        assert mode._plain_contiguous((t,), {})

        def op():
            with torch._C._AutoDispatchBelowAutograd():
                return torch.ops.aten.contiguous.default(t)

        (torchs, torch_trace), (fast, fast_trace) = (
            _traced(mode, op, fast, "_plain_contiguous", False) for fast in (False, True))
    assert (fast is t) == (torchs is t)
    assert _output_facts(fast) == _output_facts(torchs)
    _same_trace(fast_trace, torch_trace)


def test_contiguous_of_other_formats_runs_the_op():
    """A memory format other than contiguous_format, or a tensor that is not this mode's plain fake tensor: the op."""
    mode = TrackingFakeMode()
    with mode:
        t = torch.randn(2, 4, 8, 8)
    assert not mode._plain_contiguous((t,), {"memory_format": torch.channels_last})
    assert not mode._plain_contiguous((torch.randn(2, 4),), {})
    assert not TrackingFakeMode()._plain_contiguous((t,), {})


def test_subclass_ops_declined_as_the_fake_mode_declines_them():
    """An op on a tensor subclass the fake mode does not know (torch's TwoTensor here; torchao's Float8TrainingTensor
    in an fp8 step) is answered NotImplemented before FakeTensorMode's cache key, so the subclass runs it on its
    inner fake tensors: the same outputs and the same trace as through torch's path; not for an op a kernel rule
    names."""
    from torch.testing._internal.two_tensor import TwoTensor

    mode = TrackingFakeMode()
    with mode:
        pair = TwoTensor(torch.randn(8, 16), torch.randn(8, 16))
        w = torch.randn(16, 4)
        assert mode._declines(torch.ops.aten.mm.default, (pair, w), {})
        assert not mode._declines(torch.ops.aten.mm.default, (w.t(), w), {})

        def op():
            return [pair.t(), pair.view(16, 8), pair @ w, pair * 2]

        (torchs, torch_trace), (fast, fast_trace) = (
            _traced(mode, op, fast, "_declines", False) for fast in (False, True))
        for a, b in zip(torchs, fast, strict=True):
            assert type(a) is type(b) is TwoTensor
            assert _output_facts([a.a, a.b]) == _output_facts([b.a, b.b])
        _same_trace(fast_trace, torch_trace)
        # the inner tensors' ops, two each (t's: the inputs' storages, made before the step, first seen there)
        assert [r.op for r in fast_trace.storages] == ["t.default"] * 2 + ["mm.default"] * 2 + ["mul.Tensor"] * 2
        ruled = StorageTracker(Trace(), lambda: "", mode, rules=[TrackerRules(scratch={torch.ops.aten.mm.default: None})])
        with ruled:
            assert not mode._declines(torch.ops.aten.mm.default, (pair, w), {})


DECOMPOSED = {  # each valid for every layout (scalars and empty tensors among them)
    "reshape": lambda t: torch.ops.aten.reshape.default(t, (-1,)),
    "flatten": lambda t: torch.ops.aten.flatten.using_ints(t, 0, -1),
    "unsafe_view": lambda t: torch.ops.aten._unsafe_view.default(t.contiguous(), (t.numel(),)),
}


@pytest.mark.parametrize("op_name", sorted(DECOMPOSED))
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_direct_decompositions_are_the_fake_modes(op_name, layout):
    """A view op with a CompositeImplicitAutograd kernel below autograd (torchao's MXFP8 mx_mm reshapes and flattens
    inside its autograd Function) and aten._unsafe_view, run by TrackingFakeMode's direct decomposition, equal
    FakeTensorMode's path (cache key, bypass, _dispatch_impl, the same decomposition): the same output facts, the
    same aliasing of the input, the same trace record."""
    mode = TrackingFakeMode()
    with mode:
        t = LAYOUTS[layout](torch.randn(2, 64, 128, requires_grad=True))
        func = DECOMPOSED[op_name]
        assert mode._direct_decomposition(torch.ops.aten.reshape.default, (t, (-1, 128)), {}) is not None

        def op():
            with torch._C._AutoDispatchBelowAutograd():
                return func(t)

        # warm: the decomposition's inner ops rebuilt from FakeTensorMode's cache in both runs (computed cold, a
        # view of an empty tensor gets a storage of its own; rebuilt, the input's: FakeTensorMode's own difference)
        op()
        (torchs, torch_trace), (fast, fast_trace) = (
            _traced(mode, op, fast, "_direct_decomposition", None) for fast in (False, True))
    assert _output_facts(fast) == _output_facts(torchs)
    assert (fast.untyped_storage()._cdata == t.untyped_storage()._cdata) == (
        torchs.untyped_storage()._cdata == t.untyped_storage()._cdata)
    _same_trace(fast_trace, torch_trace)


def test_direct_decomposition_only_for_plain_fake_tensors_and_those_ops():
    mode = TrackingFakeMode()
    with mode:
        t = torch.randn(4, 8)
    assert mode._direct_decomposition(torch.ops.aten.mm.default, (t, t.t()), {}) is None  # cached normally
    assert mode._direct_decomposition(torch.ops.aten.reshape.default, (torch.randn(4, 8), (32,)), {}) is None
    assert TrackingFakeMode()._direct_decomposition(torch.ops.aten.reshape.default, (t, (32,)), {}) is None
    assert mode._direct_decomposition(torch.ops.aten._unsafe_view.default, (t, (32,)), {}) is not None

"""The tracker's shortcuts (trace/tracker.py) record what the fake mode's full dispatch records, field for field:
``StorageTracker.empty_like`` against ``torch.empty_like`` dispatched into the mode, and the metadata queries
(``prim.device``, sizes, strides) that ``TrackingFakeMode`` answers before the tracker against FakeTensorMode's own
answer. The whole-trace check (every StorageRecord, event, FLOP count of 13 steps unchanged by these shortcuts:
scripts/trace_digest.py) is in benchmarks/trace-speed.md."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from memest.trace.events import Trace
from memest.trace.tracker import StorageTracker, TrackingFakeMode

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

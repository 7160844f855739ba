"""The StepFeature seam (features/base.py): a feature's hooks reach the traced step in order, the tracker takes
its rules at construction, and host memory holds only what a feature contributes."""

import contextlib
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from memest.features.base import StepFeature
from memest.features.registry import features_for
from memest.parallel import distributed
from memest.parallel.feature import ParallelFeature
from memest.sources.base import ModelSource
from memest.spec import RunSpec
from memest.targets.cpu.feature import CpuTarget
from memest.targets.cuda.feature import CudaTarget
from memest.trace.events import Category, Phase, StorageRecord, Trace
from memest.trace.step import trace_step
from memest.trace.tracker import StorageTracker, TrackerRules, TrackingFakeMode

aten = torch.ops.aten
SCRATCH = 1 << 20


def _mlp_source() -> ModelSource:
    def build():
        return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

    def inputs(batch, seq=None):
        return (torch.randn(batch, 16),)

    return ModelSource("mlp", build, inputs)


class Probe(StepFeature):
    """Every hook, recording that it ran."""

    name = "probe"

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.entered = 0
        self.grads: list[int] = []

    def session(self, spec):
        self.calls.append("session")
        return contextlib.nullcontext()

    def build(self, built, spec) -> None:
        self.calls.append("build")
        built.notes.append("probe built")

    def rules(self, step) -> TrackerRules:
        self.calls.append("rules")
        return TrackerRules(scratch={aten.addmm.default: lambda args, kwargs: [SCRATCH]})

    @contextlib.contextmanager
    def _scope(self):
        self.entered += 1
        try:
            yield
        finally:
            self.entered -= 1

    def contexts(self, step) -> list:
        self.calls.append("contexts")
        return [self._scope()]

    def after(self, step, phase) -> None:
        if phase is Phase.BACKWARD:
            self.grads.append(sum(p.grad is not None for p in step.params))

    def host(self, trace, spec) -> list[int]:
        return [sid for sid, rec in enumerate(trace.storages) if rec.category is Category.INPUTS]

    def finish(self, step) -> list[str]:
        self.calls.append("finish")
        return ["probe finished"]


def test_feature_hooks_reach_the_traced_step():
    spec = RunSpec(model="mlp", batch=4, target="cpu", optim="sgd", iterations=1)
    probe = Probe()
    plain = trace_step(_mlp_source(), spec, features=features_for(spec))
    trace = trace_step(_mlp_source(), spec, features=features_for(spec) + [probe])
    assert probe.calls == ["session", "build", "rules", "contexts", "finish"]
    assert probe.entered == 0  # the context was left
    assert probe.grads == [4]  # after backward: the gradients of both linears' weights and biases
    assert "probe built" in trace.notes and trace.notes[-1] == "probe finished"
    scratch = [r for r in trace.storages if r.op == "addmm.default (kernel scratch)"]
    assert len(scratch) == 2 and all(r.nbytes == SCRATCH for r in scratch)  # one addmm per linear forward
    inputs = sum(r.nbytes for r in trace.storages if r.category is Category.INPUTS)
    assert trace.host_peak() == inputs == 4 * 16 * 4  # the input contributed to host memory, moved off the device
    assert not any(r.host for r in plain.storages) and plain.host_events == []


class Packer(StepFeature):
    """Sees every tensor saved for backward (as activation offloading would)."""

    packs_saved = True

    def __init__(self) -> None:
        self.packed = self.unpacked = 0

    def pack(self, step, t):
        self.packed += 1
        return ("packed", t)

    def unpack(self, step, packed):
        self.unpacked += 1
        assert packed[0] == "packed"
        return packed[1]


def test_saved_tensors_pass_through_packing_features():
    spec = RunSpec(model="mlp", batch=4, target="cpu", optim="sgd", iterations=1)
    plain = trace_step(_mlp_source(), spec, features=features_for(spec))
    packer = Packer()
    trace = trace_step(_mlp_source(), spec, features=features_for(spec) + [packer])
    assert packer.packed > 0 and packer.unpacked == packer.packed
    assert trace.events == plain.events  # still marked as activations, same allocations
    assert [r.category for r in trace.storages] == [r.category for r in plain.storages]
    assert any(r.category is Category.ACTIVATIONS for r in trace.storages)


def test_trace_core_needs_its_features():
    with pytest.raises(TypeError):
        trace_step(_mlp_source(), RunSpec(model="mlp"))  # no silent trace without the spec's features


def test_features_for_picks_by_spec():
    def names(**kw):
        return [type(f).__name__ for f in features_for(RunSpec(model="m", **kw))]

    assert names() == ["CompileFeature", "CudaTarget", "OptimizerFeature"]
    assert names(target="cpu", checkpointing="blocks", lora="r=8", data_dependent="upper-bound", world_size=2) == [
        "CompileFeature", "FinetuneFeature", "CheckpointingFeature", "CpuTarget", "UpperBoundFeature",
        "ParallelFeature", "OptimizerFeature"]
    assert isinstance(features_for(RunSpec(model="m", offload="optimizer"))[-2], ParallelFeature)
    assert all(f is not g for f, g in zip(features_for(RunSpec(model="m")), features_for(RunSpec(model="m")), strict=True))
    assert isinstance(features_for(RunSpec(model="m", target="cpu"))[1], CpuTarget)
    assert isinstance(features_for(RunSpec(model="m"))[1], CudaTarget)


def _tracker(*rules: TrackerRules) -> StorageTracker:
    return StorageTracker(Trace(), lambda: "", TrackingFakeMode(), rules)


def test_tracker_rules_merge_in_order():
    def first(args, kwargs, out, make):
        return "first"

    def keep(args, kwargs, out, make):
        return out

    def second(args, kwargs, out, make):
        return "second"

    op, other = aten.mm.default, aten.add.Tensor
    tracker = _tracker(
        TrackerRules(scratch={op: lambda a, k: [1]}, outputs={op: first}),
        TrackerRules(scratch={op: lambda a, k: [2], other: lambda a, k: [3]}, subclass_types=(int,)),
        TrackerRules(chained={op: keep}, subclass_types=(int, float)),
    )
    assert tracker.scratch[op]((), {}) == [2] and tracker.scratch[other]((), {}) == [3]  # later replaces
    assert tracker.outputs[op]((), {}, "torch's", None) == "first"  # chained kept torch's output: the earlier fix
    assert tracker.subclass_types == (int, float)
    chained = _tracker(TrackerRules(outputs={op: first}), TrackerRules(chained={op: second}))
    assert chained.outputs[op]((), {}, "torch's", None) == "second"  # the chained fix answers first


def test_tracker_scopes_restore():
    tracker = _tracker()
    with pytest.raises(RuntimeError), tracker.labelled("outer"):
        with tracker.labelled("inner"), tracker.ignored():
            assert tracker.label == "inner" and tracker.ignoring == 1
            raise RuntimeError
    assert tracker.label is None and tracker.ignoring == 0


def _state_trace() -> Trace:
    trace = Trace()
    trace.storages = [
        StorageRecord(10, Category.PARAMETERS, "", Phase.SETUP, "parameter", 0),
        StorageRecord(20, Category.OPTIMIZER_STATE, "", Phase.OPTIMIZER, "zeros_like", 1),
        StorageRecord(30, Category.ACTIVATIONS, "", Phase.FORWARD, "mm", 1),
        StorageRecord(40, Category.TEMPORARIES, "", Phase.OPTIMIZER, "mul", 1),
    ]
    return trace


@pytest.mark.parametrize("offload, host", [("none", []), ("optimizer", [1, 3]), ("params", [0, 1, 3]),
                                           ("activations", [])])
def test_offload_moves_only_what_it_names(offload, host):
    """Data-parallel CPU offload contributes the optimizer state (and with params the sharded parameters); an
    offload of another kind (activations, the next issue's) moves no optimizer state off the device."""
    assert distributed.offloaded(_state_trace(), SimpleNamespace(offload=offload)) == host

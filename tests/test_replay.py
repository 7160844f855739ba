"""trace/replay.py: a replayed call leaves the trace the call itself makes, and a call a template cannot repeat runs.

The whole-step comparisons trace torchao's float8 and MXFP8 steps and --optim-in-backward steps with the replays and with them switched off
(``Replays.wrap`` returning the function itself) and compare every field of the two traces."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from memest.trace import replay
from memest.trace.events import Trace
from memest.trace.tracker import StorageTracker, TrackingFakeMode

from .conftest import traced_making

pytest.importorskip("torchao")

TRANSFORMER = "examples/transformer.py"
LLAMA = "hf:tests/configs/llama-tiny.json"
GPT2 = "hf:tests/configs/gpt2-tiny.json"
STEPS = [
    dict(model=TRANSFORMER, batch=2, seq=64, target="cuda", optim="adamw", fp8="tensorwise"),
    dict(model=TRANSFORMER, batch=2, seq=64, target="cuda", optim="adamw", fp8="rowwise", precision="bf16-mixed"),
    dict(model=TRANSFORMER, batch=2, seq=64, target="cpu", optim="sgd", fp8="tensorwise"),
    dict(model=LLAMA, batch=2, seq=128, target="cuda", fp8="tensorwise", checkpointing="blocks"),
    dict(model=LLAMA, batch=2, seq=64, target="cuda", fp8="tensorwise", shard="zero3", world_size=2,
         fp8_all_gather="float8-precomputed"),
    dict(model=TRANSFORMER, batch=2, seq=64, target="cuda", optim="adamw", fp8="mxfp8", compute_capability=(10, 0)),
    dict(model=LLAMA, batch=2, seq=64, target="cuda", fp8="mxfp8-wgrad-hp", compute_capability=(10, 0),
         precision="bf16", checkpointing="blocks"),
    dict(model=TRANSFORMER, batch=2, seq=64, target="cpu", optim="sgd", fp8="mxfp8-emulated"),
    # some blocks checkpointed (their backward runs: checkpointing holds the saved tensors, not autograd's node),
    # selective checkpointing (its dispatch mode: nothing replayed inside), activation offloading (the autograd
    # function not replayed), FSDP2 zero2, gradient accumulation
    dict(model=LLAMA, batch=2, seq=64, target="cuda", fp8="tensorwise", checkpointing="every:2"),
    dict(model=LLAMA, batch=2, seq=64, target="cuda", fp8="rowwise", checkpointing="selective"),
    dict(model=LLAMA, batch=2, seq=64, target="cuda", fp8="tensorwise", activation_offload="torchtune"),
    dict(model=LLAMA, batch=2, seq=64, target="cuda", fp8="tensorwise", shard="zero2", world_size=2),
    dict(model=LLAMA, batch=2, seq=64, target="cpu", optim="sgd", fp8="mxfp8-emulated", checkpointing="blocks"),
    dict(model=TRANSFORMER, batch=2, seq=64, target="cuda", optim="adamw", fp8="tensorwise", grad_accum=2),
    # --optim-in-backward: torch.optim's update functions, one optimizer per parameter (foreach on --target cuda,
    # single-tensor on cpu; SGD's momentum buffers made by the first step's calls, which run)
    dict(model=GPT2, batch=2, seq=32, target="cuda", optim="adamw", optim_in_backward=True),
    dict(model=LLAMA, batch=1, seq=8, target="cpu", optim="adamw", optim_in_backward=True),
    dict(model=GPT2, batch=1, seq=8, target="cuda", optim="sgd-momentum", optim_in_backward=True),
    dict(model=TRANSFORMER, batch=2, seq=64, target="cpu", optim="sgd", optim_in_backward=True),
]


def _traced(spec: dict, monkeypatch, replays_on: bool) -> tuple[Trace, list[replay.Replays]]:
    off = [] if replays_on else [(replay.Replays, method, lambda self, fn, name: fn)
                                  for method in ("wrap", "wrap_forward", "wrap_backward")]
    return traced_making(spec, monkeypatch, replay.Replays, off)


@pytest.mark.parametrize("spec", STEPS, ids=lambda s: "-".join(f"{v}" for k, v in s.items() if k not in ("model",)))
def test_replayed_step_is_the_step(spec, monkeypatch):
    on, made = _traced(spec, monkeypatch, True)
    off, _ = _traced(spec, monkeypatch, False)
    assert len(made) == 1 and made[0].replayed > 0, "no call was replayed"
    assert made[0].replayed < made[0].calls
    assert dataclasses.asdict(on) == dataclasses.asdict(off)


# -- the rules, on calls of one's own under a tracking fake mode ----------------------------------------------------

@pytest.fixture
def tracked():
    trace = Trace()
    mode = TrackingFakeMode()
    tracker = StorageTracker(trace, lambda: "block", mode)
    with mode, tracker:
        yield trace, mode


def _scaled(x, scale: float):
    """abs, a temporary, then a new tensor: one template of two storages, one freed."""
    amax = x.abs().amax()
    return (x * scale).to(torch.bfloat16) + amax.to(torch.bfloat16)


def test_a_repeated_call_appends_what_the_call_appends(tracked):
    trace, mode = tracked
    replays = replay.Replays()
    fn = replays.wrap(_scaled, "scaled")
    x = torch.empty(64, 32)
    first = fn(x, 2.0)
    made_first = trace.storages[1:]
    events_first = list(trace.events[1:])
    n = len(trace.storages)
    second = fn(x, 2.0)
    assert (replays.calls, replays.replayed, len(replays.templates)) == (2, 1, 1)
    assert type(second) is type(first) and second.shape == first.shape and second.stride() == first.stride()
    assert second.dtype == first.dtype and second.untyped_storage() is not first.untyped_storage()
    made_second = trace.storages[n:]
    assert [dataclasses.astuple(r) for r in made_second] == [dataclasses.astuple(r) for r in made_first]
    shift = n - 1
    assert trace.events[len(events_first) + 1:] == [(sid + shift, d) for sid, d in events_first]
    del second  # the replayed output is a tracked storage like any other: its free is recorded
    assert trace.events[-1][1] < 0 and trace.events[-1][0] >= n
    fn(x, 3.0)  # another value of an argument: another key, recorded
    assert len(replays.templates) == 2


def test_grad_recording_calls_and_other_dispatch_modes_run(tracked):
    trace, mode = tracked
    replays = replay.Replays()
    fn = replays.wrap(_scaled, "scaled")
    w = torch.empty(8, 8, requires_grad=True)
    fn(w, 2.0)
    fn(w, 2.0)
    assert replays.templates == {} and replays.replayed == 0  # autograd records a graph: never replayed
    x = torch.empty(8, 8)
    from torch.utils._python_dispatch import TorchDispatchMode

    class Watching(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    fn(x, 2.0)
    with Watching():
        fn(x, 2.0)  # another mode would miss the ops a replay skips
    assert replays.replayed == 0
    fn(x, 2.0)
    assert replays.replayed == 1


def test_a_call_that_keeps_or_frees_what_it_does_not_own_is_never_replayed(tracked):
    trace, mode = tracked
    replays = replay.Replays()
    kept = []

    def keeps(x):
        kept.append(x * 2)  # a storage made here that outlives the call, not its output
        return x + 1

    held = {"t": torch.empty(4, 4)}

    def frees(x):
        held.pop("t", None)  # a storage made before the call, freed during it
        held["t"] = torch.empty(4, 4)
        return x + 1

    x = torch.empty(4, 4)
    for fn in (replays.wrap(keeps, "keeps"), replays.wrap(frees, "frees")):
        fn(x)
        fn(x)
    assert replays.replayed == 0 and replays.templates == {}
    assert len(replays.failed) == 2


def test_views_of_arguments_and_unkeyable_arguments_run(tracked):
    trace, mode = tracked
    replays = replay.Replays()
    view = replays.wrap(lambda x: x.t(), "view")  # the output's storage is the argument's: not a template
    x = torch.empty(4, 8)
    view(x)
    view(x)
    same = replays.wrap(lambda x: x, "same")  # an argument itself returned: a replay would return another object
    same(x)
    same(x)
    unkeyed = replays.wrap(lambda x, obj: x + 1, "object")
    unkeyed(x, object())
    unkeyed(x, object())
    assert replays.replayed == 0 and not replays.templates and len(replays.failed) == 2


def _counted_update(param, grad, steps: list, lr: float):
    """torch.optim's shape: a constant step counter bumped in place, its value read, temporaries, in-place updates."""
    for step in steps:
        step += 1
    scale = lr / (1 - 0.9 ** steps[0].item())
    param.add_(grad.sqrt() * scale)


def test_constant_arguments_are_keyed_by_value_and_left_as_the_call_leaves_them(tracked):
    trace, mode = tracked
    replays = replay.Replays()
    fn = replays.wrap(_counted_update, "update")
    params = [torch.empty(8, 4) for _ in range(3)]
    grads = [torch.empty(8, 4) for _ in range(3)]
    steps = [torch.tensor(0.0) for _ in range(3)]  # constant fake tensors, as torch.optim makes its state_steps
    assert all(s.constant is not None for s in steps)
    for p, g, s in zip(params, grads, steps, strict=True):
        fn(p, g, [s], 1e-3)  # step 0 -> 1: the first recorded, the other two replayed
    assert (replays.calls, replays.replayed, len(replays.templates)) == (3, 2, 1)
    assert [s.item() for s in steps] == [1.0, 1.0, 1.0]  # a replay leaves the value the call left
    for p, g, s in zip(params, grads, steps, strict=True):
        fn(p, g, [s], 1e-3)  # step 1 -> 2: another value, another key
    assert (replays.calls, replays.replayed, len(replays.templates)) == (6, 4, 2)
    assert [s.item() for s in steps] == [2.0, 2.0, 2.0]
    n = len(trace.storages)
    fn(params[0], grads[0], [steps[0]], 1e-3)  # recorded: the temporaries each call makes and frees
    assert len(trace.storages) > n and sum(d for _, d in trace.events[-2 * (len(trace.storages) - n):]) == 0


def test_a_constant_the_call_leaves_without_a_value_is_never_replayed(tracked):
    trace, mode = tracked
    replays = replay.Replays()

    def written(x, step):
        step.add_(x.sum())  # a constant written with a fake value: FakeTensorMode drops its constant
        return x + 1

    fn = replays.wrap(written, "written")
    x = torch.empty(4)
    for _ in range(2):
        fn(x, torch.tensor(0.0))
    assert replays.replayed == 0 and len(replays.failed) == 1


class _Scaled(torch.autograd.Function):
    """Saves its input, sets two attributes, allocates a temporary and an output; its backward one gradient."""

    @staticmethod
    def forward(ctx, x, scale: float):
        ctx.save_for_backward(x)
        ctx.scale, ctx.tag = scale, "scaled"
        return (x.abs() * scale).to(torch.bfloat16)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return (grad.float() * ctx.scale + x.sign()), None


def _three_steps() -> list:
    grads = []
    for _ in range(3):
        x = torch.empty(8, 8, requires_grad=True)
        _Scaled.apply(x, 2.0).sum().backward()
        grads.append(x.grad)
    return grads


def test_an_autograd_function_is_replayed_with_what_it_does_to_ctx(tracked):
    trace, mode = tracked
    replays = replay.Replays()
    with replay.replaying(replays, [(_Scaled, "forward", "fwd"), (_Scaled, "backward", "bwd")]):
        grads = _three_steps()
    assert not hasattr(_Scaled.__dict__["forward"].__func__, "__wrapped__")  # restored
    assert replays.replayed == 4 and len(replays.templates) == 2  # the 2nd and 3rd forward and backward
    assert all(g.shape == (8, 8) and g.dtype == torch.float32 for g in grads)
    replayed = [dataclasses.astuple(r) for r in trace.storages], list(trace.events)
    trace2 = Trace()  # the same steps without replays: the same records and events
    mode2 = TrackingFakeMode()
    with mode2, StorageTracker(trace2, lambda: "block", mode2):
        grads2 = _three_steps()  # (held, as ``grads`` is: their frees would be events)
    assert len(grads2) == 3
    assert ([dataclasses.astuple(r) for r in trace2.storages], list(trace2.events)) == replayed


class _SavesItsOwn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y = x * 2
        ctx.save_for_backward(y)  # a tensor the forward made, not an argument: a replay could not save it
        return y + 1

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


def test_a_forward_that_saves_what_it_made_runs(tracked):
    trace, mode = tracked
    replays = replay.Replays()
    with replay.replaying(replays, [(_SavesItsOwn, "forward", "fwd")]):
        for _ in range(2):
            _SavesItsOwn.apply(torch.empty(4, requires_grad=True)).sum().backward()
    assert replays.replayed == 0 and len(replays.failed) == 1

"""--activation-offload (features/activation_offload.py): save_on_cpu's own hooks on the traced step, checked against
the same step run for real on CPU (validate/cpu_truth.py, torch.profiler memory events).

On CPU, host and device are one memory: the real step's peak must equal the trace's device + host total
(``Trace.combined_peak``) — to the byte, or with exactly the residual the same step without offloading has (GPT-2's
48 B, not this feature's). The device/host split is checked separately against what the real pack hook copied.

Two semantics are checked: save_on_cpu as it runs with CPU tensors (--target cpu: pageable moves nothing, pinned
copies), and as it runs with the saved tensors on another device (--target cuda), where the hooks' ``.cpu()`` and
``.to(device)`` copy; the real run then makes those copies too (the same hooks, the same ``_DeviceMoves`` scope)."""

from __future__ import annotations

import functools
import json

import pytest

from memest.errors import MemestError
from memest.features import registry
from memest.features.activation_offload import ActivationOffloadFeature
from memest.parallel.distributed import sharding_summary
from memest.sources import load_source
from memest.spec import RunSpec
from memest.spec.choices import ActivationOffload
from memest.validate.cpu_truth import measure_cpu_peak

from .conftest import model_ref

MODELS = [  # (model, batch, seq): the brief's three, activations large next to the model state
    (model_ref("transformer"), 8, 128),
    (model_ref("hf:llama-tiny"), 2, 64),
    (model_ref("hf:gpt2-tiny"), 4, 64),  # transformers' GPT-2 (an external model's code)
]


def _traced(source, spec):
    features = registry.features_for(spec)
    trace = registry.core.trace_step(source, spec, features=features)
    return trace, next((f for f in features if isinstance(f, ActivationOffloadFeature)), None)


def _real(source, spec, monkeypatch):
    """The real CPU step's peak, and the bytes the real pack hook copied per step (one feature object per step)."""
    seen: list[ActivationOffloadFeature] = []
    pack = ActivationOffloadFeature.pack_saved

    def counting(self, t):
        if self not in seen:
            seen.append(self)
        return pack(self, t)

    with monkeypatch.context() as patch:
        patch.setattr(ActivationOffloadFeature, "pack_saved", counting)
        peak = measure_cpu_peak(source, spec)["peak_bytes"]
    return peak, [f.copied_bytes for f in seen]


def _spec(model, batch, seq, mode):
    return RunSpec(model=model, batch=batch, seq=seq, target="cpu", optim="sgd", activation_offload=mode)


@functools.cache
def _plain_trace(model, batch, seq):
    """The step without offloading, traced once per (model, batch, seq) in this file: it has no offload feature, so
    neither the ``moves_for`` patch nor the counting hook reaches it, and every case of one model compares with it."""
    plain_spec = _spec(model, batch, seq, "none")
    return _traced(load_source(model), plain_spec)[0]


@functools.cache
def _plain_real(model, batch, seq):
    """The real CPU step without offloading, measured once per (model, batch, seq) in this file (as ``_plain_trace``);
    its pack hook never runs, so the copied bytes are none."""
    plain_spec = _spec(model, batch, seq, "none")
    return measure_cpu_peak(load_source(model), plain_spec)["peak_bytes"]


CASES = [(m, mode, moves) for m in MODELS for mode, moves in
         [("save-on-cpu-pinned", False), ("save-on-cpu", True), ("save-on-cpu-pinned", True)]]


@pytest.mark.parametrize("case", CASES, ids=[f"{m[0].split('/')[-1]}-{mode}-{'moves' if mv else 'cpu'}"
                                              for m, mode, mv in CASES])
def test_trace_matches_the_real_step_and_the_bytes_the_hook_copied(case, monkeypatch):
    (model, batch, seq), mode, moves = case
    if moves:  # the saved tensors in another memory than the host, as on --target cuda, emulated on CPU
        monkeypatch.setattr(ActivationOffloadFeature, "moves_for", staticmethod(lambda spec: True))
    source = load_source(model)
    spec = _spec(model, batch, seq, mode)
    plain, plain_real = _plain_trace(model, batch, seq), _plain_real(model, batch, seq)
    trace, feature = _traced(source, spec)
    real, copied = _real(source, spec, monkeypatch)

    # host and device are one memory on CPU: the trace's total is the real peak (the plain step's residual, if any)
    assert trace.combined_peak() - real == plain.combined_peak() - plain_real
    assert abs(plain.combined_peak() - plain_real) <= 64
    assert real > plain_real  # the host copies cost memory: the check is not vacuous
    # the split: the host column holds exactly the copies the real pack hook made
    assert len(copied) == spec.iterations and min(copied) > 0
    assert sum(r.nbytes for r in trace.storages if r.saved_copy) == sum(copied) == feature.copied_bytes
    assert trace.host_peak(saved=True) == max(copied)  # every copy of one step alive at the end of its forward
    assert trace.host_peak(saved=False) == 0  # nothing of --offload's kind
    assert trace.peak()[0] < plain.peak()[0]  # the device column lost the saved tensors


@pytest.mark.parametrize("model", [MODELS[0]], ids=["transformer"])
def test_pageable_save_on_cpu_moves_nothing_on_the_cpu(model, monkeypatch):
    """save_on_cpu(pin_memory=False) on CPU tensors: tensor.cpu() is the tensor itself; the real hook copies 0 B."""
    source = load_source(model[0])
    spec = _spec(*model, "save-on-cpu")
    trace, feature = _traced(source, spec)
    real, copied = _real(source, spec, monkeypatch)
    plain = _plain_trace(*model)
    assert copied == [0] * spec.iterations and feature.copied_bytes == 0
    assert trace.host_peak() == 0 and trace.combined_peak() == plain.combined_peak() == real
    assert any("moves nothing" in n for n in trace.notes)


def test_activation_copies_stay_apart_from_offloaded_model_state():
    """--offload optimizer's host memory (parallel/distributed.offloaded) is the same with activation offloading on
    --target cuda; the saved tensors' copies are their own column."""
    model = model_ref("hf:llama-tiny")
    source = load_source(model)
    base = dict(model=model, batch=2, seq=64, target="cuda", offload="optimizer")
    alone = registry.trace_step(source, RunSpec(**base))
    both = registry.trace_step(source, RunSpec(**base, activation_offload="save-on-cpu-pinned"))
    assert alone.host_peak(saved=False) > 0
    assert both.host_peak(saved=False) == alone.host_peak(saved=False)
    assert sharding_summary(both)["host_peak_bytes"] == sharding_summary(alone)["host_peak_bytes"]
    assert both.host_peak(saved=True) > 0 and alone.host_peak(saved=True) == 0
    assert all(not r.saved_copy for sid, r in enumerate(both.storages) if r.host and r.category.value != "activations")


def test_option_reaches_cli_json_and_refuses_inference(tmp_path):
    from typer.testing import CliRunner

    from memest.cli import app

    assert RunSpec(model="m.py", activation_offload="save_on_cpu").activation_offload is ActivationOffload.SAVE_ON_CPU
    with pytest.raises(MemestError, match="saves none"):
        RunSpec(model="m.py", mode="inference", activation_offload="save-on-cpu")
    result = CliRunner().invoke(app, ["estimate", model_ref("hf:llama-tiny"), "--batch", "2", "--seq", "64", "--optim", "sgd",
                                      "--target", "cuda", "--gpu", "h100", "--activation-offload",
                                      "save-on-cpu-pinned", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    host = doc["activation_host"]
    assert host["pinned"] is True and host["mode"] == "save-on-cpu-pinned" and host["host_peak_bytes"] > 0
    assert doc["spec"]["activation_offload"] == "save-on-cpu-pinned"
    plain = CliRunner().invoke(app, ["estimate", model_ref("hf:llama-tiny"), "--batch", "2", "--seq", "64", "--optim", "sgd",
                                     "--target", "cuda", "--gpu", "h100", "--json"])
    assert json.loads(plain.stdout)["activation_host"] is None
    assert doc["peak_allocated_bytes"] < json.loads(plain.stdout)["peak_allocated_bytes"]


def test_with_checkpointing_the_step_still_matches_the_real_one(monkeypatch):
    """Checkpointed blocks save through checkpoint's own hooks (as in a real run); the rest goes through save_on_cpu."""
    model = model_ref("transformer")
    source = load_source(model)
    spec = RunSpec(model=model, batch=8, seq=128, target="cpu", optim="sgd", checkpointing="blocks",
                   activation_offload="save-on-cpu-pinned")
    trace, _ = _traced(source, spec)
    real, copied = _real(source, spec, monkeypatch)
    assert trace.combined_peak() == real
    assert trace.host_peak(saved=True) == max(copied) > 0


def test_compile_is_refused_with_the_reason():
    with pytest.raises(MemestError, match="--compile is not traced yet"):
        RunSpec(model="m.py", compile=True, activation_offload="save-on-cpu-pinned")

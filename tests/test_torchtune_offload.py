"""--activation-offload torchtune (features/activation_offload.py TorchtuneRules): memest's traced step against a
real CPU step run under torchtune's own OffloadActivations class (tests/torchtune_activation_offloading.py, copied
from torchtune 0.6.1 with only what a CPU needs changed), on transformers' models.

The saved tensors are put in another memory than the host, as on --target cuda, emulated on CPU (``moves_for``
patched, as tests/test_activation_offload.py does): host and device are one memory on CPU, so the real step's peak
must equal the trace's device + host total (``Trace.combined_peak``), to the byte or with exactly the residual the
same step without offloading has. The copied class runs with ``use_streams=True`` (the recipes' default; its streams
are stand-ins that order nothing, its stashes its own) and with ``use_streams=False``; memest's rules with the same
flag. The recipe's context holds the model's forward only; the output head runs under its NoOpManager."""

from __future__ import annotations

import contextlib
import functools
import json
import types

import pytest

from memest.errors import MemestError
from memest.features import registry
from memest.features.activation_offload import TorchtuneOffloadFeature, output_head
from memest.sources import load_source
from memest.spec import RunSpec
from memest.trace.events import Phase
from memest.validate.cpu_truth import measure_cpu_peak

from . import torchtune_activation_offloading as tt
from .conftest import model_ref

MODELS = [(model_ref("hf:llama-tiny"), 2, 64), (model_ref("hf:gpt2-tiny"), 4, 64)]


def _spec(model, batch, seq, mode):
    return RunSpec(model=model, batch=batch, seq=seq, target="cpu", optim="sgd", activation_offload=mode)


def _traced(source, spec):
    features = registry.features_for(spec)
    trace = registry.core.trace_step(source, spec, features=features)
    return trace, next((f for f in features if isinstance(f, TorchtuneOffloadFeature)), None)


def _real_with_torchtune(source, spec, use_streams, monkeypatch):
    """The real CPU step with torchtune's class in the loop: get_act_offloading_ctx_manager's context entered around
    the model's forward (the recipe's ``with self.activations_handling_ctx: self._model(...)``), the head found by
    the name torchtune looks for (``output``: transformers calls it lm_head). Returns the peak and, per step, the
    bytes the class copied to the host."""
    copied: list[int] = []
    made: dict[int, tt.OffloadActivations] = {}  # the recipe makes its context once (setup), for every step

    def context(model):
        head = output_head(model)
        ctx = tt.get_act_offloading_ctx_manager(types.SimpleNamespace(output=head), True)
        if not use_streams:
            ctx = tt.OffloadActivations(use_streams=False)  # the same class, the single-stream rule
        assert isinstance(ctx, tt.OffloadActivations)
        pack = ctx.pack_hook

        def counting(t):
            tensor_id = pack(t)
            cpu_tensor, modified = ctx.tracker[tensor_id]
            if modified:
                copied[-1] += cpu_tensor.untyped_storage().nbytes()
            return tensor_id

        ctx.pack_hook = counting
        return ctx

    def loop(self, model, spec):
        if id(model) not in made:
            made[id(model)] = context(model)
        ctx = made[id(model)]
        copied.append(0)
        stack = contextlib.ExitStack()
        handles = [model.register_forward_pre_hook(lambda *a: ctx.__enter__()),
                   model.register_forward_hook(lambda *a: ctx.__exit__(None, None, None), always_call=True)]
        stack.callback(lambda: [h.remove() for h in handles])
        return stack

    with monkeypatch.context() as patch:
        patch.setattr(TorchtuneOffloadFeature, "loop", loop)
        peak = measure_cpu_peak(source, spec)["peak_bytes"]
    return peak, copied


CASES = [(m, streams) for m in MODELS for streams in (True, False)]


@functools.cache
def _plain(model, batch, seq):
    """The step without offloading, traced and run for real: once per model, shared by its streams and single-stream
    cases (no offload feature takes part in it, so neither case's patches of TorchtuneOffloadFeature reach it)."""
    source, plain_spec = load_source(model), _spec(model, batch, seq, "none")
    return registry.trace_step(source, plain_spec), measure_cpu_peak(source, plain_spec)["peak_bytes"]


@pytest.mark.parametrize("case", CASES, ids=[f"{m[0].split('/')[-1]}-{'streams' if s else 'single-stream'}"
                                              for m, s in CASES])
def test_trace_matches_torchtunes_class_on_a_real_step(case, monkeypatch):
    (model, batch, seq), use_streams = case
    monkeypatch.setattr(TorchtuneOffloadFeature, "moves_for", staticmethod(lambda spec: True))
    monkeypatch.setattr(TorchtuneOffloadFeature, "use_streams", use_streams)
    source = load_source(model)
    spec = _spec(model, batch, seq, "torchtune")
    plain, plain_real = _plain(model, batch, seq)
    trace, feature = _traced(source, spec)
    real, copied = _real_with_torchtune(source, spec, use_streams, monkeypatch)

    assert trace.combined_peak() - real == plain.combined_peak() - plain_real
    assert abs(plain.combined_peak() - plain_real) <= 64
    assert real > plain_real  # the host copies cost memory: the check is not vacuous
    # the host column holds exactly what torchtune's pack copied
    assert len(copied) == spec.iterations and min(copied) > 0
    assert sum(r.nbytes for r in trace.storages if r.saved_copy) == sum(copied) == feature.copied_bytes
    assert feature.kept > 0 and feature.offloaded > 0  # parameters / small tensors kept, the rest offloaded
    assert trace.peak()[0] < plain.peak()[0]  # the device column lost the offloaded tensors


def test_stream_stash_costs_device_memory_on_cuda():
    """On --target cuda the fwd stash (5 offloaded tensors alive until their copy is done) and the bwd stash hold
    device memory that the single-stream rule frees earlier: the streams' rule is never below it."""
    model, batch, seq = MODELS[0]
    source = load_source(model)
    spec = RunSpec(model=model, batch=batch, seq=seq, target="cuda", optim="sgd", activation_offload="torchtune")
    streams = registry.trace_step(source, spec)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(TorchtuneOffloadFeature, "use_streams", False)
        single = registry.trace_step(source, spec)
    plain = registry.trace_step(source, RunSpec(model=model, batch=batch, seq=seq, target="cuda", optim="sgd"))
    assert single.peak()[0] <= streams.peak()[0] < plain.peak()[0]
    # the forward, where the fwd stash lives: its 5 device tensors are held past their copy
    assert _phase_peak(single, Phase.FORWARD) < _phase_peak(streams, Phase.FORWARD) < _phase_peak(plain, Phase.FORWARD)
    # backward: each tensor brought back is held until the next node that brings one back has run (the bwd stash);
    # the backward's peak is at its start here (the head's gradients), before any is brought back, so its bytes
    # over the backward's events are compared
    assert _phase_area(single, Phase.BACKWARD) < _phase_area(streams, Phase.BACKWARD)
    assert streams.host_peak(saved=True) == single.host_peak(saved=True) > 0


def _phase_live(trace, phase) -> list[int]:
    return [live for i, live in enumerate(trace.timeline()) if trace.phase_at(i)[1] is phase]


def _phase_peak(trace, phase) -> int:
    return max(_phase_live(trace, phase))


def _phase_area(trace, phase) -> int:
    return sum(_phase_live(trace, phase))


def test_option_reaches_json_and_cpu_target_is_refused():
    from typer.testing import CliRunner

    from memest.cli import app

    args = ["estimate", model_ref("hf:llama-tiny"), "--batch", "2", "--seq", "64", "--optim", "sgd", "--gpu", "h100",
            "--activation-offload", "torchtune", "--json"]
    result = CliRunner().invoke(app, [*args, "--target", "cuda"])
    assert result.exit_code == 0, result.output
    host = json.loads(result.stdout)["activation_host"]
    assert host["mode"] == "torchtune" and host["pinned"] is True and host["host_peak_bytes"] > 0
    assert "OffloadActivations" in host["rules"] and "torchtune 0.6.1" in host["rules"]
    refused = CliRunner().invoke(app, [*args, "--target", "cpu"])
    assert refused.exit_code == 2 and "runs on CUDA only" in refused.output
    with pytest.raises(MemestError, match="saves none"):
        RunSpec(model="m.py", mode="inference", activation_offload="torchtune")


@pytest.mark.parametrize("extra", [dict(compile_scope="blocks"), dict(compile_scope="blocks", checkpointing="blocks")],
                         ids=["compiled-blocks", "compiled-checkpointed-blocks"])
def test_compiled_blocks_match_torchtunes_class(extra, monkeypatch):
    """The torchtune ladder's shape: each decoder layer compiled (--compile-scope blocks), with and without
    checkpointing, the chunked loss after the model (tests/models/llama_tiny_chunked_loss.py); torchtune's
    empty_like copy keeps the saved tensors' strides, which the compiled backward asserts."""
    monkeypatch.setattr(TorchtuneOffloadFeature, "moves_for", staticmethod(lambda spec: True))
    model = "tests/models/llama_tiny_chunked_loss.py"
    source = load_source(model)

    def spec(mode):
        return RunSpec(model=model, batch=2, seq=64, target="cpu", optim="adamw", activation_offload=mode, **extra)

    residual = registry.trace_step(source, spec("none")).combined_peak() - measure_cpu_peak(source, spec("none"))["peak_bytes"]
    trace, feature = _traced(source, spec("torchtune"))
    real, copied = _real_with_torchtune(source, spec("torchtune"), True, monkeypatch)
    # 512 B: a block the real compiled step holds in one of the two real runs, whichever this process runs first
    # with these compiled blocks (alone: the plain run reads +512 B and this one 0; after the eager cases above:
    # the plain run 0 and this one -512 B); not this feature's bytes, and at most that block
    assert trace.combined_peak() - real in (0, residual, -512) and abs(residual) <= 512
    assert sum(r.nbytes for r in trace.storages if r.saved_copy) == sum(copied) == feature.copied_bytes > 0

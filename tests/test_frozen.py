"""Frozen parameters (feature extraction, linear probing, adapters), each traced and compared with the
same step run for real on CPU (memest/validate/cpu_truth.py, which runs trace/step.py's run_step).

A fully frozen model makes no optimizer (nothing to step). When nothing in the loss requires grad, a
real loss.backward() raises, so the step a real loop can run is forward + loss: that is what is traced
(and measured), and the report says so. Only a model with no parameters at all is an error."""

import json

import pytest
from typer.testing import CliRunner

from memest.cli import app
from memest.errors import TraceError
from memest.estimator import estimate
from memest.features.registry import trace_step
from memest.sources import load_source
from memest.spec import RunSpec
from memest.trace.events import Phase
from memest.validate.cpu_truth import measure_cpu_peak

from .conftest import model_ref

# traced and real steps on ATen's CPU kernels alike (conftest.aten_cpu_kernels): the bf16 steps compare to the byte on
# CPUs where oneDNN would run their matmuls (AVX-512/AMX), as on the others
pytestmark = pytest.mark.usefixtures("aten_cpu_kernels")

REL_TOL = 0.02  # as tests/test_accuracy_cpu.py

CASES = [
    # (model, batch, extra RunSpec fields)
    ("frozen", 16, {"optim": "adam"}),
    ("frozen", 16, {"optim": "sgd", "grad_accum": 3}),
    ("frozen", 16, {"optim": "adamw", "precision": "bf16-mixed"}),
    ("frozen_input_grad", 16, {"optim": "adam"}),
    ("linear_probe", 16, {"optim": "adam"}),
    ("linear_probe", 16, {"optim": "sgd-momentum", "zero_grad": "zeros"}),
]


def _id(case):
    name, batch, extra = case
    return "-".join([name, str(batch)] + [f"{k}={v}" for k, v in extra.items()])


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_frozen_parameters_match_the_real_cpu_step(case):
    name, batch, extra = case
    ref = model_ref(name)
    spec = RunSpec(model=ref, batch=batch, target="cpu", **extra)
    source = load_source(ref)
    estimated, _ = trace_step(source, spec).peak()
    real = measure_cpu_peak(source, spec)["peak_bytes"]
    error = (estimated - real) / real
    assert abs(error) <= REL_TOL, f"{_id(case)}: estimated {estimated} B, measured {real} B ({100 * error:+.2f}%)"


def _phases(trace):
    return {phase for _, _, phase in trace.phase_marks}


def test_fully_frozen_traces_forward_and_loss_and_says_so():
    ref = model_ref("frozen")
    result = estimate(RunSpec(model=ref, batch=16, optim="adam", target="cpu"))
    report = result.report
    assert _phases(result.trace) == {Phase.FORWARD, Phase.LOSS}
    assert report.param_count > 0
    assert report.breakdown_at_peak["gradients"] == report.breakdown_at_peak["optimizer_state"] == 0
    assert report.breakdown_at_peak["parameters"] == report.param_bytes
    assert any("forward + loss" in note and "backward" in note for note in report.notes)


def test_frozen_input_grad_runs_backward_without_parameter_state():
    result = estimate(RunSpec(model=model_ref("frozen_input_grad"), batch=16, optim="adam", target="cpu"))
    assert Phase.BACKWARD in _phases(result.trace) and Phase.OPTIMIZER not in _phases(result.trace)
    assert all(row.grad_bytes == row.optimizer_bytes == 0 for row in result.report.layers)


def test_linear_probe_has_grads_and_state_for_the_head_only():
    report = estimate(RunSpec(model=model_ref("linear_probe"), batch=16, optim="adam", target="cpu")).report
    rows = {row.name: row for row in report.layers}
    head, backbone = rows["head"], rows["backbone"]
    assert head.grad_bytes == head.param_bytes > 0
    assert head.optimizer_bytes >= 2 * head.param_bytes  # exp_avg, exp_avg_sq (+ step)
    assert backbone.grad_bytes == backbone.optimizer_bytes == 0
    assert any("frozen" in note for note in report.notes)


def test_frozen_model_on_the_command_line():
    result = CliRunner().invoke(app, ["estimate", model_ref("frozen"), "--target", "cpu", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["breakdown_at_peak"]["optimizer_state"] == 0 and doc["peak_allocated_bytes"] > 0


def test_frozen_model_ranks_are_replicas_as_measured():
    """--world-size with a frozen model: no gradients to synchronise (DDP refuses such a model), so each
    rank runs the step alone; compared with N real gloo ranks (tolerance of tests/test_sharding.py)."""
    from memest.validate.distributed_truth import measure_distributed_peaks

    ref = model_ref("frozen")
    specs = [RunSpec(model=ref, batch=16, optim="adam", target="cpu", world_size=2, shard=shard) for shard in ("none", "zero1")]
    measured = measure_distributed_peaks(specs)
    for spec, ranks in zip(specs, measured, strict=True):
        result = estimate(spec)
        estimated, real = result.report.peak_allocated_bytes, ranks[0]["peak_bytes"]
        assert abs(estimated - real) / real <= 0.05, f"--shard {spec.shard}: estimated {estimated} B, measured {real} B"
        assert result.report.breakdown_at_peak["gradients"] == result.report.breakdown_at_peak["optimizer_state"] == 0
        assert any("replicas" in note for note in result.report.notes)


def test_frozen_model_with_fsdp_is_refused_clearly():
    ref = model_ref("frozen")
    with pytest.raises(TraceError) as info:
        estimate(RunSpec(model=ref, batch=16, target="cpu", world_size=2, shard="zero3"))
    assert "frozen" in str(info.value) and "--shard none" in str(info.value)


def test_model_without_parameters_is_an_error():
    ref = model_ref("no_params")
    with pytest.raises(TraceError) as info:
        trace_step(load_source(ref), RunSpec(model=ref, target="cpu"))
    message = str(info.value)
    assert "no_params.py" in message and "no parameters" in message
    result = CliRunner().invoke(app, ["estimate", ref])
    assert result.exit_code == 2, result.output
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.output

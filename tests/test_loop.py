"""The user's loop (--outputs kept | freed) and the chunked / fused loss heads (--loss-head), each traced
and compared with the same loop run for real on CPU (memest/validate/cpu_truth.py runs trace/step.py's
run_step, so both run the identical loop). Tolerance: 2% of the true peak, as the other accuracy tests."""

import functools
import json

import pytest
from typer.testing import CliRunner

from memest.cli import app
from memest.features.registry import trace_step
from memest.report.analysis import analyse
from memest.sources import load_source
from memest.spec import RunSpec
from memest.validate.cpu_truth import measure_cpu_peak

from .conftest import model_ref, step_kernels

REL_TOL = 0.02

# (model, batch, seq, optimizer); nanogpt: a model file written the nanoGPT way (forward returns (logits, loss))
LOOP_CASES = [
    ("hf:gpt2-tiny", 4, 64, "adamw"),
    ("hf:llama-tiny", 2, 64, "adamw"),
    ("transformer", 2, 64, "adamw"),
    ("nanogpt", 4, 64, "adamw"),
    ("mlp", 8, None, "adam"),
    ("cnn", 8, None, "sgd-momentum"),
    ("forward_peak", 64, None, "sgd"),
]
LANGUAGE_MODELS = ("hf:gpt2-tiny", "hf:llama-tiny", "transformer", "nanogpt")


@functools.cache  # each (model, loop) once for the whole file: real runs take seconds
def _traced_and_real(name, batch, seq, **fields):
    ref = model_ref(name)
    spec = RunSpec(model=ref, batch=batch, seq=seq, target="cpu", **fields)
    source = load_source(ref)
    with step_kernels(source, spec):  # a bf16 step without convolutions or RNNs: ATen's kernels (conftest)
        trace = trace_step(source, spec)
        real = measure_cpu_peak(source, spec)["peak_bytes"]
    return analyse(trace, spec, ref), real


def _error(report, real) -> float:
    return (report.peak_allocated_bytes - real) / real


@pytest.mark.parametrize("outputs", ["kept", "freed"])
@pytest.mark.parametrize("case", LOOP_CASES, ids=[c[0] for c in LOOP_CASES])
def test_each_loop_matches_the_same_loop_run_for_real(case, outputs):
    name, batch, seq, optim = case
    report, real = _traced_and_real(name, batch, seq, optim=optim, outputs=outputs)
    error = _error(report, real)
    assert abs(error) <= REL_TOL, f"{name} {outputs}: estimated {report.peak_allocated_bytes} B, real {real} B ({100 * error:+.2f}%)"
    if outputs == "freed":
        assert report.outputs_held_bytes == 0


@pytest.mark.parametrize("name", LANGUAGE_MODELS)
def test_kept_outputs_cost_what_the_real_loops_differ_by(name):
    """A language model's logits decide its peak: the plain loop needs more, and the bytes the report
    says the outputs hold at the peak are what the two real loops differ by."""
    batch, seq, optim = next((b, s, o) for n, b, s, o in LOOP_CASES if n == name)
    kept, real_kept = _traced_and_real(name, batch, seq, optim=optim, outputs="kept")
    freed, real_freed = _traced_and_real(name, batch, seq, optim=optim, outputs="freed")
    assert real_kept > real_freed
    assert kept.outputs_held_bytes > 0
    assert abs(kept.outputs_held_bytes - (real_kept - real_freed)) <= 0.002 * real_kept, (
        f"{name}: held {kept.outputs_held_bytes} B, real loops differ by {real_kept - real_freed} B"
    )
    assert kept.peak_allocated_bytes - freed.peak_allocated_bytes == pytest.approx(real_kept - real_freed, rel=0.01)


def _literal_loop_peak(name, batch, seq, outputs: str, optim: str = "adamw") -> int:
    """The loops as users write them, not through run_step: the plain loop of the PyTorch tutorial /
    nanoGPT, and HF Trainer's, which drops the output before backward. Measured like cpu_truth."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    from torch.utils._pytree import tree_flatten

    from memest.features.registry import build, step_optimizer
    from memest.trace.step import call_model
    from memest.validate.cpu_truth import _allocation_events, _distinct_storage_bytes

    ref = model_ref(name)
    spec = RunSpec(model=ref, batch=batch, seq=seq, target="cpu", optim=optim)
    source = load_source(ref)
    torch.manual_seed(0)
    built = build(source, spec)
    model, inputs = built.model, built.inputs
    opt = step_optimizer(spec, list(model.parameters()))
    baseline = _distinct_storage_bytes(list(model.parameters()) + list(model.buffers()) + tree_flatten(inputs)[0])
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        if outputs == "kept":
            for _ in range(2):
                out = call_model(model, inputs)
                loss = source.compute_loss(out, inputs) if source.compute_loss else out.loss
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        else:
            for _ in range(2):
                out = call_model(model, inputs)
                loss = source.compute_loss(out, inputs) if source.compute_loss else out.loss
                del out
                loss.backward()
                del loss
                opt.step()
                opt.zero_grad(set_to_none=True)
    events = _allocation_events(prof)
    start = events[0].extra_fields.total_allocated - events[0].extra_fields.alloc_size
    return max(e.extra_fields.total_allocated for e in events) - start + baseline


@pytest.mark.parametrize("outputs", ["kept", "freed"])
@pytest.mark.parametrize("name", ["hf:gpt2-tiny", "nanogpt", "forward_peak"])
def test_each_loop_is_the_loop_users_write(name, outputs):
    """--outputs kept / freed against the loops written out by hand (not through run_step)."""
    batch, seq, optim = next((b, s, o) for n, b, s, o in LOOP_CASES if n == name)
    report, _ = _traced_and_real(name, batch, seq, optim=optim, outputs=outputs)
    real = _literal_loop_peak(name, batch, seq, outputs, optim)
    assert abs(report.peak_allocated_bytes - real) <= REL_TOL * real, f"{report.peak_allocated_bytes} vs {real}"


def test_the_previous_output_is_released_only_when_the_new_forward_returns():
    """forward_peak peaks on a forward temporary: the kept loop's peak is there in step 2, with the
    previous step's output still referenced (released at `out = model(x)`, after the forward)."""
    report, real = _traced_and_real("forward_peak", 64, None, optim="sgd", outputs="kept")
    assert abs(_error(report, real)) <= REL_TOL
    assert (report.peak_iteration, report.phase_at_peak) == (2, "forward")
    output = 64 * 2048 * 4
    assert output <= report.outputs_held_bytes <= output + 512  # the previous step's output (and its loss)
    assert _literal_loop_peak("forward_peak", 64, None, "kept", "sgd") == real


def test_accumulation_keeps_the_previous_micro_steps_output_through_the_next_forward():
    for outputs in ("kept", "freed"):
        report, real = _traced_and_real("hf:gpt2-tiny", 2, 64, optim="adamw", grad_accum=3, outputs=outputs)
        assert abs(_error(report, real)) <= REL_TOL, f"{outputs}: {100 * _error(report, real):+.2f}%"


def test_the_default_loop_is_the_plain_one_and_the_report_says_so():
    assert RunSpec(model="m.py").outputs == "kept"
    result = CliRunner().invoke(app, ["estimate", model_ref("hf:gpt2-tiny"), "--batch", "4", "--seq", "64",
                                      "--target", "cpu", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["spec"]["outputs"] == "kept"
    logits = 4 * 64 * 1000 * 4  # batch x seq x vocab, fp32: what GPT-2's output holds at the backward peak
    assert logits <= doc["outputs_held_bytes"] <= logits + 512
    note = next(n for n in doc["notes"] if n.startswith("loop: outputs kept"))
    assert "--outputs freed" in note and "HF Trainer" in note


def test_freed_loop_from_flag_config_and_api(tmp_path):
    ref = model_ref("hf:gpt2-tiny")
    result = CliRunner().invoke(app, ["estimate", ref, "--batch", "4", "--seq", "64", "--target", "cpu",
                                      "--outputs", "freed", "--json"])
    doc = json.loads(result.stdout)
    assert doc["spec"]["outputs"] == "freed" and doc["outputs_held_bytes"] == 0
    assert any(n.startswith("loop: outputs freed") for n in doc["notes"])

    config = tmp_path / "run.yaml"
    config.write_text(f"model: {ref}\nbatch: 4\nseq: 64\ntarget: cpu\noutputs: freed\ngpu: 1GiB\n")
    kept = CliRunner().invoke(app, ["check", str(config), "--outputs", "kept", "--json"])
    freed = CliRunner().invoke(app, ["check", str(config), "--json"])
    needed = {k: json.loads(r.stdout)["configs"][0]["needed_bytes"] for k, r in (("kept", kept), ("freed", freed))}
    assert needed["freed"] == doc["needed_bytes"] < needed["kept"]

    import memest

    est = memest.estimate(ref, batch=4, seq=64, target="cpu", outputs="freed")
    assert est.needed_bytes == doc["needed_bytes"]
    bad = CliRunner().invoke(app, ["estimate", ref, "--outputs", "dropped"])
    assert bad.exit_code == 2


# -------------------------------------------------------------------------------------- loss heads

HEAD_CASES = [
    ("hf:gpt2-tiny", 4, 64, "fp32", "chunked"),
    ("hf:gpt2-tiny", 4, 64, "fp32", "chunked:3"),
    ("hf:gpt2-tiny", 4, 64, "fp32", "fused"),
    ("hf:gpt2-tiny", 4, 64, "bf16-mixed", "chunked"),
    ("hf:gpt2-tiny", 4, 64, "bf16-mixed", "fused"),
    ("hf:llama-tiny", 2, 64, "fp32", "chunked"),
    ("hf:llama-tiny", 2, 64, "fp32", "fused"),
]


@pytest.mark.parametrize("case", HEAD_CASES, ids=["-".join(map(str, c)) for c in HEAD_CASES])
def test_chunked_loss_head_lowers_the_need_and_matches_the_real_chunked_step(case):
    name, batch, seq, precision, head = case
    chunked, real = _traced_and_real(name, batch, seq, optim="adamw", precision=precision, loss_head=head)
    assert abs(_error(chunked, real)) <= REL_TOL, f"{case}: {100 * _error(chunked, real):+.2f}%"
    standard, real_standard = _traced_and_real(name, batch, seq, optim="adamw", precision=precision)
    assert chunked.peak_allocated_bytes < standard.peak_allocated_bytes
    assert real < real_standard  # the real chunked step needs less too
    assert chunked.outputs_held_bytes <= 16  # the output holds the loss, no logits
    assert any(n.startswith("loss head:") for n in chunked.notes)


def test_loss_heads_say_where_they_do_not_apply():
    for name in ("mlp", "hf:bert-tiny", "nanogpt"):
        result = CliRunner().invoke(app, ["estimate", model_ref(name), "--target", "cpu", "--loss-head", "fused"])
        assert result.exit_code == 2, result.output
        assert "causal LM" in result.stderr and "\n" not in result.stderr.strip()
    bad = CliRunner().invoke(app, ["estimate", model_ref("hf:gpt2-tiny"), "--loss-head", "chunked:0"])
    assert bad.exit_code == 2 and "chunked:N" in bad.stderr
    inference = CliRunner().invoke(app, ["estimate", model_ref("hf:gpt2-tiny"), "--mode", "inference",
                                         "--loss-head", "chunked"])
    assert inference.exit_code == 2 and "training loss" in inference.stderr


def test_advise_traces_the_loss_head_remedies():
    result = CliRunner().invoke(app, ["advise", model_ref("hf:gpt2-tiny"), "--batch", "8", "--seq", "128",
                                      "--target", "cpu", "--gpu", "1MiB", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    remedies = {r["name"]: r for r in doc["remedies"]}
    free = remedies["free outputs before backward"]
    chunked = remedies["chunked LM head + cross-entropy (torchtune)"]
    fused = remedies["fused linear cross-entropy (Liger-Kernel)"]
    assert free["changes"] == {"outputs": "freed"} and chunked["changes"] == {"loss_head": "chunked"}
    for remedy in (free, chunked, fused):
        assert remedy["lowers_need"] and remedy["needed_bytes"] < doc["base_needed_bytes"]
        assert "FLOPs" in remedy["time_cost"]
    assert fused["needed_bytes"] < chunked["needed_bytes"]  # the fused head saves no logits at all
    # a model without a causal-LM head gets the loop remedy only
    mlp = json.loads(CliRunner().invoke(app, ["advise", model_ref("mlp"), "--batch", "8", "--target", "cpu",
                                              "--gpu", "1MiB", "--json"]).stdout)
    names = [r["name"] for r in mlp["remedies"]]
    assert "free outputs before backward" in names and not any("cross-entropy" in n for n in names)


def test_loops_and_loss_heads_under_data_parallelism_match_real_ranks():
    """DDP and FSDP2 (zero3): the loop and the patched head run inside the wrappers, per rank, as N real
    gloo processes run them (memest/validate/distributed_truth.py); tolerance as tests/test_sharding.py."""
    from memest.validate.distributed_truth import measure_distributed_peaks

    ref = model_ref("hf:gpt2-tiny")
    specs = [RunSpec(model=ref, batch=4, seq=64, optim="adamw", target="cpu", world_size=2, shard=shard,
                     loss_head=head, outputs=outputs)
             for shard, head, outputs in (("none", "fused", "kept"), ("zero3", "chunked", "kept"),
                                          ("zero3", "standard", "kept"))]
    for spec, ranks in zip(specs, measure_distributed_peaks(specs), strict=True):
        traced = trace_step(load_source(ref), spec).peak()[0]
        real = ranks[0]["peak_bytes"]
        assert abs(traced - real) <= 0.05 * real, f"{spec.shard} {spec.loss_head}: traced {traced}, real {real}"


def test_planners_say_which_loop_they_assume():
    ref = model_ref("mlp")
    for outputs in ("kept", "freed"):
        args = ["max-batch", ref, "--gpu", "300MiB", "--target", "cpu", "--outputs", outputs]
        doc = json.loads(CliRunner().invoke(app, args + ["--json"]).stdout)
        assert doc["outputs"] == outputs
        assert f"loop: outputs {outputs}" in CliRunner().invoke(app, args).stdout

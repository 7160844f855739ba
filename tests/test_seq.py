"""The sequence length an estimate uses, and the longest one a model takes.

Without --seq the source's default is used (hf: 512 capped by the model's positions; model files: the
default of example_inputs' seq_len) and the report says which. A --seq beyond the model's maximum
positions is an error: learned position embeddings have no row for it (the real step crashes); RoPE
models are refused beyond their configured maximum too."""

import json

import pytest
from typer.testing import CliRunner

from memest.cli import app
from memest.errors import MemestError
from memest.estimator import estimate
from memest.features.registry import trace_step
from memest.sources import load_source
from memest.spec import RunSpec
from memest.validate.cpu_truth import measure_cpu_peak

from .conftest import model_ref

REL_TOL = 0.02  # as tests/test_accuracy_cpu.py


def test_gpt2_beyond_its_positions_is_an_error():
    with pytest.raises(MemestError) as info:
        estimate(RunSpec(model="hf:gpt2", batch=1, seq=4096, target="cpu"))
    message = str(info.value)
    assert "at most 1024 positions (n_positions)" in message and "--seq 1024 or less" in message


def test_gpt2_beyond_its_positions_exits_2():
    result = CliRunner().invoke(app, ["estimate", "hf:gpt2", "--seq", "4096"])
    assert result.exit_code == 2, result.output
    assert "1024" in result.stderr and result.stdout == ""


def test_the_real_step_beyond_the_positions_cannot_run():
    """What the error stands for: the real model has no position embedding for token 129 of gpt2-tiny."""
    import torch

    ref = model_ref("hf:gpt2-tiny")
    source = load_source(ref)
    assert source.max_seq == 128
    model = source.build_model()
    with pytest.raises(IndexError):
        model(**source.example_inputs(1, source.max_seq + 1))
    with torch.no_grad():
        model(**source.example_inputs(1, source.max_seq))  # the maximum itself runs
    with pytest.raises(MemestError):
        trace_step(source, RunSpec(model=ref, seq=source.max_seq + 1, target="cpu"))
    with pytest.raises(MemestError):  # the ground truth builds through the same check
        measure_cpu_peak(source, RunSpec(model=ref, seq=source.max_seq + 1, target="cpu"))


def test_rope_model_beyond_its_configured_maximum_is_an_error():
    ref = model_ref("hf:llama-tiny")  # max_position_embeddings 256
    with pytest.raises(MemestError) as info:
        estimate(RunSpec(model=ref, batch=1, seq=512, target="cpu"))
    message = str(info.value)
    assert "256" in message and "max_position_embeddings" in message and "RoPE" in message


def test_relative_positions_have_no_maximum():
    assert load_source("hf:t5-base").max_seq is None  # relative attention buckets
    report = estimate(RunSpec(model=model_ref("hf:t5-tiny"), batch=1, seq=600, target="cpu")).report
    assert report.spec["seq"] == 600


def test_generate_counts_prompt_and_new_tokens():
    ref = model_ref("hf:gpt2-tiny")  # 128 positions
    with pytest.raises(MemestError) as info:
        estimate(RunSpec(model=ref, batch=1, seq=100, mode="generate", new_tokens=40, target="cpu"))
    assert "140" in str(info.value) and "128" in str(info.value)
    ok = estimate(RunSpec(model=ref, batch=1, seq=100, mode="generate", new_tokens=28, target="cpu"))
    assert ok.report.spec["seq"] == 100


def test_gpt2_without_seq_reports_the_default_used():
    result = CliRunner().invoke(app, ["estimate", "hf:gpt2", "--target", "cpu", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["spec"]["seq"] == 512 == load_source("hf:gpt2").default_seq


def test_hf_default_is_capped_by_the_positions_and_is_what_runs():
    ref = model_ref("hf:gpt2-tiny")  # 128 positions: the default 512 is capped to 128
    default = estimate(RunSpec(model=ref, batch=2, target="cpu"))
    explicit = estimate(RunSpec(model=ref, batch=2, seq=128, target="cpu"))
    assert default.report.spec["seq"] == 128
    assert default.report.peak_allocated_bytes == explicit.report.peak_allocated_bytes


def test_vision_model_has_no_seq():
    report = estimate(RunSpec(model=model_ref("hf:vit-tiny"), batch=2, target="cpu")).report
    assert report.spec["seq"] is None


def test_model_file_default_seq_is_reported_and_measured():
    ref = model_ref("seq_default")  # example_inputs(batch_size, seq_len=128)
    source = load_source(ref)
    spec = RunSpec(model=ref, batch=4, target="cpu")
    report = estimate(spec, source=source).report
    assert report.spec["seq"] == 128
    real = measure_cpu_peak(source, RunSpec(model=ref, batch=4, seq=128, target="cpu"))["peak_bytes"]
    error = (report.peak_allocated_bytes - real) / real
    assert abs(error) <= REL_TOL, f"estimated {report.peak_allocated_bytes} B, measured {real} B ({100 * error:+.2f}%)"

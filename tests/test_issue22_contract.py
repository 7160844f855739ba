"""Issue 22, the CLI contract: items 19, 28, 29, 30, 31, 35 (each test fails on the code before the fix)."""

import json
import os
from functools import partial

import pytest

from .conftest import ROOT, run
from .conftest import one_line_error as shared_one_line_error

one_line_error = partial(shared_one_line_error, alone=True, traceback=False)  # its strictness: the error is stderr's only line
MLP = str(ROOT / "examples" / "mlp.py")


# -- 19: estimate --fail-if-not-fits says TIGHT on stderr, as check does ----------------------------


def test_estimate_fail_if_not_fits_warns_when_tight():
    first = run("estimate", MLP, "--batch", "32", "--json")
    doc = json.loads(first.stdout)
    mid = (doc["needed_bytes"] + doc["needed_bytes_high"]) // 2  # expected fits, the high end does not
    budget = f"{mid / 2**30:.9f}GiB"
    result = run("estimate", MLP, "--batch", "32", "--gpu", budget, "--fail-if-not-fits", "--json")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["verdict"] == "tight"
    assert "memest: warning: TIGHT" in result.stderr and "--strict" in result.stderr
    strict = run("estimate", MLP, "--batch", "32", "--gpu", budget, "--fail-if-not-fits", "--strict", "--json")
    assert strict.exit_code == 1 and "warning: TIGHT" not in strict.stderr


# -- 31: calibrate checks for the GPU before it creates any folder ----------------------------------


def test_calibrate_without_gpu_creates_no_folder(tmp_path, monkeypatch):
    from memest.device import nvml

    monkeypatch.setattr(nvml, "query_gpus", lambda: nvml.GpuQuery([], "no NVIDIA GPU visible (test)"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    out = tmp_path / "newdir" / "x.json"
    line = one_line_error(run("calibrate", "--out", out))
    assert "needs an NVIDIA GPU" in line
    assert not (tmp_path / "newdir").exists() and not (tmp_path / "cache").exists()


# -- found by the property test (tests/test_cli_contract_property.py, seed 7): `model:` with no value ------


def test_check_config_with_an_empty_model_is_one_line_error(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("gpu: 11GB\nmodel: null\n")
    line = one_line_error(run("check", config, config, "--markdown"))
    assert "no `model:`" in line and str(config) in line


# -- found by the property test (seed 8): a zero budget divided serve's utilization fix by zero ----------


def test_zero_budget_is_refused_not_divided_by():
    tiny = "hf:" + str(ROOT / "tests" / "configs" / "llama-tiny.json")
    line = one_line_error(run("serve", tiny, "--gpu", "0GB", "--json"))
    assert "--gpu 0GB" in line and "zero" in line
    assert "zero" in one_line_error(run("estimate", MLP, "--gpu", "0GB"))


# -- 35: layout --------------------------------------------------------------------------------------


def _check_like_table():
    from memest.report.emit import Table, View

    headers = ["config", "model", "seq", "gpu", "predicted", "range", "with margin", "budget", "headroom", "verdict"]
    rows = [["gpt2-11gb-fits", "hf:gpt2", "1024", "sm75", "6.13 GiB", "5.26 GiB-6.35 GiB", "6.74 GiB (+10%)",
             "11.00 GiB (rtx2080ti)", "4.26 GiB", "fits"]]
    return View({}, [Table("memest check", headers, rows, left=("config", "model", "budget", "verdict"))]), rows[0]


def _emitted(monkeypatch, columns):
    import io
    import sys

    from memest.report.emit import emit
    from memest.spec.choices import OutputFormat

    monkeypatch.setenv("COLUMNS", str(columns))
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)  # rich's Console writes to sys.stdout (not a terminal here)
    view, cells = _check_like_table()
    emit(view, OutputFormat.TABLE, out)
    return out.getvalue(), cells


def test_narrow_output_never_breaks_a_number_and_piped_output_honours_columns(monkeypatch):
    for columns in (60, 80, 100):
        text, cells = _emitted(monkeypatch, columns)
        assert max(len(line) for line in text.splitlines()) <= columns, text  # COLUMNS honoured when piped
        words = set(text.split())
        for cell in cells:
            for word in cell.split():
                assert word in words or any(word in w for w in words), (word, text)  # each token whole
        for number in ("6.13", "5.26", "6.35", "6.74", "11.00", "4.26"):
            assert number in text, (number, text)


def test_check_table_names_the_gpu_generation_and_the_budget_size_once(tmp_path):
    from memest.plan.check import CheckRow
    from memest.report.views import check_view

    class Result:
        rows = [CheckRow("c", "c.yaml", "hf:gpt2", 6 * 2**30, 6 * 2**30, "rtx2080ti (11 GiB)", 11 * 2**30, 0.0,
                         True, 5 * 2**30, 1024, "sm75", "fits", 5 * 2**30, 6 * 2**30, 6 * 2**30)]
        fits, verdict, strict, tight = True, "fits", False, []

    table = check_view(Result()).blocks[0]
    row = dict(zip(table.headers, table.rows[0], strict=True))
    assert row["gpu"] == "sm75"
    assert row["budget"] == "11.00 GiB (rtx2080ti)"


def test_counts_agree_with_their_nouns_and_tib_exists():
    from memest.units import format_bytes, plural, table_unit

    assert plural(1, "GPU") == "1 GPU" and plural(8, "GPU") == "8 GPUs" and plural(1, "trace") == "1 trace"
    assert format_bytes(3 * 2**40) == "3.00 TiB"
    assert table_unit([2 * 2**40]) == ("TiB", 2**40)


def test_depth_below_zero_is_refused():
    line = one_line_error(run("estimate", MLP, "--depth", "-1"))
    assert "--depth -1" in line


def test_version_names_memest_torch_and_transformers():
    from importlib import metadata

    result = run("--version")
    assert result.exit_code == 0
    line = result.stdout.strip()
    assert line.startswith("memest ") and f"torch {metadata.version('torch')}" in line
    assert f"transformers {metadata.version('transformers')}" in line


# -- 30: third-party chatter is hidden unless --debug; the user's own warnings still show ----------------

NOISY = '''
import logging
import warnings

import torch
from torch import nn


def build_model():
    logging.getLogger("bitsandbytes.backends.cpu.ops").warning(
        "Failed to load CPU gemm_4bit_forward from kernels-community: no kernels")  # as bitsandbytes 0.50 logs it
    logging.getLogger("peft.tuners").warning("peft says something")
    warnings.warn("the user's own warning")
    return nn.Linear(8, 8)


def example_inputs(batch_size, seq_len=None):
    return (torch.randn(batch_size, 8),)
'''


def _memest(*args):
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "memest", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=120)


def test_library_logs_and_warnings_are_hidden_unless_debug(tmp_path):
    model = tmp_path / "noisy.py"
    model.write_text(NOISY)
    quiet = _memest("estimate", model, "--target", "cpu", "--json")  # a process: pytest captures logging itself
    assert quiet.returncode == 0, quiet.stderr
    assert "Failed to load" not in quiet.stderr and "peft says" not in quiet.stderr, quiet.stderr
    assert "the user's own warning" in quiet.stderr
    json.loads(quiet.stdout)
    debug = _memest("estimate", model, "--target", "cpu", "--json", "--debug")
    assert "Failed to load CPU gemm_4bit_forward" in debug.stderr


def test_transformers_deprecation_noise_under_lora_is_hidden():
    tiny = "hf:" + str(ROOT / "tests" / "configs" / "llama-tiny.json")
    result = _memest("estimate", tiny, "--lora", "r=4", "--seq", "32", "--target", "cpu", "--json")  # pytest keeps warnings
    assert result.returncode == 0, result.stderr
    assert "Warning" not in result.stderr and "warnings.warn" not in result.stderr, result.stderr


# -- 29: the message names what the user passed, before any wrapping or tracing ----------------------


@pytest.mark.parametrize(("extra", "names", "rule"), [
    (["--world-size", "2", "--pp", "2", "--pp-split", "a,b"], "--pp-split a,b", "whole layer counts"),
    (["--world-size", "4", "--pp", "4", "--microbatches", "1"], "--microbatches 1", "--microbatches 4 or more"),
    (["--world-size", "2", "--tp", "2", "--sp", "--seq", "33"], "--seq 33", "not a multiple of 2"),
])
def test_parallel_layout_errors_blame_the_flag_given(extra, names, rule):
    tiny = "hf:" + str(ROOT / "tests" / "configs" / "llama-tiny-4l.json")
    line = one_line_error(run("estimate", tiny, "--target", "cpu", *extra))
    assert names in line and rule in line, line
    assert "wrapping the model" not in line and "--shard none" not in line and "broadcast" not in line


# -- 28: check finds what it can before tracing any config, and names the YAML file and key ----------


def _configs(tmp_path, second: str):
    tiny = ROOT / "tests" / "configs" / "llama-tiny.json"
    first = tmp_path / "first.yaml"
    first.write_text(f"model: hf:{tiny}\nseq: 32\ngpu: 11GB\ntarget: cpu\n")
    other = tmp_path / "second.yaml"
    other.write_text(f"model: hf:{tiny}\ngpu: 11GB\ntarget: cpu\n{second}")
    return first, other


def test_check_refuses_a_too_long_seq_before_tracing_and_names_the_yaml_key(tmp_path):
    first, other = _configs(tmp_path, "seq: 100000\n")
    result = run("check", first, other)
    line = one_line_error(type("R", (), {"exit_code": result.exit_code, "stdout": result.stdout,
                                         "stderr": "\n".join(s for s in result.stderr.splitlines()
                                                             if s.startswith("memest: error"))})())
    assert line.startswith(f"memest: error: {other}: ") and "use seq: 256 or less" in line, line
    assert "check 1/2" not in result.stderr  # nothing was traced first


def test_check_trace_time_errors_name_the_yaml_file_and_key(tmp_path):
    first, other = _configs(tmp_path, "seq: 32\nworld_size: 3\ntp: 3\n")
    result = run("check", first, other)
    assert result.exit_code == 2
    line = [s for s in result.stderr.splitlines() if s.startswith("memest: error")][0]
    assert line.startswith(f"memest: error: {other}: ") and "tp: 3:" in line and "--tp" not in line, line


def test_context_parallel_runs_are_not_labelled_data_parallel():
    from types import SimpleNamespace

    from memest.report.summary import _parallel_rows

    report = SimpleNamespace(sharding={"rank": 0, "world_size": 8, "parallel": "dp 4 x cp 2"},
                             spec={"cp": 2, "tp": 1, "pp": 1, "ep": 1}, effective_batch=8)
    assert _parallel_rows(report)[0].label == "parallel"


def test_a_pipeline_plot_title_says_which_rank():
    from types import SimpleNamespace

    from memest.report.plot import title_lines

    spec = {"batch": 2, "seq": 32, "optim": "adamw", "precision": "fp32", "target": "cpu", "pp": 4, "pp_stage": 3}
    report = SimpleNamespace(spec=spec, model="hf:llama-tiny", peak_allocated_bytes=2**20, device=None)
    title, _ = title_lines(SimpleNamespace(iterations=2), report)
    assert "pipeline rank 3 of 4" in title

"""The command line as a user meets it: exit codes, one-line errors, one JSON document on stdout."""

import json

import pytest
from typer.testing import CliRunner

from memest.cli import app

from .conftest import model_ref

runner = CliRunner()


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def test_estimate_json_contract():
    result = run("estimate", model_ref("mlp"), "--batch", 4, "--optim", "adam", "--json", "--gpu", "11GB")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["schema_version"] == 1
    assert isinstance(doc["peak_allocated_bytes"], int) and doc["peak_allocated_bytes"] > 0
    assert set(doc["breakdown_at_peak"]) == {
        "parameters", "gradients", "optimizer_state", "activations", "temporaries", "other"
    }
    assert sum(doc["breakdown_at_peak"].values()) == doc["peak_allocated_bytes"]
    assert doc["phase_at_peak"] in {"forward", "loss", "backward", "optimizer", "zero_grad"}
    root = doc["layers"][0]
    assert root["name"] == "" and root["params"] == doc["param_count"]
    assert doc["gpus"]["rows"][0]["capacity_bytes"] == 11 * 10**9
    assert doc["gpus"]["fits"] is True


def test_estimate_table_names_layers_and_peak():
    result = run("estimate", model_ref("mlp"), "--batch", 4)
    assert result.exit_code == 0, result.output
    for text in ("Linear", "GELU", "peak allocated", "folklore formula", "optimizer state"):
        assert text in result.stdout


def test_adam_holds_two_states_per_parameter():
    doc = json.loads(run("estimate", model_ref("mlp"), "--batch", 4, "--optim", "adam", "--json").stdout)
    # exp_avg and exp_avg_sq (fp32) for every parameter, plus a 4-byte step per parameter tensor
    n_tensors = 6
    assert doc["breakdown_at_peak"]["optimizer_state"] == 2 * doc["param_bytes"] + 4 * n_tensors


def test_fail_if_not_fits_exit_code():
    result = run("estimate", model_ref("mlp"), "--batch", 4, "--gpu", "1MiB", "--fail-if-not-fits")
    assert result.exit_code == 1
    result = run("estimate", model_ref("mlp"), "--batch", 4, "--gpu", "1MiB")
    assert result.exit_code == 0


def test_gpus_without_driver_is_plain():
    result = run("gpus")
    assert result.exit_code == 0
    assert "GPU" in result.stdout


@pytest.mark.parametrize(
    "args,needle",
    [
        (["estimate", "does/not/exist.py"], "not found"),
        (["estimate", model_ref("no_build")], "build_model"),
        (["estimate", model_ref("wrong_shape")], "example_inputs"),
        (["estimate", model_ref("mlp"), "--optim", "lion"], "--optim"),
        (["estimate", model_ref("mlp"), "--gpu", "11XB"], "11XB"),
        (["estimate", model_ref("data_dependent")], "data-dependent"),
        (["estimate", model_ref("nonzero")], "data-dependent"),
        (["estimate", "hf:no-such-model"], "bundled"),
        (["estimate", model_ref("mlp"), "--batch", "0"], "--batch"),
        (["estimate", model_ref("mlp"), "--gpu", "7"], "no such GPU"),
    ],
)
def test_bad_input_one_line_exit_2(args, needle):
    result = run(*args)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert needle in lines[0] and "Traceback" not in result.output
    assert result.stdout == ""


def test_debug_shows_traceback():
    result = run("estimate", model_ref("no_build"), "--debug")
    assert result.exit_code != 0
    assert result.exception is not None


def test_plot_written_and_bad_extension_fails_before_tracing(tmp_path):
    out = tmp_path / "step.html"
    result = run("estimate", model_ref("mlp"), "--batch", "4", "--plot", out)
    assert result.exit_code == 0, result.output
    assert out.read_text().lstrip().lower().startswith("<!doctype html")
    bad = run("estimate", model_ref("mlp"), "--plot", tmp_path / "x.gif")
    assert bad.exit_code == 2 and ".png" in bad.stderr and bad.stdout == ""


def test_estimate_prints_a_terminal_timeline():
    result = run("estimate", model_ref("mlp"), "--batch", "4")
    assert "peak" in result.stdout and "f forward" in result.stdout

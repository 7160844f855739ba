"""Issue 22, the CLI contract: items 19, 28, 29, 30, 31, 35 (each test fails on the code before the fix)."""

import json

from typer.testing import CliRunner

from memest.cli import app

from .conftest import ROOT

runner = CliRunner()
MLP = str(ROOT / "examples" / "mlp.py")


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def one_line_error(result, code=2):
    assert result.exit_code == code, (result.exit_code, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("memest: error: "), result.stderr
    return lines[0]


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

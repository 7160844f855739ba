"""memest check: YAML run configs, exit codes for CI, overrides, and bad configs."""

import json
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from memest.cli import app
from memest.errors import MemestError
from memest.spec.config import load_config

from .conftest import ROOT, model_ref

runner = CliRunner()


def write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def small(tmp_path, name="small.yaml", budget="11GB", batch=4, extra=""):
    return write(tmp_path, name, f"model: {model_ref('mlp')}\nbatch: {batch}\noptim: adam\ngpu: {budget}\n{extra}")


def test_fits_exit_0_and_json(tmp_path):
    result = runner.invoke(app, ["check", small(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["fits"] is True and doc["configs"][0]["budget_bytes"] == 11 * 10**9


def test_any_not_fitting_exit_1(tmp_path):
    ok = small(tmp_path, "ok.yaml")
    tight = small(tmp_path, "tight.yaml", budget="100MiB")
    result = runner.invoke(app, ["check", ok, tight, "--json"])
    assert result.exit_code == 1, result.output
    verdicts = {c["name"]: c["fits"] for c in json.loads(result.stdout)["configs"]}
    assert verdicts == {"ok": True, "tight": False}


def test_margin_and_flag_overrides(tmp_path):
    path = small(tmp_path)
    base = json.loads(runner.invoke(app, ["check", path, "--json"]).stdout)["configs"][0]
    doc = json.loads(runner.invoke(app, ["check", path, "--json", "--margin", "10%", "--batch", "2048"]).stdout)
    row = doc["configs"][0]
    assert row["margin"] == pytest.approx(0.10)
    assert row["required_bytes"] == math.ceil(row["needed_bytes"] * 1.10)  # rounded up: the safe side
    # --batch 2048 overrode batch: 4 (a larger step than 64: needed is the smallest budget that runs the
    # step, whole allocator segments, and the MLP's batch-64 activations fit where batch 4's do)
    assert row["needed_bytes"] > base["needed_bytes"]
    # a budget just under the requirement with margin fails, just over passes
    needed = row["needed_bytes"]
    over = runner.invoke(app, ["check", path, "--batch", "2048", "--gpu", f"{needed * 1.13 / 2**20:.0f}MiB", "--margin", "10%"])
    under = runner.invoke(app, ["check", path, "--batch", "2048", "--gpu", f"{needed * 1.05 / 2**20:.0f}MiB", "--margin", "10%"])
    assert (over.exit_code, under.exit_code) == (0, 1)


def test_markdown_table(tmp_path):
    result = runner.invoke(app, ["check", small(tmp_path), "--markdown"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.strip().splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("| config"))
    assert set(lines[header + 1]) <= set("|-: ") and len(lines) == header + 3  # title, header, rule, one row


def test_shipped_configs_one_fits_one_does_not():
    fits = runner.invoke(app, ["check", str(ROOT / "configs" / "gpt2-11gb-fits.yaml")])
    too_big = runner.invoke(app, ["check", str(ROOT / "configs" / "gpt2-11gb-too-big.yaml")])
    assert (fits.exit_code, too_big.exit_code) == (0, 1), fits.output + too_big.output


@pytest.mark.parametrize(
    "text,needle",
    [
        ("", "empty config"),
        ("model: [unclosed", "malformed YAML"),
        ("- a\n- b\n", "mapping"),
        ("batch: 4\n", "no `model:`"),
        ("model: x.py\nbacth: 4\n", "did you mean 'batch'"),
        ("model: x.py\nbatch: four\n", "whole number"),
    ],
)
def test_bad_configs_are_one_line_exit_2(tmp_path, text, needle):
    path = write(tmp_path, "bad.yaml", text)
    with pytest.raises(MemestError, match=needle):
        load_config(path)
    result = runner.invoke(app, ["check", path])
    assert result.exit_code == 2
    assert needle in result.stderr and len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("args,needle", [(["--gpu", "-1GB"], "below zero"), (["--gpu", "rtx9999"], "known card"),
                                         (["--margin", "-5%"], "below zero")])
def test_bad_budgets_exit_2(tmp_path, args, needle):
    result = runner.invoke(app, ["check", small(tmp_path), *args])
    assert result.exit_code == 2 and needle in result.stderr


def test_nothing_half_done_when_one_config_is_invalid(tmp_path):
    ok = small(tmp_path, "ok.yaml")
    bad = write(tmp_path, "bad.yaml", "model: x.py\nbacth: 4\n")
    result = runner.invoke(app, ["check", ok, bad])
    assert result.exit_code == 2 and result.stdout == ""  # no partial table


def test_model_path_is_relative_to_the_config(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "net.py").write_text((ROOT / "examples" / "mlp.py").read_text())
    cfg = load_config(write(tmp_path / "sub", "c.yaml", "model: net.py\ngpu: 11GB\n"))
    assert Path(cfg.values["model"]) == (tmp_path / "sub" / "net.py").resolve()

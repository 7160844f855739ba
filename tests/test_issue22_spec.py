"""Issue 22, the spec and value items (4, 7, 16, 24, 25, 26 in part, 27): inputs a CI gate could read wrongly
are refused with one line naming the fix; none reaches an internal error."""

import pytest
from typer.testing import CliRunner

from memest.cli import app

from .conftest import model_ref

runner = CliRunner()


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def one_line_error(result, code=2):
    assert result.exit_code == code, (result.exit_code, result.stdout, result.stderr)
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("memest: error: "), result.stderr
    assert "Traceback" not in result.stderr and "internal error" not in result.stderr
    return lines[0]


def config(tmp_path, body: str, name: str = "run.yaml"):
    path = tmp_path / name
    path.write_text(f"model: {model_ref('mlp')}\nbatch: 2\n{body}")
    return path


@pytest.fixture
def no_gpus(monkeypatch):
    from memest.device import nvml

    monkeypatch.setattr(nvml, "query_gpus", lambda: nvml.GpuQuery([], "no NVIDIA GPU visible (test)"))


@pytest.fixture
def one_gpu(monkeypatch):
    from memest.device import nvml

    gpu = nvml.Gpu(0, "NVIDIA Test GPU", 16 * 2**30, 0, 16 * 2**30)
    monkeypatch.setattr(nvml, "query_gpus", lambda: nvml.GpuQuery([gpu], driver="1.0"))


# -- 4: a bare margin of 1 is as ambiguous as a bare 10 ------------------------------------------------


@pytest.mark.parametrize("margin", ["1", "1.0", "2"])
def test_bare_margin_of_one_is_refused_on_the_flag(tmp_path, margin):
    line = one_line_error(run("check", config(tmp_path, "gpu: 11GB\n"), "--margin", margin))
    assert "ambiguous" in line and f"{float(margin):g}%" in line and f"{float(margin) / 100:g}" in line


def test_bare_margin_of_one_is_refused_in_yaml(tmp_path):
    line = one_line_error(run("check", config(tmp_path, "gpu: 11GB\nmargin: 1\n")))
    assert "margin" in line and "1%" in line and "0.01" in line


def test_margin_as_percent_or_fraction_still_reads():
    from memest.spec.config import parse_margin

    assert parse_margin("1%") == pytest.approx(0.01)
    assert parse_margin(0.01) == pytest.approx(0.01)
    assert parse_margin("100%") == pytest.approx(1.0)
    assert parse_margin("0.99") == pytest.approx(0.99)


# -- 7: a budget without a unit is never guessed -----------------------------------------------------


@pytest.mark.parametrize("gpu", ["24.0", "0.5", ".5"])
def test_unitless_decimal_budget_is_refused(gpu, no_gpus):
    line = one_line_error(run("estimate", model_ref("mlp"), "--gpu", gpu))
    assert f"{gpu}GB" in line and f"{gpu}GiB" in line


def test_unitless_budget_in_yaml_is_refused(tmp_path, no_gpus):
    line = one_line_error(run("check", config(tmp_path, "gpu: 0.5\n")))
    assert "0.5GB" in line and "0.5GiB" in line


@pytest.mark.parametrize("command", [["estimate"], ["max-batch"], ["advise"]])
def test_bare_integer_that_is_no_device_says_how_to_write_a_budget(command, one_gpu):
    line = one_line_error(run(command[0], model_ref("mlp"), "--gpu", "24"))
    assert "no such GPU" in line and "24GB" in line and "24GiB" in line


def test_bare_integer_that_is_a_device_is_the_device(one_gpu):
    from memest.app import resolve_gpu

    ctx = resolve_gpu("0")
    assert ctx.capacity_bytes == 16 * 2**30 and "NVIDIA Test GPU" in ctx.budget_label


@pytest.mark.parametrize("gpu", ["0GB", "0GiB", "0.0MB", "0B"])
def test_empty_budget_is_refused(gpu, no_gpus):
    line = one_line_error(run("estimate", model_ref("mlp"), "--gpu", gpu))
    assert "empty budget" in line


# -- 25: YAML pp_virtual: loads (fixed on main by the options table; kept as a guard) ------------------


def test_yaml_pp_virtual_is_a_whole_number(tmp_path):
    from memest.spec.config import load_config

    path = tmp_path / "pp.yaml"
    path.write_text("model: hf:llama-3.2-1b\npp: 2\nworld_size: 2\npp_schedule: interleaved\npp_virtual: 3\n")
    assert load_config(path).spec().pp_virtual == 3
    path.write_text("model: hf:llama-3.2-1b\npp: 2\nworld_size: 2\npp_schedule: interleaved\npp_virtual: '3'\n")
    with pytest.raises(Exception, match="pp_virtual: expected a whole number"):
        load_config(path)

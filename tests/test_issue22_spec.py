"""Issue 22, the spec and value items (4, 7, 16, 24, 25, 26 in part, 27): inputs a CI gate could read wrongly
are refused with one line naming the fix; none reaches an internal error."""

from functools import partial

import pytest

from .conftest import model_ref, run
from .conftest import one_line_error as shared_one_line_error

one_line_error = partial(shared_one_line_error, full_prefix=True, internal=True)  # progress lines may precede it


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


# -- 24: options that would change nothing are refused with the reason -------------------------------


def test_pp_virtual_without_a_pipeline_is_refused():
    line = one_line_error(run("estimate", model_ref("mlp"), "--pp-virtual", "3"))
    assert "--pp-virtual" in line and "--pp N" in line


def test_pp_virtual_without_a_pipeline_is_refused_in_yaml(tmp_path):
    line = one_line_error(run("check", config(tmp_path, "gpu: 11GB\npp_virtual: 3\n")))
    assert "pp_virtual:" in line and "--pp-virtual" not in line and "run.yaml" in line  # the YAML key (issue 22, 28)


@pytest.mark.parametrize("quant", [None, "int8"])
def test_no_double_quant_without_4bit_quant_is_refused(quant):
    extra = ["--lora", "r=4", "--quant", quant] if quant else []
    line = one_line_error(run("estimate", model_ref("mlp"), "--no-double-quant", *extra))
    assert "--no-double-quant" in line and "nf4" in line


def test_calibration_with_target_cpu_is_refused():
    from .conftest import ROOT

    profile = next((ROOT / "profiles").glob("*.json"))
    line = one_line_error(run("estimate", model_ref("mlp"), "--target", "cpu", "--calibration", profile))
    assert "--calibration" in line and "--target cpu" in line


def test_calibration_with_target_cpu_is_refused_in_yaml(tmp_path):
    from .conftest import ROOT

    profile = next((ROOT / "profiles").glob("*.json"))
    line = one_line_error(run("check", config(tmp_path, f"gpu: 11GB\ntarget: cpu\ncalibration: {profile}\n")))
    assert "--calibration" in line and "run.yaml" in line


@pytest.mark.parametrize("split", ["0,4", "4,0"])
def test_pp_split_with_an_empty_stage_is_refused(split):
    line = one_line_error(run("estimate", model_ref("hf:llama-tiny-4l"), "--batch", "2", "--seq", "16", "--pp", "2",
                              "--world-size", "2", "--pp-split", split))
    assert f"--pp-split {split}" in line and "no layer" in line


def test_pp_split_with_every_stage_filled_still_runs():
    result = run("estimate", model_ref("hf:llama-tiny-4l"), "--batch", "2", "--seq", "16", "--pp", "2",
                 "--world-size", "2", "--pp-split", "1,3", "--json")
    assert result.exit_code == 0, result.stderr


# -- 16: LoRA specs are read exactly or refused ---------------------------------------------------------


@pytest.mark.parametrize("lora", [{"r": 2.7}, {"r": True}, {"alpha": float("nan")}, {"alpha": float("inf")},
                                  {"alpha": -5}, {"alpha": True}, "alpha=nan", "alpha=inf", "alpha=-5",
                                  "r=8,r=16", {"r": 8, "rank": 16}])
def test_bad_lora_values_are_refused(lora):
    from memest.errors import MemestError
    from memest.spec.lora import parse_lora

    with pytest.raises(MemestError, match="--lora: (bad value|r is given twice)"):
        parse_lora(lora)


def test_lora_whole_numbers_still_read():
    from memest.spec.lora import parse_lora

    assert parse_lora({"r": 8.0, "alpha": 16}) == "r=8,alpha=16"
    assert parse_lora("r=16,alpha=32,dropout=0.05,targets=q_proj,v_proj") == \
        "r=16,alpha=32,dropout=0.05,targets=q_proj,v_proj"


@pytest.mark.parametrize("body", ["lora: {r: 2.7}\n", "lora: {r: true}\n", "lora: {alpha: .nan}\n"])
def test_bad_lora_values_are_refused_in_yaml(tmp_path, body):
    path = tmp_path / "run.yaml"
    path.write_text(f"model: {model_ref('hf:llama-tiny')}\nbatch: 1\nseq: 16\ngpu: 11GB\n{body}")
    line = one_line_error(run("check", path))
    assert "run.yaml" in line and "lora: bad value" in line and "--lora" not in line  # the YAML key (issue 22, 28)


def _tiny_lora(text):
    from torch import nn

    from memest.features.finetune import apply_lora
    from memest.spec.lora import lora_settings, parse_lora

    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 64))
    return apply_lora(model, lora_settings(parse_lora(text)), "tiny.py")


def test_lora_rank_above_a_targeted_layer_is_refused():
    from memest.errors import MemestError

    with pytest.raises(MemestError, match=r"r=100000 is above .*64 in, 32 out, so at most r=32"):
        _tiny_lora("r=100000,targets=0,2")
    with pytest.raises(MemestError, match="at most r=32"):
        _tiny_lora("r=33,targets=0,2")


def test_lora_rank_within_the_layers_still_applies():
    model = _tiny_lora("r=32,targets=0,2")
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == 2 * (32 * 64 + 32 * 32)


# -- 26 (part): calibration compute_capability, plot paths ---------------------------------------------


def _profile(tmp_path, cc):
    import json

    from .conftest import ROOT

    data = json.loads(next((ROOT / "profiles").glob("*.json")).read_text())
    data["compute_capability"] = cc
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize("cc", [90, [9], "9", [9.5, 0], True])
def test_ambiguous_compute_capability_is_one_clear_error(tmp_path, cc):
    line = one_line_error(run("estimate", model_ref("mlp"), "--calibration", _profile(tmp_path, cc)))
    assert "compute_capability must be [major, minor]" in line and "profile.json" in line


@pytest.mark.parametrize("cc", ["9.0", [9, 0]])
def test_unambiguous_compute_capability_is_read(tmp_path, cc):
    from memest.app import resolve_gpu

    assert resolve_gpu("11GB", calibration=_profile(tmp_path, cc)).compute_capability == (9, 0)


def test_plot_name_over_the_file_system_limit_is_a_user_error(tmp_path):
    line = one_line_error(run("estimate", model_ref("mlp"), "--plot", tmp_path / ("a" * 300 + ".html")))
    assert "cannot write a plot" in line and "limit" in line


def test_plot_folder_over_the_file_system_limit_is_a_user_error(tmp_path):
    line = one_line_error(run("estimate", model_ref("mlp"), "--plot", tmp_path / ("a" * 300) / "step.html"))
    assert "cannot write a plot" in line


def test_plot_name_just_under_the_limit_is_written(tmp_path):
    path = tmp_path / ("b" * 250 + ".html")
    result = run("estimate", model_ref("mlp"), "--plot", path)
    assert result.exit_code == 0, result.stderr
    assert path.exists()


def test_full_disk_under_plot_is_a_user_error(tmp_path, monkeypatch):
    import errno

    from memest.report import plot

    def full(path, write):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(plot, "atomic_write", full)
    line = one_line_error(run("estimate", model_ref("mlp"), "--plot", tmp_path / "step.html"))
    assert "No space left on device" in line and "step.html" in line


# -- 27: the Python API checks its arguments; every error is one MemestError line ------------------------


def _api_error(call):
    from memest.errors import MemestError

    with pytest.raises(MemestError) as info:
        call()
    message = str(info.value)
    assert "\n" not in message.strip(), message
    return message


@pytest.mark.parametrize("kwargs, words", [
    ({"batch": "8"}, "batch: expected a whole number"),
    ({"batch": None}, "batch: a value is required"),
    ({"batch": 2.5}, "batch: expected a whole number"),
    ({"batch": True}, "batch: expected a whole number"),
    ({"seq": "128"}, "seq: expected a whole number"),
    ({"tp": "2"}, "tp: expected a whole number"),
    ({"bach": 4}, "did you mean 'batch'"),
    ({"gpu": 11}, "gpu: expected a card name"),
    ({"gpu": "11XB"}, "11XB"),
    ({"gpu": "0"}, "device index"),
    ({"checkpointing": 3}, "checkpointing: expected a string"),
    ({"calibration": {"x": 1}}, "calibration dict lacks"),
    ({"calibration": 5}, "calibration: expected a profile file"),
    ({"optim": 3}, "optim: expected one of"),
    ({"fused": "yes"}, "fused: expected True or False"),
    ({"lr": "0.1"}, "lr: expected a number"),
])
def test_api_estimate_refuses_wrong_arguments(kwargs, words):
    import memest

    message = _api_error(lambda: memest.estimate(model_ref("mlp"), **kwargs))
    assert words in message and message.startswith("memest.estimate()") or "calibration" in words


def test_api_estimate_refuses_calibration_with_target_cpu():
    import memest

    from .conftest import ROOT

    profile = str(next((ROOT / "profiles").glob("*.json")))
    assert "target='cpu'" in _api_error(lambda: memest.estimate(model_ref("mlp"), target="cpu", calibration=profile))


@pytest.mark.parametrize("kwargs, words", [
    ({"tp": 2.5}, "tp: expected a whole number"),
    ({"tp": "2"}, "tp: expected a whole number"),
    ({"max_model_length": 8192}, "did you mean 'max_model_len'"),
    ({"utilization": "0.9"}, "utilization: expected a number"),
    ({"engine": 1}, "engine: expected one of"),
    ({"gpu": 11}, "gpu: expected a card name"),
    ({"gpu": "11XB"}, "11XB"),
])
def test_api_serve_capacity_refuses_wrong_arguments(kwargs, words):
    import memest

    kwargs = {"gpu": "h100", **kwargs}
    message = _api_error(lambda: memest.serve_capacity("hf:llama-3-8b", **kwargs))
    assert words in message


@pytest.fixture(scope="module")
def mlp_estimate():
    import memest

    return memest.estimate(model_ref("mlp"), batch=2, gpu="11GB")


@pytest.mark.parametrize("budget", [-5, 0, True, None, 2.5, "0GB", "24.0"])
def test_api_fits_refuses_a_budget_that_holds_nothing(mlp_estimate, budget):
    _api_error(lambda: mlp_estimate.fits(budget))
    _api_error(lambda: mlp_estimate.verdict(budget))


def test_api_estimate_has_trainable_param_count(mlp_estimate):
    assert mlp_estimate.trainable_param_count == mlp_estimate.report.trainable_param_count > 0
    assert mlp_estimate.trainable_param_count == mlp_estimate.to_dict()["trainable_param_count"]
    assert mlp_estimate.fits("11GB") is True

"""Fixed costs from evidence (issue 11): the evidence tables match what was measured, the defaults and
ranges are computed from the rows (never typed in), the three-way verdict and --strict, and portable
calibration profiles (write, load without a GPU, apply in estimate / check / the API, provenance shown)."""

import json
import statistics
from pathlib import Path

import pytest
from typer.testing import CliRunner

import memest
from memest.cli import app
from memest.device import overheads as oh
from memest.device.calibration import SCHEMA, load_profile, write_profile
from memest.device.fit import DOES_NOT_FIT, FITS, TIGHT, passes, verdict, worst
from memest.device.measured_runs import MEASURED_RUNS, PROBE_STAGES, SLACK_RUNS, VALIDATION_RUNS, Run
from memest.device.slack import ALLOCATED_WITHIN, slack_band
from memest.device.usage import device_usage
from memest.errors import MemestError

from .conftest import ROOT, model_ref
from .test_device_overheads import hand_trace

MiB = 2**20
runner = CliRunner()
H100_PROFILE = ROOT / "profiles" / "h100-cuda13.0-torch2.11.json"


# ------------------------------------------------------------------ the tables are what was measured


def test_validation_runs_are_the_measured_json_rows():
    stored = json.loads((ROOT / "benchmarks" / "gpu-validation.json").read_text())["rows"]
    stored += json.loads((ROOT / "benchmarks" / "gpu-slack.json").read_text())["rows"]
    assert len(stored) == len(MEASURED_RUNS) == len(VALIDATION_RUNS) + len(SLACK_RUNS)
    for run, row in zip(MEASURED_RUNS, stored, strict=True):
        case, real, est = row["case"], row["real"], row["memest"]
        assert (run.model, run.batch, run.seq, run.optim, run.precision) == tuple(case[:5])
        assert run.options == ", ".join(f"{k}={v}" for k, v in (case[5] if len(case) > 5 else {}).items())
        assert (run.nvml_peak, run.allocated, run.reserved) == (
            real["nvml_peak_used"], real["max_memory_allocated"], real["max_memory_reserved"])
        assert (run.memest_allocated, run.memest_reserved) == (est["allocated"], est["reserved"])


def test_probe_stages_are_the_measured_json_and_repeatable():
    probe = json.loads((ROOT / "benchmarks" / "gpu-probe.json").read_text())["overhead"]
    for mode, runs in probe.items():
        stages = [{k: (v["nvml_used"], v["reserved"]) for k, v in run.items() if isinstance(v, dict)} for run in runs]
        assert all(s == stages[0] for s in stages)  # three fresh processes, identical
        assert PROBE_STAGES[mode.lower()] == stages[0]


def test_shipped_profile_agrees_with_the_probe_stage_by_stage():
    profile = load_profile(H100_PROFILE)  # loads on this machine, which has no GPU
    stages = {k: nvml - reserved for k, (nvml, reserved) in PROBE_STAGES["lazy"].items()}
    assert profile["context_bytes"] == stages["init"]
    assert profile["cublas_library_bytes"] == stages["cublaslt_bf16"] - stages["init"]
    assert profile["cudnn_library_bytes"] == stages["cudnn_conv"] - stages["cublaslt_bf16"]
    assert profile["nccl_library_bytes"] == stages["nccl"] - stages["sdpa_flash"]
    assert profile["cublas_workspace_bytes"] == oh.cublas_workspace_bytes((9, 0), env={})
    assert profile["provenance"]["measured_by"].startswith("memest") and profile["measured_at"]


# --------------------------------------------------------------------- defaults derived from the rows


def test_context_default_and_range_are_computed_from_the_rows():
    lazy = [r.bytes for r in oh.CONTEXTS if r.loading == oh.LAZY]
    h100 = [r.bytes for r in oh.CONTEXTS if r.loading == oh.LAZY and r.compute_capability == (9, 0)]
    unknown = oh.context_spread((8, 0), oh.LAZY)  # no A100 row: the median of all generations
    assert (unknown.low, unknown.expected, unknown.high) == (min(lazy), int(statistics.median(lazy)), max(lazy))
    assert oh.context_spread((9, 0), oh.LAZY).expected == int(statistics.median(h100))
    assert oh.context_spread((8, 6), oh.LAZY).expected == 256 * MiB  # the RTX 3090 row
    # a different table gives a different default: nothing is typed in
    rows = (oh.Measurement(oh.LAZY, 100, "a", (8, 0), "", "", ""), oh.Measurement(oh.LAZY, 300, "b", None, "", "", ""),
            oh.Measurement(oh.LAZY, 500, "c", None, "", "", ""))
    assert oh.context_spread((8, 0), oh.LAZY, rows) == oh.Spread(100, 100, 500, oh.context_spread((8, 0), oh.LAZY, rows).basis)
    assert oh.context_spread((7, 5), oh.LAZY, rows).expected == 300
    assert all(r.source.startswith(("https://", "benchmarks/")) and r.measured for r in oh.CONTEXTS)


def fake_run(overhead_mib: float, cudnn=False, reserved=1000 * MiB, memest_reserved=1000 * MiB, allocated=900 * MiB,
             memest_allocated=900 * MiB, options=""):
    context = PROBE_STAGES["lazy"]["init"][0] - PROBE_STAGES["lazy"]["init"][1]
    return Run("m", 1, None, "adamw", "fp32", options, cudnn, reserved + context + int(overhead_mib * MiB),
               allocated, reserved, memest_allocated, memest_reserved)


def test_library_costs_are_whole_processes_minus_their_context():
    runs = (fake_run(200), fake_run(210), fake_run(260, cudnn=True), fake_run(250, cudnn=True), fake_run(220))
    plain, conv = oh.library_spread(oh.LAZY, False, runs), oh.library_spread(oh.LAZY, True, runs)
    assert (plain.low, plain.expected, plain.high) == (200 * MiB, 210 * MiB, 260 * MiB)
    assert conv.expected == 255 * MiB and (conv.low, conv.high) == (plain.low, plain.high)
    h100 = [r.process_overhead for r in MEASURED_RUNS]  # the real rows: 742-762 MiB over a 518 MiB context
    spread = oh.library_spread(oh.LAZY, False)
    assert spread.low == min(h100) - 518 * MiB and spread.high == max(h100) - 518 * MiB


def test_eager_library_cost_is_zero_where_the_context_evidence_already_held_the_libraries():
    """Pre-1.13 wheels linked cuBLAS/cuDNN statically and, before CUDA 11.7, loaded their kernels with the
    context: an eager context measured on such a stack already holds them (overheads.STATIC_LIBRARIES)."""
    stages = {k: n - r for k, (n, r) in PROBE_STAGES["eager"].items()}
    probe = stages["cublaslt_bf16"] - stages["init"]
    v100 = oh.library_spread(oh.EAGER, False, compute_capability=(7, 0))  # the 2022 V100 row: libraries held
    h100 = oh.library_spread(oh.EAGER, False, compute_capability=(9, 0))  # this project's H100: loaded at first use
    assert (v100.low, v100.expected, v100.high) == (0, 0, probe)
    assert (h100.low, h100.expected, h100.high) == (0, probe, probe)
    assert "pull/79280" in v100.basis and "issues/107667" in v100.basis
    held = {r.gpu for r in oh.CONTEXTS if r.libraries_loaded}
    assert held == {"GTX 1080", "RTX 3090", "Tesla V100-SXM2 16GB"}
    assert all(r.loading == oh.EAGER for r in oh.CONTEXTS if r.libraries_loaded)
    # computed from the rows: a table without such a row adds the probe's value everywhere
    rows = (oh.Measurement(oh.EAGER, 100, "a", (7, 0), "", "", ""),
            oh.Measurement(oh.EAGER, 900, "b", (8, 0), "", "", "", libraries_loaded=True))
    assert oh.library_spread(oh.EAGER, False, compute_capability=(7, 0), contexts=rows).expected == probe
    assert oh.library_spread(oh.EAGER, False, compute_capability=(8, 0), contexts=rows).expected == 0
    # lazy loading is unchanged: the libraries always load at first use
    assert oh.library_spread(oh.LAZY, False).low > 0


def test_allocator_band_from_runs_where_the_tensors_were_right():
    runs = (
        fake_run(0, reserved=1030 * MiB, memest_reserved=1000 * MiB, memest_allocated=1000 * MiB, allocated=1000 * MiB),
        fake_run(0, reserved=980 * MiB, memest_reserved=1000 * MiB, memest_allocated=1000 * MiB, allocated=1000 * MiB),
        # allocated off by more than ALLOCATED_WITHIN: a missing tensor, not the allocator's slack
        fake_run(0, reserved=2000 * MiB, memest_reserved=1000 * MiB, memest_allocated=1000 * MiB,
                 allocated=int(1000 * MiB * (1 + 2 * ALLOCATED_WITHIN))),
        fake_run(0, reserved=3000 * MiB, memest_reserved=1000 * MiB, options="cudnn_benchmark=True"),  # not modelled
    )
    band = slack_band(False, runs)
    assert (band.low, band.high, band.runs) == (pytest.approx(-0.02), pytest.approx(0.03), 2)
    only_over = slack_band(False, runs[:1])
    assert only_over.low == 0.0  # widened to include the replay's own value


def test_device_range_arithmetic_on_a_hand_trace():
    trace = hand_trace([12 * MiB, -0, 14 * MiB])  # reserved 26 MiB, allocated 14 MiB (test_device_overheads)
    usage = device_usage(trace, (8, 0), env={}, calibration={"cublas_workspace_bytes": 0})
    outside = [c for c in usage.fixed_costs if not c.in_allocator]
    assert [c.name for c in outside] == ["cuda_context", "cuda_libraries"]
    band = slack_band(False)
    low_r, high_r = band.bounds(14 * MiB, 26 * MiB, floor=14 * MiB)
    assert usage.bytes_expected == usage.device_bytes == 26 * MiB + sum(c.bytes for c in outside)
    assert usage.bytes_low == low_r + sum(c.low for c in outside)
    assert usage.bytes_high == high_r + sum(c.high for c in outside)
    assert usage.needed_bytes_expected == usage.min_budget_bytes
    assert usage.needed_bytes_low <= usage.needed_bytes_expected <= usage.needed_bytes_high
    assert usage.range_basis and any("CUDA context" in line for line in usage.range_basis)


def test_cudnn_steps_load_cudnn_and_world_size_loads_nccl():
    plain = {c.name: c for c in oh.fixed_costs((9, 0), env={})}
    conv = {c.name: c for c in oh.fixed_costs((9, 0), env={}, cudnn=True)}
    assert conv["cuda_libraries"].bytes >= plain["cuda_libraries"].bytes
    eager = {c.name: c for c in oh.fixed_costs((9, 0), env={"CUDA_MODULE_LOADING": "EAGER"}, cudnn=True)}
    stages = {k: n - r for k, (n, r) in PROBE_STAGES["eager"].items()}
    assert eager["cuda_libraries"].bytes == stages["cudnn_conv"] - stages["init"]
    dist = {c.name: c for c in oh.fixed_costs((9, 0), world_size=2, env={})}
    assert dist["nccl_communicator"].bytes == stages["nccl"] - stages["sdpa_flash"]  # same in both modes


def test_a_calibration_replaces_each_component_and_removes_its_spread():
    profile = load_profile(H100_PROFILE)
    costs = {c.name: c for c in oh.fixed_costs((9, 0), env={}, calibration=profile, cudnn=True)}
    assert costs["cuda_context"].calibrated and costs["cuda_context"].low == costs["cuda_context"].high
    assert costs["cuda_libraries"].bytes == profile["cublas_library_bytes"] + profile["cudnn_library_bytes"]
    # measured under lazy loading: it does not describe an eager process
    eager = {c.name: c for c in oh.fixed_costs((9, 0), env={"CUDA_MODULE_LOADING": "EAGER"}, calibration=profile)}
    assert not eager["cuda_context"].calibrated


# ------------------------------------------------------------------------------------- the verdict


def test_verdict_boundaries():
    expected, high = 1000, 1200
    assert verdict(expected, high, 1200) == FITS
    assert verdict(expected, high, 1199) == TIGHT
    assert verdict(expected, high, 1000) == TIGHT
    assert verdict(expected, high, 999) == DOES_NOT_FIT
    assert passes(FITS, strict=True) and passes(TIGHT) and not passes(TIGHT, strict=True)
    assert not passes(DOES_NOT_FIT)
    assert worst([FITS, TIGHT]) == TIGHT and worst([TIGHT, DOES_NOT_FIT, FITS]) == DOES_NOT_FIT and worst([]) is None


@pytest.fixture(scope="module")
def mlp_range():
    est = memest.estimate(model_ref("mlp"), batch=4, optim="adam")
    low, expected, high = est.needed_range
    assert low <= expected < high
    return est, expected, high


def config(tmp_path, budget: int, extra: str = "") -> str:
    path = tmp_path / f"c{budget}.yaml"
    path.write_text(f"model: {model_ref('mlp')}\nbatch: 4\noptim: adam\ngpu: {budget}B\n{extra}")
    return str(path)


def test_check_tight_passes_by_default_and_fails_with_strict(tmp_path, mlp_range):
    est, expected, high = mlp_range
    between = config(tmp_path, (expected + high) // 2)
    default = runner.invoke(app, ["check", between, "--json"])
    assert default.exit_code == 0, default.output
    doc = json.loads(default.stdout)
    assert doc["verdict"] == "tight" and doc["configs"][0]["verdict"] == "tight" and doc["strict"] is False
    assert "TIGHT" in default.stderr and "--strict" in default.stderr
    strict = runner.invoke(app, ["check", between, "--json", "--strict"])
    assert strict.exit_code == 1 and json.loads(strict.stdout)["configs"][0]["fits"] is False
    roomy = config(tmp_path, high)
    assert runner.invoke(app, ["check", roomy, "--strict"]).exit_code == 0
    short = config(tmp_path, expected - 1)
    result = runner.invoke(app, ["check", short, "--json"])
    assert result.exit_code == 1 and json.loads(result.stdout)["verdict"] == "does-not-fit"
    assert est.verdict(high) == FITS and est.verdict(expected) == TIGHT and est.verdict(expected - 1) == DOES_NOT_FIT
    table = runner.invoke(app, ["check", between])
    assert "TIGHT" in table.stdout and "counted as fitting" in table.stdout


def test_estimate_json_ranges_and_verdict(mlp_range):
    _, expected, high = mlp_range
    result = runner.invoke(app, ["estimate", model_ref("mlp"), "--batch", 4, "--optim", "adam", "--json",
                                 "--gpu", f"{(expected + high) // 2}B", "--fail-if-not-fits"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    dev = doc["device"]
    assert dev["bytes_low"] <= dev["bytes_expected"] == dev["device_bytes"] <= dev["bytes_high"]
    assert dev["needed_bytes_expected"] == doc["needed_bytes"] == dev["min_budget_bytes"]
    assert (doc["needed_bytes_low"], doc["needed_bytes_high"]) == (dev["needed_bytes_low"], dev["needed_bytes_high"])
    assert doc["verdict"] == "tight" and doc["gpus"]["rows"][0]["verdict"] == "tight"
    strict = runner.invoke(app, ["estimate", model_ref("mlp"), "--batch", 4, "--optim", "adam", "--json",
                                 "--gpu", f"{(expected + high) // 2}B", "--fail-if-not-fits", "--strict"])
    assert strict.exit_code == 1


# ---------------------------------------------------------------------------- portable calibration


def profile_entry(**over) -> dict:
    entry = {"gpu_name": "NVIDIA GeForce RTX 2080 Ti", "compute_capability": [7, 5], "driver": "550.1",
             "torch_version": "2.9.0+cu128", "cuda_version": "12.8", "module_loading": "lazy",
             "context_bytes": 300 * MiB, "cublas_library_bytes": 150 * MiB, "cudnn_library_bytes": 20 * MiB,
             "nccl_library_bytes": None, "cublas_workspace_bytes": 8519680, "measured_at": "2026-01-01T00:00:00Z",
             "source": "memest calibrate", "provenance": {"measured_by": "memest 0.1.0 calibrate"}}
    return {**entry, **over}


def test_profile_round_trip_applied_in_estimate_check_and_api(tmp_path):
    path = write_profile(profile_entry(), tmp_path / "profiles" / "rtx2080ti.json")
    assert json.loads(path.read_text())["schema"] == SCHEMA
    loaded = load_profile(path)
    assert loaded["compute_capability"] == (7, 5) and loaded["context_bytes"] == 300 * MiB

    result = runner.invoke(app, ["estimate", model_ref("mlp"), "--batch", 4, "--json", "--calibration", str(path),
                                 "--gpu", "11GB"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    costs = {c["name"]: c for c in doc["device"]["fixed_costs"]}
    assert costs["cuda_context"]["bytes"] == 300 * MiB and costs["cuda_context"]["calibrated"]
    assert costs["cuda_libraries"]["bytes"] == 150 * MiB  # no convolution: cuDNN is not loaded
    assert doc["device"]["device_bytes"] == doc["device"]["reserved_peak_bytes"] + 450 * MiB
    assert doc["gpu_arch"]["arch"] == "sm75" and "RTX 2080 Ti" in doc["calibration"]
    assert "2026-01-01" in doc["calibration"] and "rtx2080ti.json" in doc["calibration"]  # provenance shown
    # the calibrated part has no spread: only the allocator band is left
    assert doc["device"]["bytes_high"] - doc["device"]["bytes_low"] < 16 * MiB

    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"model: {model_ref('mlp')}\nbatch: 4\ngpu: 11GB\ncalibration: profiles/rtx2080ti.json\n")
    checked = runner.invoke(app, ["check", str(cfg), "--json"])
    assert checked.exit_code == 0, checked.output
    row = json.loads(checked.stdout)["configs"][0]
    assert row["needed_bytes"] == doc["needed_bytes"] and "RTX 2080 Ti" in row["calibration"]

    api = memest.estimate(model_ref("mlp"), batch=4, calibration=str(path))
    assert api.needed_bytes == doc["needed_bytes"] and api.report.device.calibrated


def test_planners_take_the_same_calibration_as_estimate(tmp_path):
    """whatif, max-batch and advise resolve --calibration through the same app layer as estimate and check."""
    path = write_profile(profile_entry(), tmp_path / "rtx2080ti.json")
    est = json.loads(runner.invoke(app, ["estimate", model_ref("mlp"), "--batch", 4, "--json", "--gpu", "11GB",
                                         "--calibration", str(path)]).stdout)
    plain = json.loads(runner.invoke(app, ["estimate", model_ref("mlp"), "--batch", 4, "--json",
                                           "--gpu", "11GB"]).stdout)
    assert est["needed_bytes"] != plain["needed_bytes"]  # the profile changes the answer
    what = runner.invoke(app, ["whatif", model_ref("mlp"), "--batch", "4", "--json", "--gpu", "11GB",
                               "--calibration", str(path)])
    assert what.exit_code == 0, what.output
    points = json.loads(what.stdout)["points"]
    assert [p["needed_bytes"] for p in points if p["batch"] == 4] == [est["needed_bytes"]]
    adv = runner.invoke(app, ["advise", model_ref("mlp"), "--batch", 4, "--json", "--gpu", "11GB",
                              "--calibration", str(path)])
    assert adv.exit_code == 0, adv.output
    mb = runner.invoke(app, ["max-batch", model_ref("mlp"), "--json", "--gpu", "11GB", "--calibration", str(path),
                             "--limit", "8"])
    assert mb.exit_code == 0, mb.output
    bad = runner.invoke(app, ["whatif", model_ref("mlp"), "--batch", "4", "--calibration", str(tmp_path / "no.json")])
    assert bad.exit_code == 2


def test_bad_profiles_and_mismatched_cards_are_one_line_errors(tmp_path):
    (tmp_path / "x.json").write_text('{"gpu_name": "x"}')
    (tmp_path / "y.json").write_text("not json")
    for path, needle in ((tmp_path / "x.json", "not a memest calibration profile"), (tmp_path / "y.json", "is not JSON"),
                         (tmp_path / "none.json", "not found")):
        result = runner.invoke(app, ["estimate", model_ref("mlp"), "--calibration", str(path)])
        assert result.exit_code == 2 and needle in result.stderr and len(result.stderr.strip().splitlines()) == 1
    bad = write_profile(profile_entry(context_bytes=-1), tmp_path / "neg.json")
    with pytest.raises(MemestError, match="context_bytes"):
        load_profile(bad)
    good = write_profile(profile_entry(), tmp_path / "p.json")
    result = runner.invoke(app, ["estimate", model_ref("mlp"), "--calibration", str(good), "--gpu", "a100"])
    assert result.exit_code == 2 and "measured on NVIDIA GeForce RTX 2080 Ti" in result.stderr


def test_shipped_profile_narrows_the_range_of_an_h100_estimate():
    plain = memest.estimate(model_ref("mlp"), batch=4, gpu="h100")
    calibrated = memest.estimate(model_ref("mlp"), batch=4, gpu="h100", calibration=str(H100_PROFILE))
    assert Path(H100_PROFILE).exists()
    width = lambda e: e.needed_range[2] - e.needed_range[0]  # noqa: E731
    assert width(calibrated) < width(plain)
    # the H100 default rests on the H100 measurements, so the calibration changes the expectation little
    assert abs(calibrated.needed_bytes - plain.needed_bytes) <= 32 * MiB

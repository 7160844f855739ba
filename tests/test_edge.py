"""The edge every command shares (issue 9): exit codes a CI gate can trust, stdout that is only
memest's, one-line errors that name the thing, budgets and units that agree across commands."""

import json
import os
import stat

import pytest

from .conftest import ROOT, model_ref, one_line_error, run


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return path


# -- 1: model code never decides memest's exit code -----------------------------------------------


@pytest.mark.parametrize("command", [
    ["estimate"], ["estimate", "--json"], ["whatif", "--batch", "2,4"], ["max-batch", "--gpu", "1GB"],
    ["advise", "--gpu", "1GB"],
])
def test_sys_exit_in_model_code_is_an_error(command):
    result = run(command[0], model_ref("exits"), *command[1:])
    line = one_line_error(result)
    assert "exits.py" in line and "sys.exit(0)" in line
    assert result.stdout == ""


def test_sys_exit_on_import_is_an_error_in_check(tmp_path):
    config = write(tmp_path, "run.yaml", f"model: {model_ref('exits_on_import')}\ngpu: 11GB\n")
    line = one_line_error(run("check", config))
    assert "exits_on_import.py" in line and "sys.exit(3)" in line


# -- 2: margins --------------------------------------------------------------------------------


def test_bare_margin_above_one_is_rejected_with_the_fix(tmp_path):
    config = write(tmp_path, "run.yaml", f"model: {model_ref('mlp')}\nbatch: 2\ngpu: 11GB\n")
    line = one_line_error(run("check", config, "--margin", "10"))
    assert "10%" in line
    bad = write(tmp_path, "bad.yaml", f"model: {model_ref('mlp')}\nbatch: 2\ngpu: 11GB\nmargin: 10\n")
    line = one_line_error(run("check", bad))
    assert "bad.yaml" in line and "10%" in line


def test_percent_and_fraction_margins_agree(tmp_path):
    config = write(tmp_path, "run.yaml", f"model: {model_ref('mlp')}\nbatch: 2\ngpu: 11GB\n")
    a = json.loads(run("check", config, "--margin", "10%", "--json").stdout)["configs"][0]
    b = json.loads(run("check", config, "--margin", "0.1", "--json").stdout)["configs"][0]
    assert a["margin"] == b["margin"] == pytest.approx(0.1)
    assert a["required_bytes"] == b["required_bytes"] > a["needed_bytes"]


# -- 3: stdout is memest's alone -----------------------------------------------------------------

FORMATS = [["--json"], ["--format", "json"], ["--markdown"], ["--format", "table"], []]


def _commands(tmp_path):
    chatty = model_ref("prints")
    config = write(tmp_path, "chatty.yaml", f"model: {chatty}\nbatch: 4\ngpu: 11GB\n")
    return {
        "estimate": ["estimate", chatty, "--batch", "4", "--gpu", "11GB"],
        "check": ["check", config],
        "whatif": ["whatif", chatty, "--batch", "2,4,8,16", "--gpu", "11GB"],
        "max-batch": ["max-batch", chatty, "--gpu", "40MiB", "--limit", "64"],
        "advise": ["advise", chatty, "--batch", "8", "--gpu", "11GB"],
    }


@pytest.mark.parametrize("command", ["estimate", "check", "whatif", "max-batch", "advise"])
def test_every_command_every_format_keeps_user_prints_off_stdout(tmp_path, command):
    for fmt in FORMATS:
        result = run(*_commands(tmp_path)[command], *fmt)
        assert result.exit_code == 0, (fmt, result.stdout, result.stderr)
        assert "number of parameters" not in result.stdout and "forward called" not in result.stdout
        assert "model file imported" not in result.stdout and "a warning from" not in result.stdout
        assert "forward called" in result.stderr  # not swallowed: the user's output is still shown
        if "json" in fmt:
            doc = json.loads(result.stdout)  # exactly one document
            assert doc["schema_version"] == 1 and "memest_version" in doc
        elif "--markdown" in fmt:
            assert "|" in result.stdout and "┃" not in result.stdout


def test_two_output_formats_are_a_usage_error():
    line = one_line_error(run("estimate", model_ref("mlp"), "--json", "--markdown"))
    assert "json" in line and "markdown" in line


@pytest.mark.parametrize("command,needle", [
    (["estimate", model_ref("mlp"), "--gpu", "1MiB", "--fail-if-not-fits"], None),
    (["max-batch", model_ref("mlp"), "--gpu", "1MiB"], None),
])
def test_exit_codes_for_does_not_fit(command, needle):
    result = run(*command)
    if command[0] == "estimate":
        assert result.exit_code == 1, result.output
    else:
        assert result.exit_code == 0 and "does not fit" in result.stdout  # an answer, not a failure


# -- 4: maximum positions ----------------------------------------------------------------------


def test_seq_beyond_the_models_positions_is_an_error():
    line = one_line_error(run("estimate", "hf:gpt2", "--seq", "4096"))
    assert "1024" in line


def test_whatif_seq_beyond_positions_fails_before_tracing():
    result = run("whatif", "hf:gpt2", "--seq", "512,4096", "--batch", "1")
    line = one_line_error(result)
    assert "1024" in line and "traced" not in result.stderr


def test_readme_examples_stay_within_the_models_positions():
    import re

    from memest.sources import load_source

    text = (ROOT / "README.md").read_text()
    examples = re.findall(r"memest \w[\w-]* (hf:[\w.-]+)[^\n`]*?--seq ([0-9,]+)", text)
    assert len(examples) >= 5, examples  # the pattern still finds the README's examples
    for model, seqs in examples:
        limit = load_source(model).max_seq
        for s in filter(None, seqs.split(",")):
            assert limit is None or int(s) <= limit, (model, s, limit)


# -- 5, 7: no budget with a fail flag; --debug never changes exit codes ---------------------------


def test_fail_if_not_fits_without_a_budget_is_a_usage_error(monkeypatch):
    from memest.device import nvml

    monkeypatch.setattr(nvml, "query_gpus", lambda: nvml.GpuQuery([], "no NVIDIA GPU visible (test)"))
    line = one_line_error(run("estimate", model_ref("mlp"), "--fail-if-not-fits"))
    assert "--gpu" in line


@pytest.mark.parametrize("args", [
    ["estimate", model_ref("mlp"), "--optim", "lion"],
    ["estimate", "does/not/exist.py"],
    ["estimate", model_ref("no_build")],
    ["check", "missing.yaml"],
    ["estimate", model_ref("mlp"), "--gpu", "11XB"],
])
def test_debug_does_not_change_exit_codes(args):
    plain, debug = run(*args), run(*args, "--debug")
    assert plain.exit_code == debug.exit_code == 2, (plain.output, debug.output)


def test_debug_prints_the_traceback_beside_the_error():
    result = run("estimate", model_ref("no_build"), "--debug")
    assert result.exit_code == 2 and "Traceback" in result.stderr and "memest: error" in result.stderr


def test_an_unexpected_exception_is_exit_2_never_0_or_1(monkeypatch):
    from memest import estimator as pipeline

    def boom(*a, **k):
        raise RuntimeError("unexpected")

    monkeypatch.setattr(pipeline, "estimate", boom)
    result = run("estimate", model_ref("mlp"))
    assert result.exit_code == 2 and "internal error" in result.stderr and result.stdout == ""


# -- 8: advise --------------------------------------------------------------------------------


def test_advise_when_it_fits_recommends_nothing_and_flags_changes_that_do_not_help():
    result = run("advise", model_ref("mlp"), "--batch", "4", "--gpu", "11GB", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["base_fits"] is True and doc["combination"] is None and doc["command"] == ""
    assert doc["headroom_bytes"] == doc["capacity_bytes"] - doc["base_needed_bytes"] > 0
    worse = [r for r in doc["remedies"] if r["needed_bytes"] >= doc["base_needed_bytes"]]
    assert worse, "this configuration has a change that raises the need (bf16 autocast adds weight copies)"
    assert all(not r["lowers_need"] and r["note"] for r in worse)
    assert all(r["lowers_need"] for r in doc["remedies"] if r["needed_bytes"] < doc["base_needed_bytes"])
    text = run("advise", model_ref("mlp"), "--batch", "4", "--gpu", "11GB").stdout
    assert "fits, with" in text and "no change needed" in text and "cheapest that fits" not in text
    assert "do not lower the need" in text


def test_advise_ranks_only_changes_that_lower_the_need():
    doc = json.loads(run("advise", model_ref("mlp"), "--batch", "64", "--gpu", "600MiB", "--json").stdout)
    assert doc["base_fits"] is False
    ranked = [r["lowers_need"] for r in doc["remedies"]]
    assert ranked == sorted(ranked, reverse=True)  # every remedy before every change that does not help
    if doc["combination"]:
        assert doc["combination"]["needed_bytes"] < doc["base_needed_bytes"]


# -- 9: whatif's "largest" lines say where they hold ------------------------------------------------


def test_whatif_largest_lines_name_the_other_dimension():
    # a token model of three layers (tests/models/seq_default.py): the same grid, 11 traces and a fit that holds, both
    # "largest" lines from the fit, as the 4-block examples/transformer.py gave; its ops made each run ~10x longer
    # (50-100 s of the file's time) and the lines' wording does not depend on the model
    model = model_ref("seq_default")
    result = run("whatif", model, "--seq", "64,128,256,512", "--batch", "1,2,4", "--gpu", "2GB")
    assert result.exit_code == 0, result.output
    doc = json.loads(run("whatif", model, "--seq", "64,128,256,512", "--batch", "1,2,4", "--gpu", "2GB", "--json").stdout)
    assert doc["largest_from"] == "fit" and doc["largest_seq"] is not None  # both lines are checked below
    if doc["largest_seq"] is not None:
        assert f"largest seq that fits at batch {doc['largest_seq_at_batch']}:" in result.stdout
    assert f"largest batch that fits at seq {doc['largest_batch_at_seq']}:" in result.stdout


# -- 11: plots ----------------------------------------------------------------------------------


def test_plot_to_an_unwritable_folder_fails_before_tracing(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        if os.access(folder, os.W_OK):
            pytest.skip("running as a user who can write anywhere")
        result = run("estimate", model_ref("prints"), "--plot", folder / "step.html")
        line = one_line_error(result)
        assert "step.html" in line and "forward called" not in result.stderr  # nothing traced
    finally:
        folder.chmod(stat.S_IRWXU)


def test_plot_into_a_missing_folder_fails_before_tracing(tmp_path):
    result = run("estimate", model_ref("prints"), "--plot", tmp_path / "nope" / "step.svg")
    line = one_line_error(result)
    assert "does not exist" in line and "forward called" not in result.stderr


def test_plot_write_is_atomic(tmp_path):
    from memest.report.plot import atomic_write

    target = tmp_path / "step.html"
    target.write_text("old plot")

    def failing(path):
        path.write_text("half a pl")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        atomic_write(target, failing)
    assert target.read_text() == "old plot" and [p.name for p in tmp_path.iterdir()] == ["step.html"]


# -- 14: check validates every config first ---------------------------------------------------------


def test_check_validates_every_config_before_tracing_any(tmp_path):
    good = write(tmp_path, "good.yaml", f"model: {model_ref('prints')}\nbatch: 2\ngpu: 11GB\n")
    bad_optim = write(tmp_path, "bad.yaml", f"model: {model_ref('mlp')}\noptim: lion\ngpu: 11GB\n")
    no_model = write(tmp_path, "gone.yaml", "model: missing_model.py\ngpu: 11GB\n")
    no_budget = write(tmp_path, "nobudget.yaml", f"model: {model_ref('mlp')}\n")
    for bad, needle in ((bad_optim, "optim: 'lion'"), (no_model, "not found"), (no_budget, "budget")):
        result = run("check", good, bad)
        line = one_line_error(result)
        assert bad.name in line and needle in line, line
        assert "forward called" not in result.stderr  # the good config was not traced first


def test_check_reports_progress_on_stderr_only(tmp_path):
    a = write(tmp_path, "a.yaml", f"model: {model_ref('mlp')}\nbatch: 2\ngpu: 11GB\n")
    b = write(tmp_path, "b.yaml", f"model: {model_ref('mlp')}\nbatch: 4\ngpu: 11GB\n")
    result = run("check", a, b, "--json")
    assert result.exit_code == 0
    assert "check 1/2" in result.stderr and "check 2/2" in result.stderr and "elapsed" in result.stderr
    assert len(json.loads(result.stdout)["configs"]) == 2


# -- 15: calibrate checks its cache before measuring ----------------------------------------------


def test_calibrate_checks_the_cache_folder_before_measuring(tmp_path, monkeypatch):
    from memest import app as app_layer
    from memest.device import calibration, nvml

    measured = []
    gpu = nvml.Gpu(0, "NVIDIA Test GPU", 16 * 2**30, 0, 16 * 2**30)
    monkeypatch.setattr(nvml, "query_gpus", lambda: nvml.GpuQuery([gpu], driver="1.0"))
    monkeypatch.setattr(calibration, "measure", lambda device: measured.append(device) or {})
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))  # a file, so memest/ cannot be made inside it
    with pytest.raises(app_layer.MemestError, match="XDG_CACHE_HOME"):
        app_layer.run_calibrate(0)
    assert measured == []


# -- 16, 18: one unit per table; the GPU generation is said, never silently changed -----------------


def _byte_cells(text):
    import re

    return re.findall(r"-?[0-9]+\.[0-9]+ (GiB|MiB|KiB)", text)


def test_check_table_uses_one_unit_and_shows_a_decimal_budget_in_its_own_unit(tmp_path):
    config = write(tmp_path, "run.yaml", f"model: {model_ref('mlp')}\nbatch: 2\ngpu: 24GB\n")
    result = run("check", config, "--format", "markdown")
    assert result.exit_code == 0
    units = set(_byte_cells(result.stdout))
    assert units == {"GiB"}, result.stdout
    assert "22.35 GiB" in result.stdout and "24GB" in result.stdout


def test_max_batch_and_whatif_tables_use_one_unit():
    mb = run("max-batch", model_ref("mlp"), "--gpu", "3GB", "--limit", "4096", "--markdown")
    assert mb.exit_code == 0, mb.output
    assert len(set(_byte_cells(mb.stdout))) == 1, mb.stdout
    wi = run("whatif", model_ref("mlp"), "--batch", "1,64,4096", "--gpu", "24GB", "--markdown")
    assert wi.exit_code == 0, wi.output
    table = wi.stdout.split("\n\n")[1] if wi.stdout.startswith("**") else wi.stdout
    assert len(set(_byte_cells(table))) == 1, wi.stdout


def test_budget_size_keeps_the_gpu_generation_and_says_which(monkeypatch):
    from memest.device import nvml

    monkeypatch.setattr(nvml, "query_gpus", lambda: nvml.GpuQuery([], "no NVIDIA GPU visible (test)"))
    plain = json.loads(run("estimate", model_ref("mlp"), "--json").stdout)
    sized = json.loads(run("estimate", model_ref("mlp"), "--gpu", "11GB", "--json").stdout)
    card = json.loads(run("estimate", model_ref("mlp"), "--gpu", "a100", "--json").stdout)
    assert plain["spec"]["compute_capability"] == sized["spec"]["compute_capability"] == [9, 0]
    assert card["spec"]["compute_capability"] == [8, 0] and "a100" in card["gpu_arch"]["why"]
    assert "default" in sized["gpu_arch"]["why"]
    assert any("sm90" in n for n in sized["notes"])


def test_budget_size_on_a_machine_with_a_gpu_models_that_gpu(monkeypatch):
    from memest.device import nvml

    gpu = nvml.Gpu(0, "NVIDIA A100-SXM4-80GB", 80 * 2**30, 2**30, 79 * 2**30)
    monkeypatch.setattr(nvml, "query_gpus", lambda: nvml.GpuQuery([gpu], driver="1.0"))
    sized = json.loads(run("estimate", model_ref("mlp"), "--gpu", "11GB", "--json").stdout)
    assert sized["spec"]["compute_capability"] == [8, 0] and "A100" in sized["gpu_arch"]["why"]
    assert sized["gpus"]["rows"][0]["capacity_bytes"] == 11 * 10**9


def test_long_work_reports_progress_on_stderr_with_elapsed_time():
    import time

    from memest.app import ticker

    seen = []
    with ticker("tracing demo", seen.append, after=0.05, every=0.05):
        time.sleep(0.3)
    assert seen and all(s.startswith("tracing demo: ") and s.endswith(" s") for s in seen)
    quiet = []
    with ticker("fast", quiet.append, after=5):
        pass
    assert quiet == []  # short work says nothing


def test_a_bad_allocator_setting_is_a_one_line_error(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:1")
    line = one_line_error(run("estimate", model_ref("mlp")))
    assert "PYTORCH_CUDA_ALLOC_CONF" in line and "max_split_size_mb" in line


@pytest.mark.parametrize("fmt", FORMATS)
def test_matrix_gpus_calibrate_and_not_fitting(tmp_path, fmt):
    from memest.device import nvml

    gpus = run("gpus", *fmt)
    assert gpus.exit_code == 0, gpus.output
    if "json" in fmt:
        assert "gpus" in json.loads(gpus.stdout)
    if not nvml.query_gpus().gpus:  # this machine has no GPU: calibrate says so, exit 2, nothing on stdout
        calibrate = run("calibrate", *[f for f in fmt if f != "--markdown"])
        assert calibrate.exit_code == 2 and calibrate.stdout == "" and "NVIDIA GPU" in calibrate.stderr
    tight = write(tmp_path, "tight.yaml", f"model: {model_ref('prints')}\nbatch: 4\ngpu: 1MiB\n")
    result = run("check", tight, *fmt)
    assert result.exit_code == 1, result.output
    if "json" in fmt:
        assert json.loads(result.stdout)["fits"] is False
    bad = run("check", write(tmp_path, "bad.yaml", "model: [\n"), *fmt)
    assert bad.exit_code == 2 and bad.stdout == ""


def test_cli_start_up_does_not_import_torch():
    import subprocess
    import sys

    code = ("import sys; from memest.cli import app; from memest.report.text import ascii_fallback_streams; "
            "ascii_fallback_streams(); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.stdout.strip() == "False", out.stderr  # --help and usage errors stay instant

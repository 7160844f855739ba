"""Issue 22, what is left of items 30 and 35: installed libraries' chatter kept off stderr unless --debug
(item 30: bitsandbytes' "Failed to load CPU gemm_4bit_forward ..." opened every --lora run's CI log), and the
plots drawing the budget and the needed line, a pipeline plot's title naming its rank (item 35)."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import sys
import textwrap
import warnings

import pytest

from memest.exits import library_noise_hidden
from memest.imports import keep_library_message, library_output_kept, quiet_library_import

from .conftest import ROOT

TINY_LLAMA = "hf:tests/configs/llama-tiny.json"
FAILED = "Failed to load CPU gemm_4bit_forward"

# bitsandbytes logs FAILED while peft imports it, on a CPU with AVX512-BF16 and without the `kernels` package
# (bitsandbytes/backends/cpu/ops.py, 0.50.x). This machine's CPU has no AVX512-BF16, so the subprocess gets a
# sitecustomize that makes bitsandbytes' own probe (functional.has_avx512bf16) answer True: bitsandbytes then
# runs its real branch and logs its real message. It also writes one line straight to file descriptor 2 while
# bitsandbytes.functional loads, as a C extension's fprintf would.
SITECUSTOMIZE = textwrap.dedent('''
    import importlib.abc, importlib.util, os, sys

    class AVX512BF16(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != "bitsandbytes.functional":
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                module.has_avx512bf16 = lambda: True
                os.write(2, b"FD2-WRITE-FROM-A-LIBRARY\\n")

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, AVX512BF16())
''')


def _memest(tmp_path, *args) -> subprocess.CompletedProcess:
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{ROOT}", "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "memest", *map(str, args)], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=300)


@pytest.mark.skipif(not all(importlib.util.find_spec(m) for m in ("peft", "bitsandbytes")),
                    reason="needs peft and bitsandbytes")
@pytest.mark.skipif(importlib.util.find_spec("kernels") is not None, reason="bitsandbytes logs it without `kernels`")
def test_lora_run_keeps_bitsandbytes_noise_off_stderr_unless_debug(tmp_path):
    args = ["estimate", TINY_LLAMA, "--batch", "1", "--seq", "16", "--lora", "r=4", "--json"]
    quiet = _memest(tmp_path, *args)
    assert quiet.returncode == 0, quiet.stderr
    json.loads(quiet.stdout)  # stdout: one JSON document
    assert "Failed" not in quiet.stderr
    assert "FD2-WRITE-FROM-A-LIBRARY" not in quiet.stderr
    assert "Warning" not in quiet.stderr  # transformers' FutureWarning from its own files

    debug = _memest(tmp_path, *args, "--debug")
    assert debug.returncode == 0, debug.stderr
    assert json.loads(debug.stdout)["peak_allocated_bytes"] == json.loads(quiet.stdout)["peak_allocated_bytes"]
    assert FAILED in debug.stderr
    assert "FD2-WRITE-FROM-A-LIBRARY" in debug.stderr


def test_lora_error_still_reaches_stderr(tmp_path):
    """memest's own error is never kept away: one line, exit 2."""
    pytest.importorskip("peft")
    proc = _memest(tmp_path, "estimate", TINY_LLAMA, "--batch", "1", "--seq", "16", "--lora", "r=100000")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith("memest: error:") and "r=100000" in lines[-1], proc.stderr
    assert not any(FAILED in line for line in lines)


def test_fd2_writes_during_a_library_import_are_kept(capfd):
    with library_output_kept() as kept:
        with quiet_library_import():
            os.write(2, b"written by C code\n")
            print("printed to sys.stderr", file=sys.__stderr__, flush=True)  # the CLI's sys.stderr: fd 2
    assert capfd.readouterr().err == ""
    assert "written by C code" in "".join(kept) and "printed to sys.stderr" in "".join(kept)


def test_without_keeping_a_library_import_writes_through(capfd):
    with quiet_library_import():
        os.write(2, b"written by C code\n")
    assert "written by C code" in capfd.readouterr().err


def test_an_import_that_fails_shows_what_it_wrote(capfd):
    with library_output_kept() as kept, pytest.raises(ImportError):
        with quiet_library_import():
            os.write(2, b"why it failed\n")
            raise ImportError("no module named x")
    assert "why it failed" in capfd.readouterr().err
    assert kept == []


def test_library_log_records_and_warnings_are_kept_errors_shown(capfd):
    bnb = logging.getLogger("bitsandbytes")
    before = (bnb.propagate, list(bnb.handlers))
    with library_noise_hidden(debug=False):
        logging.getLogger("bitsandbytes.backends.cpu.ops").warning("Failed to load something: %s", "x")
        logging.getLogger("peft.tuners").error("peft error record")
        warnings.warn_explicit("a library's warning", FutureWarning, "/x/site-packages/lib/mod.py", 3)
        warnings.warn_explicit("the user's warning", UserWarning, "/home/user/model.py", 7)
    err = capfd.readouterr().err
    assert "Failed to load something" not in err and "a library's warning" not in err
    assert "peft error record" in err and "the user's warning" in err
    assert (bnb.propagate, list(bnb.handlers)) == before  # the logger as it was


def test_keep_outside_the_cli_keeps_nothing():
    assert keep_library_message("x") is False


# ---- item 35: the budget and the needed line; a pipeline plot's rank ---------------------------------


@pytest.fixture(scope="module")
def mlp_2gb():
    """examples/mlp.py estimated as the CLI does with --gpu 2GB (a budget of 2 * 10^9 bytes)."""
    from memest.app import run_estimate
    from memest.report.timeline import category_timeline

    from .conftest import model_ref

    result = run_estimate({"model": model_ref("mlp"), "batch": 32, "optim": "adam"}, "2GB")
    return result, category_timeline(result.estimate.trace)


def _lines(result):
    from memest.report.plot import budget_lines

    return budget_lines(result.estimate.needed_bytes, [(row.label, row.capacity_bytes) for row in result.fits])


def test_matplotlib_plot_draws_the_budget_and_the_needed_line(mlp_2gb):
    pytest.importorskip("matplotlib")
    from memest.report.plot import _matplotlib_figure, display_unit

    result, timeline = mlp_2gb
    assert [row.capacity_bytes for row in result.fits] == [2 * 10**9]
    figure = _matplotlib_figure(timeline, result.report, _lines(result))
    ax = figure.axes[0]
    _, size = display_unit(timeline.peak.bytes)
    drawn = {line.get_gid(): line.get_ydata()[0] * size for line in ax.get_lines() if line.get_gid()}
    assert drawn["memest-budget"] == pytest.approx(2 * 10**9)
    assert drawn["memest-needed"] == pytest.approx(result.estimate.needed_bytes)
    assert result.estimate.needed_bytes > timeline.peak.bytes  # cuda: + allocator rounding and the CUDA context
    top = ax.get_ylim()[1] * size
    assert top > 2 * 10**9 and top > result.estimate.needed_bytes  # both inside the axes
    labels = {t.get_gid(): t.get_text() for t in ax.texts if t.get_gid()}
    assert "2GB" in labels["memest-budget-label"] and "needed" in labels["memest-needed-label"]


def test_a_budget_far_above_the_step_is_named_not_drawn(mlp_2gb):
    pytest.importorskip("matplotlib")
    from memest.report.plot import OFF_CHART, _matplotlib_figure, budget_lines, display_unit

    result, timeline = mlp_2gb
    far = 100 * OFF_CHART * result.estimate.needed_bytes
    figure = _matplotlib_figure(timeline, result.report, budget_lines(result.estimate.needed_bytes, [("budget far", far)]))
    ax = figure.axes[0]
    _, size = display_unit(timeline.peak.bytes)
    gids = {line.get_gid() for line in ax.get_lines()}
    assert "memest-needed" in gids and "memest-budget" not in gids
    assert ax.get_ylim()[1] * size < far
    above = [t.get_text() for t in ax.texts if t.get_gid() == "memest-above"]
    assert len(above) == 1 and "budget far" in above[0]


def test_no_budget_no_lines():
    from memest.report.plot import budget_lines

    assert budget_lines(10**9, []) == []


def test_html_plot_draws_the_lines_at_their_heights(mlp_2gb, tmp_path):
    import xml.etree.ElementTree as ET

    from memest.report.plot import plot_timeline

    result, timeline = mlp_2gb
    text = plot_timeline(timeline, result.report, tmp_path / "step.html", _lines(result)).read_text()
    root = ET.fromstring(text[text.index("<svg"): text.index("</svg>") + len("</svg>")])
    ns = "{http://www.w3.org/2000/svg}"
    lines = {el.get("class"): float(el.get("y1")) for el in root.iter(f"{ns}line") if el.get("class")}
    assert set(lines) == {"memest-budget", "memest-needed"}
    assert lines["memest-budget"] < lines["memest-needed"]  # SVG y grows downwards: the budget is higher
    titles = {el.get("class"): el.find(f"{ns}title").text for el in root.iter(f"{ns}line") if el.get("class")}
    assert "2GB" in titles["memest-budget"]


def test_cli_plot_with_a_budget_writes_both_lines(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "step.svg"
    proc = _memest(tmp_path, "estimate", "examples/mlp.py", "--batch", "32", "--gpu", "2GB", "--plot", out)
    assert proc.returncode == 0, proc.stderr
    svg = out.read_text()
    assert 'id="memest-budget"' in svg and 'id="memest-needed"' in svg
    cpu = tmp_path / "cpu.svg"  # --target cpu: the need is the peak (about 400 MiB), 1GB within 4x of it
    proc = _memest(tmp_path, "estimate", "examples/mlp.py", "--batch", "32", "--gpu", "1GB", "--target", "cpu",
                   "--plot", cpu)
    assert proc.returncode == 0, proc.stderr
    assert 'id="memest-budget"' in cpu.read_text() and 'id="memest-needed"' in cpu.read_text()


def test_a_pipeline_plot_names_the_rank_the_document_reports(tmp_path):
    """The plot is the timeline of the stage whose figures the document reports, and its title says which."""
    pytest.importorskip("matplotlib")
    out = tmp_path / "pp.svg"
    proc = _memest(tmp_path, "estimate", TINY_LLAMA, "--batch", "2", "--seq", "32", "--pp", "2", "--world-size", "2",
                   "--target", "cpu", "--gpu", "1GB", "--plot", out, "--json")
    assert proc.returncode in (0, 1), proc.stderr
    doc = json.loads(proc.stdout)
    stage = next(s["stage"] for s in doc["pipeline_stages"] if s["peak_allocated_bytes"] == doc["peak_allocated_bytes"])
    svg = out.read_text()
    assert f"pipeline rank {stage} of 2" in svg
    from memest.units import format_bytes

    assert f"peak {format_bytes(doc['peak_allocated_bytes'])}" in svg


# ---- item 34: the --compile time the docs give is the measured one --------------------------------


def test_the_docs_give_the_measured_compile_time():
    bench = json.loads((ROOT / "benchmarks" / "compile-time.json").read_text())
    compiled = next(r for r in bench["results"] if "--compile" in r["command"])
    assert compiled["command"].startswith("memest estimate tests/models/nanogpt.py --compile --target cpu")
    assert len(compiled["runs"]) >= 3
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert f"took {compiled['wall_median']:.0f} s wall" in readme
    assert f"{compiled['wall_min']:.0f}–{compiled['wall_max']:.0f} s (median of {len(compiled['runs'])}" in readme
    usage = " ".join((ROOT / "docs" / "usage.md").read_text().split())
    assert "5–15 s" not in usage and f"{compiled['wall_median']:.0f} s wall" in usage

"""What people read: tables that never truncate a number at 80 columns, repeated blocks collapsed into
one honest row, and output that survives a terminal without UTF-8."""

import os
import re
import subprocess
import sys

import pytest
from rich.console import Console

from memest.device.fit import FitRow
from memest.estimator import estimate
from memest.report.console import fit_table, layer_table, print_estimate
from memest.report.layers import select_layers
from memest.report.markdown import estimate_markdown
from memest.report.text import ascii_text
from memest.spec import RunSpec
from memest.units import format_bytes

from .conftest import ROOT, model_ref


@pytest.fixture(scope="module")
def gpt2():
    return estimate(RunSpec(model="hf:gpt2", batch=1, seq=64)).report


@pytest.fixture(scope="module")
def long_names():
    return estimate(RunSpec(model=model_ref("long_names"), batch=4)).report


def render(renderable, width):
    console = Console(width=width, record=True, file=open(os.devnull, "w"))
    console.print(renderable)
    return console.export_text()


@pytest.mark.parametrize("which", ["gpt2", "long_names"])
def test_numbers_are_never_truncated_at_80_columns(which, request):
    report = request.getfixturevalue(which)
    text = render(layer_table(report, 3, width=80), 80)
    assert "…" not in text
    assert max(len(line) for line in text.splitlines()) <= 80
    for line in select_layers(report.layers, 3):
        assert format_bytes(line.bytes_at_peak) in text  # the columns that matter most stay, in full
        assert f"{100 * line.share_of_peak:.1f}%" in text


def test_narrow_tables_say_which_columns_were_left_out(gpt2):
    narrow, wide = render(layer_table(gpt2, 3, width=80), 80), render(layer_table(gpt2, 3, width=200), 200)
    assert "left out at this width" in narrow and "output shape" in narrow
    assert "left out" not in wide and "[1, 64, 768]" in wide


def test_whole_estimate_and_fit_table_at_80_columns(gpt2):
    rows = [FitRow("GPU 0 NVIDIA H100 80GB HBM3 (free)", 80 * 2**30, 81 * 2**30, 2**30, 3 * 2**30, True, 77 * 2**30)]
    console = Console(width=80, record=True, file=open(os.devnull, "w"))
    print_estimate(console, gpt2, rows, "", 3)
    text = console.export_text()
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= 80
    fit = render(fit_table(rows, width=80), 80)
    assert "77.00 GiB" in fit and "80.00 GiB" in fit and "…" not in fit


def test_repeated_blocks_collapse_into_one_row_of_totals(gpt2):
    lines = select_layers(gpt2.layers, 3)
    runs = [line for line in lines if line.count > 1]
    assert len(runs) == 1 and runs[0].type == "GPT2Block ×12" and runs[0].name == "transformer.h.0–11"
    blocks = [r for r in gpt2.layers if re.fullmatch(r"transformer\.h\.[0-9]+", r.name)]
    assert len(blocks) == 12
    assert runs[0].params == sum(b.params for b in blocks)
    assert runs[0].activation_bytes == sum(b.activation_bytes for b in blocks)
    assert runs[0].bytes_at_peak == sum(b.bytes_at_peak for b in blocks)
    assert runs[0].at_peak_min == min(b.bytes_at_peak for b in blocks)
    assert not any(line.name.startswith("transformer.h.0.") for line in lines)  # children hidden
    expanded = select_layers(gpt2.layers, 3, expand=True)
    assert sum(1 for line in expanded if re.fullmatch(r"transformer\.h\.[0-9]+", line.name)) == 12
    md = estimate_markdown(gpt2, [], depth=3)
    assert "GPT2Block ×12" in md and "totals over the run" in md
    assert "GPT2Block ×12" not in estimate_markdown(gpt2, [], depth=3, expand=True)


def test_ascii_equivalents():
    assert ascii_text("a — b × 2² ≤ 3 … ▁█") == "a - b x 2^2 <= 3 ... _#"
    assert ascii_text("☃") == "?"


@pytest.mark.parametrize("env", [{"PYTHONIOENCODING": "ascii"}, {"PYTHONIOENCODING": "latin-1"}])
def test_cli_degrades_to_ascii(env):
    run_env = {**os.environ, **env}
    proc = subprocess.run(
        [sys.executable, "-m", "memest", "estimate", str(ROOT / "examples" / "mlp.py"), "--batch", "4", "--gpu", "11GB"],
        capture_output=True, env=run_env, cwd=ROOT, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")
    out = proc.stdout.decode("latin-1")
    assert "peak allocated" in out and "UnicodeEncodeError" not in proc.stderr.decode(errors="replace")
    if env["PYTHONIOENCODING"] == "ascii":
        assert all(ord(ch) < 128 for ch in out)

"""One row list for the estimate's summary (report/summary.py): the console and Markdown render the same rows,
and the report they come from is built once (frozen)."""

from __future__ import annotations

import dataclasses
import io
import re

import pytest
from rich.console import Console

from memest.estimator import estimate
from memest.report.console import print_estimate
from memest.report.markdown import estimate_markdown
from memest.report.summary import RowKind, summary_rows
from memest.spec import RunSpec

from .conftest import model_ref


@pytest.fixture(scope="module")
def offloaded():
    """A data-parallel, optimizer-offloaded CUDA step: parallel, host-memory and fixed-cost rows."""
    spec = RunSpec(model=model_ref("hf:llama-tiny"), batch=2, seq=32, target="cuda", world_size=2, shard="zero3",
                   offload="optimizer")
    return estimate(spec, notes=["a note of the caller"]).report


def _console(report) -> str:
    console = Console(file=io.StringIO(), width=400, color_system=None)
    print_estimate(console, report, [], "no GPU", 1)
    return console.file.getvalue()


def test_rows_are_in_order_and_complete(offloaded):
    rows = summary_rows(offloaded)
    labels = [r.label for r in rows if r.kind is not RowKind.NOTE and r.label]
    assert labels == ["run", "attention", "data parallel", "host memory", "parameters", "peak allocated", "peak happens",
                      "parameters", "gradients", "optimizer state", "activations", "temporaries",
                      "other (buffers, inputs)", "torch would report", "predicted device use", "needed",
                      "folklore formula", "traced in"]
    costs = [r.value for r in rows if not r.label and r.value.startswith("+ ")]
    assert any("cuda context" in c for c in costs) and any("nccl" in c for c in costs)
    notes = [r.value for r in rows if r.kind is RowKind.NOTE]
    assert notes == offloaded.notes and notes[-1] == "a note of the caller"
    parts = [r for r in rows if r.kind is RowKind.PART]
    assert abs(sum(float(r.detail.rstrip("%")) for r in parts) - 100) < 0.5  # the shares of the peak


def test_console_and_markdown_render_the_same_rows(offloaded):
    text, md = _console(offloaded), estimate_markdown(offloaded, [], depth=1)
    for row in summary_rows(offloaded):
        if row.label:
            assert row.label in text and (row.label in md), row.label
        plain = row.value if row.kind is not RowKind.NOTE else row.value[:60]
        assert plain in text.replace("\n", " ") or plain in re.sub(r"\s+", " ", text), plain
        assert plain in md.replace("`", ""), plain
    # the rows Markdown lacked before its summary came from the same list
    for label in ("data parallel", "host memory", "traced in"):
        assert f"- **{label}**: " in md
    assert "  - \\+ cuda context " in md  # a fixed cost nests under "torch would report", no list marker


def test_markdown_shows_names_as_code_and_headlines_bold(offloaded):
    md = estimate_markdown(offloaded, [], depth=1)
    assert f"op `{offloaded.op_at_peak}`" in md
    assert "- **peak allocated**: **" in md and "- **needed**: **" in md


def test_the_report_is_frozen(offloaded):
    with pytest.raises(dataclasses.FrozenInstanceError):
        offloaded.notes = []
    with pytest.raises(dataclasses.FrozenInstanceError):
        offloaded.layers[0].bytes_at_peak = 0

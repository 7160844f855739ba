"""benchmarks/gpu-recipes.md (issue 23's published-figures table) agrees with its JSON: each row's error and each
figure type's median and max |error| are recomputed from the measured and memest bytes, every row carries a
pinned source and its settings, every miss is explained, and docs/accuracy.md quotes the same medians. No
re-tracing: the rows are traced by scripts/bench_gpu_recipes.py."""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DATA = json.loads((ROOT / "benchmarks" / "gpu-recipes.json").read_text())
TABLE = (ROOT / "benchmarks" / "gpu-recipes.md").read_text()
ROWS = DATA["rows"]
PINNED = re.compile(r"^https://github\.com/[\w.-]+/[\w.-]+/(blob/[0-9a-f]{40}/\S+|pull/\d+)$")


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f}"


def test_there_are_rows_of_both_figure_types():
    assert {r["figure"] for r in ROWS} == {"reserved", "allocated"}
    assert len(ROWS) >= 4


@pytest.mark.parametrize("row", ROWS, ids=[r["label"] for r in ROWS])
def test_each_row_has_a_pinned_source_its_settings_and_a_recomputable_error(row):
    assert PINNED.match(row["source"]), row["source"]
    assert row["setup"] and row["notes"] and row["spec"]["model"]
    assert row["figure"] in ("reserved", "allocated")
    assert row["memest_bytes"] == row["memest"][row["figure"]]
    error = 100 * (row["memest_bytes"] - row["measured_bytes"]) / row["measured_bytes"]
    assert row["error_pct"] == pytest.approx(error, abs=1e-9)
    line = next(ln for ln in TABLE.splitlines() if ln.startswith(f"| {row['group']} | {row['label']} |"))
    assert f"| {_gib(row['measured_bytes'])} | {_gib(row['memest_bytes'])} | {error:+.1f}% |" in line
    assert f"[source]({row['source']})" in line


@pytest.mark.parametrize("figure", ["reserved", "allocated"])
def test_medians_and_maxima_are_recomputed_from_the_rows(figure):
    errors = [abs(100 * (r["memest_bytes"] - r["measured_bytes"]) / r["measured_bytes"]) for r in ROWS
              if r["figure"] == figure]
    s = DATA["summary"][figure]
    assert s["rows"] == len(errors)
    assert s["median_abs_error_pct"] == pytest.approx(statistics.median(errors), abs=1e-9)
    assert s["max_abs_error_pct"] == pytest.approx(max(errors), abs=1e-9)
    assert (f"| {figure} | {len(errors)} | {statistics.median(errors):.2f}% | {max(errors):.2f}% |"
            in TABLE)


def test_every_miss_is_listed_with_a_cause_and_every_skip_with_a_reason():
    misses = TABLE.split("## Misses and their causes")[1].split("\n## ")[0]
    for r in ROWS:
        if abs(r["error_pct"]) > 5 or r["inside"] is False:
            entry = next(ln for ln in misses.splitlines() if ln.startswith(f"- {r['group']} / {r['label']}:"))
            assert len(entry) > 200, entry  # the breakdown at memest's peak and the stated cause
    assert DATA["skipped"]
    for s in DATA["skipped"]:
        assert PINNED.match(s["source"]) and s["why"] and f"]({s['source']})" in TABLE


def test_the_accuracy_doc_quotes_the_tables_medians():
    doc = (ROOT / "docs" / "accuracy.md").read_text()
    para = doc.split("**Published recipes")[1].split("\n\n")[0]
    assert "benchmarks/gpu-recipes.md" in para
    for figure in ("reserved", "allocated"):
        s = DATA["summary"][figure]
        assert f"{s['median_abs_error_pct']:.1f}%" in para and f"{s['max_abs_error_pct']:.1f}%" in para


def test_isolations_are_traced_but_not_scored():
    assert DATA["isolations"], "the model-code isolation of the torchtitan row"
    labels = {r["label"] for r in ROWS}
    for r in DATA["isolations"]:
        assert r["label"] not in labels and PINNED.match(r["source"]) and r["notes"]
        assert f"| {r['group']} | {r['label']} | {_gib(r['memest']['allocated'])} | {_gib(r['memest']['reserved'])} |" in TABLE

"""The committed published-figures table for issue 24's recipes (benchmarks/gpu-finetune-recipes.md) against its
JSON: every summary recomputed from the rows, every row and every unscorable source with a public address, the
Markdown saying what the JSON holds. No tracing: scripts/bench_gpu_finetune_recipes.py writes both files."""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
JSON = ROOT / "benchmarks" / "gpu-finetune-recipes.json"
MD = ROOT / "benchmarks" / "gpu-finetune-recipes.md"
FIGURES = ("reserved", "allocated", "device")
ADDRESS = re.compile(r"^https://[^\s|]+$")


@pytest.fixture(scope="module")
def data():
    return json.loads(JSON.read_text())


@pytest.fixture(scope="module")
def md():
    return MD.read_text()


def _error(row):
    return 100 * (row["memest_bytes"] - row["measured_bytes"]) / row["measured_bytes"]


def test_scored_rows_summaries_recomputed(data):
    for figure in FIGURES:
        rows = [r for r in data["rows"] if r["figure"] == figure]
        s = data["summary"][figure]
        if not rows:
            assert s == {}, figure
            continue
        errors = [abs(_error(r)) for r in rows]
        assert s["rows"] == len(rows)
        assert s["median_abs_error_pct"] == pytest.approx(statistics.median(errors))
        assert s["max_abs_error_pct"] == pytest.approx(max(errors))
        ranged = [r for r in rows if r["low"] is not None]
        assert s["with_range"] == len(ranged)
        assert s["inside"] == sum(r["low"] <= r["measured_bytes"] and (r["high"] is None or r["measured_bytes"] <= r["high"])
                                  for r in ranged)


def test_every_scored_row_is_sourced_and_typed(data, md):
    for r in data["rows"]:
        assert ADDRESS.match(r["source"]), r["label"]
        assert r["figure"] in FIGURES
        assert r["error_pct"] == pytest.approx(_error(r))
        assert r["source"] in md
        assert f"{r['error_pct']:+.1f}%" in md


def test_markdown_states_the_scored_count(data, md):
    if data["rows"]:
        for figure in FIGURES:
            s = data["summary"][figure]
            if s:
                assert f"| {figure} | {s['rows']} | {s['median_abs_error_pct']:.2f}% |" in md
    else:  # no row scored: the page says so, with no median for these recipes
        assert "Rows scored: 0." in md
        assert f"Of the {len(data['not_scorable'])} published sources" in md


def test_every_unscorable_source_says_what_is_missing(data, md):
    assert data["not_scorable"], "the candidates searched are listed"
    table = md.split("## Cannot score")[1].split("\n## ")[0]
    lines = [ln for ln in table.splitlines() if ln.startswith("| ") and "](" in ln]
    assert len(lines) == len(data["not_scorable"])
    for n, line in zip(data["not_scorable"], lines, strict=True):
        assert ADDRESS.match(n["source"]), n
        assert n["recipe"] in ("dpo", "grpo", "vlm", "all")
        assert n["runs"].strip() and n["figure"].strip() and n["missing"].strip()
        assert f"({n['source']})" in line and n["missing"] in line


def test_fsdp_qlora_summary_recomputed(data, md):
    fq = data["fsdp_qlora"]
    assert fq["from"] == "benchmarks/gpu-scale.json"
    assert fq["rows"], "issue 24's first recipe has scored published rows"
    for figure in FIGURES:
        errors = [abs(r["error_pct"]) for r in fq["rows"] if r["figure"] == figure]
        s = fq["summary"][figure]
        if not errors:
            assert s == {}
            continue
        assert s["rows"] == len(errors)
        assert s["median_abs_error_pct"] == pytest.approx(statistics.median(errors))
        assert s["max_abs_error_pct"] == pytest.approx(max(errors))
        assert (f"| {figure} | {s['rows']} | {s['median_abs_error_pct']:.2f}% | {s['max_abs_error_pct']:.2f}% |"
                in md)
    for r in fq["rows"]:
        assert ADDRESS.match(r["source"])
        assert r["error_pct"] == pytest.approx(_error(r))
        assert f"| {r['label']} | {r['shard']} | {r['figure']} |" in md


def test_accuracy_doc_quotes_the_table(data):
    doc = (ROOT / "docs" / "accuracy.md").read_text()
    para = doc.split("**Published fine-tuning recipes**")[1].split("\n- **")[0]
    fq = data["fsdp_qlora"]["summary"]
    for figure in FIGURES:
        if fq[figure]:
            assert f"{fq[figure]['median_abs_error_pct']:.2f}%" in para, figure
    assert f"{len(data['rows'])} rows scored" in para
    assert f"{len(data['not_scorable'])} published sources" in para
    taken = sum(n.get("memest") is True for n in data["not_scorable"])
    assert f"({taken} taken;" in para


def test_memest_column_matches_memests_option_checks(data, md):
    """Where a source states settings memest has flags for, the table records whether memest takes them: rechecked
    here with RunSpec (option checks only, no trace), so a refusal lifted or added later shows up."""
    from memest.errors import MemestError
    from memest.spec import RunSpec

    checked = [n for n in data["not_scorable"] if "spec" in n]
    assert checked, "some candidates state enough to be written as memest flags"
    for n in checked:
        try:
            RunSpec(model="hf:qwen2.5-7b", **n["spec"])
            now = True
        except MemestError as exc:
            now = str(exc).strip().splitlines()[0]
        assert n["memest"] == now, n["source"]
        said = "takes" if now is True else f"refuses: {now}"
        assert any(n["source"] in ln and ln.rstrip().endswith(f"| {said} |") for ln in md.splitlines()), n["source"]

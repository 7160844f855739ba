"""The views people look at: the category timeline, its terminal sparkline, plots and Markdown."""

import sys
import xml.etree.ElementTree as ET

import pytest

from memest.device.fit import fit_rows
from memest.errors import MemestError
from memest.features.registry import trace_step
from memest.report.analysis import analyse
from memest.report.markdown import escape_cell, estimate_markdown, table_markdown
from memest.report.plot import plot_timeline, timeline_svg
from memest.report.timeline import BLOCKS, category_timeline, terminal_timeline
from memest.sources import load_source
from memest.spec import RunSpec
from memest.trace.events import Category, Phase, StorageRecord, Trace


@pytest.fixture(scope="module")
def traced():
    from tests.conftest import model_ref

    spec = RunSpec(model=model_ref("mlp"), batch=8, target="cpu")
    source = load_source(spec.model)
    trace = trace_step(source, spec)
    return trace, analyse(trace, spec, source.name)


def synthetic_trace(n_events: int, peak_at: int) -> Trace:
    """Parameters, then a saw of temporaries and activations with one spike at ``peak_at``."""
    trace = Trace()
    cats = [Category.TEMPORARIES, Category.ACTIVATIONS, Category.GRADIENTS]

    def alloc(nbytes, cat, phase=Phase.FORWARD):
        trace.storages.append(StorageRecord(nbytes, cat, "m", phase, "op", 1))
        trace.events.append((len(trace.storages) - 1, nbytes))
        return len(trace.storages) - 1

    alloc(1000, Category.PARAMETERS, Phase.SETUP)
    alloc(10, Category.INPUTS, Phase.SETUP)
    live = []
    while len(trace.events) < n_events:
        i = len(trace.events)
        if i == peak_at:
            sid = alloc(5000, Category.TEMPORARIES)
            trace.events.append((sid, -5000))  # freed by the next event: a one-event spike
        elif live and (i % 3 == 0 or len(live) > 20):
            sid = live.pop(0)
            trace.events.append((sid, -trace.storages[sid].nbytes))
        else:
            live.append(alloc(1 + (i * 37) % 97, cats[i % 3]))
    third = n_events // 3
    trace.phase_marks = [(2, 1, Phase.FORWARD), (third, 1, Phase.BACKWARD), (2 * third, 1, Phase.OPTIMIZER)]
    return trace


# ---- category_timeline ---------------------------------------------------------------------------


@pytest.mark.parametrize("max_points", [2000, 60, 30])
def test_timeline_keeps_the_exact_peak(traced, max_points):
    trace, report = traced
    tl = category_timeline(trace, max_points=max_points)
    peak, peak_i = trace.peak()
    assert (tl.peak.bytes, tl.peak.index) == (peak, peak_i)
    assert tl.peak.bytes == report.peak_allocated_bytes
    assert (tl.peak.iteration, tl.peak.phase, tl.peak.op) == (
        report.peak_iteration, report.phase_at_peak, report.op_at_peak)
    k = tl.index.index(peak_i)
    assert tl.total[k] == peak == max(tl.total)


@pytest.mark.parametrize("max_points", [2000, 60, 30])
def test_downsampling_bounds_and_exact_values(traced, max_points):
    trace, _ = traced
    tl = category_timeline(trace, max_points=max_points)
    n = len(trace.events)
    assert len(tl.index) <= max_points
    if max_points >= n:
        assert tl.index == list(range(n))
    assert tl.index == sorted(set(tl.index)) and tl.index[0] == 0 and tl.index[-1] == n - 1
    assert {s.start for s in tl.spans} <= set(tl.index)  # every phase boundary exact
    full = trace.timeline()
    assert tl.total == [full[i] for i in tl.index]


def test_downsampling_keeps_bucket_maxima():
    trace = synthetic_trace(100_000, peak_at=61_234)
    tl = category_timeline(trace, max_points=500)
    full = trace.timeline()
    assert len(tl.index) <= 500
    assert tl.peak.index == 61_234 and tl.peak.bytes == max(full)
    # each of 10 equal slices: its maximum is within the kept points (maxima, not strides)
    for a in range(0, 100_000, 10_000):
        assert max(t for i, t in zip(tl.index, tl.total, strict=True) if a <= i < a + 10_000) >= 0.95 * max(full[a:a + 10_000])


def test_categories_sum_to_the_total(traced):
    trace, _ = traced
    for max_points in (2000, 30):
        tl = category_timeline(trace, max_points=max_points)
        assert set(tl.series) == set(tl.categories)
        for k in range(len(tl.index)):
            assert sum(tl.series[c][k] for c in tl.categories) == tl.total[k]
    # and each category matches a recount of the storages alive at the peak
    tl = category_timeline(trace)
    k = tl.index.index(tl.peak.index)
    alive = trace.live_at(tl.peak.index)
    params = sum(trace.storages[s].nbytes for s in alive if trace.storages[s].category is Category.PARAMETERS)
    assert tl.series["parameters"][k] == params


def test_phase_spans_cover_the_events_in_order(traced):
    trace, _ = traced
    tl = category_timeline(trace)
    spans = tl.spans
    assert spans[0].start == 0 and spans[-1].end == len(trace.events)
    for a, b in zip(spans, spans[1:], strict=False):
        assert a.end == b.start and a.start < a.end
        assert (a.iteration, list(Phase).index(Phase(a.phase))) != (b.iteration, list(Phase).index(Phase(b.phase)))
    assert [(s.start, s.iteration, s.phase) for s in spans if s.phase != "setup"] == [
        (i, it, ph.value) for i, it, ph in trace.phase_marks]
    for s in spans:
        it, ph = trace.phase_at(s.start)
        assert (s.iteration, s.phase) == (it, ph.value)


def test_max_points_below_the_required_points():
    trace = synthetic_trace(1000, peak_at=500)
    with pytest.raises(ValueError, match="max_points"):
        category_timeline(trace, max_points=3)


def test_empty_trace():
    tl = category_timeline(Trace())
    assert tl.n_events == 0 and tl.index == [] and tl.peak.bytes == 0
    assert terminal_timeline(tl) == ["no memory events traced"]


def test_large_trace_is_downsampled_with_its_peak_kept():
    # speed is a benchmark's business (scripts/bench_speed.py), not a timed test's: this checks the result
    trace = synthetic_trace(100_000, peak_at=77_777)
    tl = category_timeline(trace)
    lines = terminal_timeline(tl)
    assert len(tl.index) <= 2000 and tl.peak.index == 77_777
    assert len(lines[1]) == 60


# ---- terminal_timeline ---------------------------------------------------------------------------


@pytest.mark.parametrize("width", [20, 60, 200])
def test_terminal_timeline_width_and_caret(traced, width):
    trace, _ = traced
    tl = category_timeline(trace)
    header, spark, phases, caret, legend = terminal_timeline(tl, width=width)
    assert len(spark) == width and len(phases) == width
    assert set(spark) <= set(BLOCKS)
    col = caret.index("^")
    lo = col * tl.n_events // width
    hi = max(lo + 1, (col + 1) * tl.n_events // width)
    assert lo <= tl.peak.index < hi  # the caret sits in the peak's column
    assert spark[col] == "█"
    assert "peak" in caret and "f forward" in legend and "b backward" in legend
    assert set(phases) <= set("·flboz")


def test_terminal_timeline_labels_short_phases():
    trace = synthetic_trace(1000, peak_at=500)
    trace.phase_marks.insert(1, (300, 1, Phase.LOSS))  # one event of loss inside a 60-column view
    trace.phase_marks[2] = (301, 1, Phase.BACKWARD)
    phases = terminal_timeline(category_timeline(trace), width=60)[2]
    assert "l" in phases and phases.index("f") < phases.index("l") < phases.index("b") < phases.index("o")


# ---- plots ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".png", ".svg"])
def test_matplotlib_files(traced, tmp_path, suffix):
    pytest.importorskip("matplotlib")
    trace, report = traced
    path = plot_timeline(category_timeline(trace), report, tmp_path / f"step{suffix}")
    data = path.read_bytes()
    assert len(data) > 1000
    if suffix == ".png":
        assert data.startswith(b"\x89PNG\r\n\x1a\n")
    else:
        assert b"<svg" in data
        ET.fromstring(data)  # well-formed


def test_html_is_self_contained(traced, tmp_path):
    trace, report = traced
    text = plot_timeline(category_timeline(trace), report, tmp_path / "step.html").read_text()
    assert text.lstrip().startswith("<!DOCTYPE html>") and "<html" in text
    assert "<script" not in text and "http://" not in text.replace("http://www.w3.org/2000/svg", "")
    svg = text[text.index("<svg"): text.index("</svg>") + len("</svg>")]
    root = ET.fromstring(svg)  # well-formed inline SVG
    assert root.tag.endswith("svg")
    assert report.model in text


def test_svg_names_the_peak(traced):
    trace, report = traced
    from memest.units import format_bytes

    svg = timeline_svg(category_timeline(trace), report)
    assert f"peak {format_bytes(report.peak_allocated_bytes)}" in svg
    assert "optimizer state" in svg


def test_unknown_plot_extension(traced, tmp_path):
    trace, report = traced
    with pytest.raises(MemestError, match=r"\.png, \.svg, \.html"):
        plot_timeline(category_timeline(trace), report, tmp_path / "step.jpg")


def test_missing_matplotlib_names_the_extra(traced, tmp_path, monkeypatch):
    trace, report = traced
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.ticker"):
        monkeypatch.setitem(sys.modules, name, None)  # import raises ImportError
    with pytest.raises(MemestError, match=r"pip install 'memest\[plot\]'"):
        plot_timeline(category_timeline(trace), report, tmp_path / "step.png")
    plot_timeline(category_timeline(trace), report, tmp_path / "step.html")  # HTML needs nothing


# ---- Markdown ------------------------------------------------------------------------------------


def test_table_markdown_escapes_and_aligns():
    text = table_markdown(["name|x", "bytes"], [["a|b", "1.50 GiB"], ["two\nlines", "-"], ["short"]])
    lines = text.splitlines()
    assert lines[0] == "| name\\|x | bytes |"
    assert lines[1] == "| :--- | ---: |"
    assert lines[2] == "| a\\|b | 1.50 GiB |"
    assert lines[3] == "| two<br>lines | - |"
    assert lines[4] == "| short |  |"
    assert escape_cell("a\\|b") == "a\\|b"  # already escaped: not doubled
    assert table_markdown(["a"], [["x"]], align=["center"]).splitlines()[1] == "| :---: |"


def test_estimate_markdown(traced):
    trace, report = traced
    fits = fit_rows(report.peak_allocated_bytes, "11GB", None)
    text = estimate_markdown(report, fits, depth=1)
    assert text.startswith(f"### memest: {report.model}")
    assert "**peak allocated**" in text and "#### Does it fit?" in text and "| budget 11GB" in text
    assert "| (model) | Sequential |" in text and "| 2 | Linear |" in text
    shallow = estimate_markdown(report, fits, depth=0)
    assert "| (model) | Sequential |" in shallow and "| 2 | Linear |" not in shallow
    for line in text.splitlines():
        if line.startswith("|"):
            assert line.endswith("|") and line.count(" | ") >= 1

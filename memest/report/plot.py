"""Memory over the step as a picture: PNG or SVG (matplotlib, optional: ``pip install memest[plot]``)
or a self-contained HTML page with an inline SVG drawn here (no matplotlib, no scripts, no network).

Both show the same thing: bytes alive after each event as an area stacked by category, the phases
shaded and labelled, the peak marked with its value and where it happens.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from memest.errors import MemestError
from memest.report.analysis import Report
from memest.report.timeline import PHASE_NAMES, Timeline, peak_label
from memest.units import format_bytes

# bottom to top: what stays (weights, buffers, optimizer state) under what comes and goes
STACK_ORDER = ("parameters", "other", "optimizer_state", "gradients", "activations", "temporaries")
COLOURS = {  # seaborn "deep", colour-blind distinguishable
    "parameters": "#4C72B0",
    "other": "#8C8C8C",
    "optimizer_state": "#55A868",
    "gradients": "#DD8452",
    "activations": "#C44E52",
    "temporaries": "#8172B3",
}
LABELS = {
    "parameters": "parameters",
    "other": "buffers, inputs",
    "optimizer_state": "optimizer state",
    "gradients": "gradients",
    "activations": "activations",
    "temporaries": "temporaries",
}
PHASE_SHORT = {"setup": "", "forward": "fwd", "loss": "loss", "backward": "bwd", "optimizer": "opt",
               "zero_grad": "zero", "decode": "dec"}
FORMATS = (".png", ".svg", ".html")
HEADROOM = 1.32  # y axis up to 1.32 x the peak: room above the data for the peak annotation


def plot_timeline(timeline: Timeline, report: Report | None, path: str | Path,
                  lines: Sequence[Line] = ()) -> Path:
    """Write the memory timeline to ``path``: ``.png``/``.svg`` (matplotlib) or ``.html`` (inline SVG).
    ``lines``: horizontal lines to draw (``budget_lines``: each budget and what the step needs)."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in FORMATS:
        raise MemestError(f"cannot write a plot to {str(path)!r}: use a file name ending in {', '.join(FORMATS)}")
    if suffix == ".html":
        page = html_page(timeline, report, lines)
        return atomic_write(path, lambda tmp: tmp.write_text(page, encoding="utf-8"))
    figure = _matplotlib_figure(timeline, report, lines)
    return atomic_write(path, lambda tmp: figure.savefig(tmp, format=suffix[1:], dpi=150))


def atomic_write(path: Path, write) -> Path:
    """``write(tmp)`` into a temporary file beside ``path``, then rename it over ``path``: a full disk
    or an error leaves the old file (or none), never a truncated one."""
    import os
    import tempfile

    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name[:64]}.", suffix=".tmp")  # within NAME_MAX
    os.close(fd)
    tmp = Path(name)
    try:
        write(tmp)
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o666 & ~umask)  # as a plain open() would have made it
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


# ---- shared pieces -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Line:
    """A horizontal line across the plot: ``kind`` "budget" or "needed", its label and height in bytes."""

    kind: str
    label: str
    bytes: int


LINE_STYLE = {"budget": ("#222222", "-"), "needed": ("#C44E52", "--")}  # colour, dash
OFF_CHART = 4  # a budget more than 4x the step's peak (or need) is named above the chart, not drawn


def budget_lines(needed_bytes: int | None, budgets: Sequence[tuple[str, int]]) -> list[Line]:
    """The lines a plot draws when a budget is known (issue 22, 35): each budget (``label``, capacity) and
    what the step needs (the smallest budget it runs in: peak + allocator + fixed costs; the verdict's
    figure). None without a budget."""
    if not budgets:
        return []
    out = [Line("budget", label if format_bytes(capacity) in label else f"{label}: {format_bytes(capacity)}", capacity)
           for label, capacity in budgets]
    if needed_bytes is not None:
        out.append(Line("needed", f"needed {format_bytes(needed_bytes)} (the smallest budget it runs in)",
                        needed_bytes))
    return out


def chart_lines(timeline: Timeline, lines: Sequence[Line]) -> tuple[int, list[Line], list[Line]]:
    """(the y axis's top in bytes, lines drawn, lines named above the chart): the axis reaches every line
    within OFF_CHART x the larger of the peak and the need, so a far budget does not flatten the step."""
    base = max([timeline.peak.bytes, *(x.bytes for x in lines if x.kind == "needed")], default=0)
    drawn = [x for x in lines if x.bytes <= OFF_CHART * max(base, 1)]
    top = max([base, *(x.bytes for x in drawn)], default=0)
    return max(int(top * HEADROOM), 1), drawn, [x for x in lines if x not in drawn]


def display_unit(peak: int) -> tuple[str, int]:
    """GiB from 1 GiB up, else MiB from 1 MiB up, else KiB (binary units)."""
    for name, size in (("GiB", 2**30), ("MiB", 2**20)):
        if peak >= size:
            return name, size
    return "KiB", 2**10


def title_lines(timeline: Timeline, report: Report | None) -> tuple[str, str]:
    if report is None:
        return "memory over the step", f"peak {format_bytes(timeline.peak.bytes)}"
    spec = report.spec
    run = [f"batch {spec.get('batch')}"]
    if spec.get("seq"):
        run.append(f"seq {spec['seq']}")
    if spec.get("grad_accum", 1) > 1:
        run.append(f"{spec['grad_accum']} micro-steps")
    if spec.get("mode", "train") == "train":
        run += [str(spec.get("optim")), str(spec.get("precision"))]
    else:
        run += [str(spec.get("precision")), f"mode {spec['mode']}"]
        if spec.get("new_tokens"):
            run.append(f"{spec['new_tokens']} new tokens")
    if spec.get("checkpointing", "none") != "none":
        run.append(f"checkpointing {spec['checkpointing']}")
    if spec.get("pp", 1) > 1:  # which rank this timeline is (issue 22, 35)
        run.append(f"pipeline rank {spec.get('pp_stage', 0)} of {spec['pp']}")
    if spec.get("cp", 1) > 1:
        run.append(f"context-parallel rank {spec.get('cp_rank', 0)} of {spec['cp']}")
    title = f"{report.model}: " + ", ".join(run)
    sub = [f"peak allocated {format_bytes(report.peak_allocated_bytes)}", f"target {spec.get('target')}"]
    if report.device is not None:
        sub.append(f"predicted device use {format_bytes(report.device.device_bytes)} (allocator reserved + context)")
    sub.append(f"{timeline.iterations} steps traced")
    return title, " · ".join(sub)


def _stack(timeline: Timeline) -> list[tuple[str, list[int]]]:
    """Non-empty categories in stacking order with their series."""
    return [(c, timeline.series[c]) for c in STACK_ORDER if c in timeline.series and any(timeline.series[c])]


def _at_peak(timeline: Timeline) -> dict[str, int]:
    k = timeline.index.index(timeline.peak.index) if timeline.index else 0
    return {c: s[k] for c, s in timeline.series.items()} if timeline.index else {}


def _legend_text(cat: str, at_peak: dict[str, int], peak: int) -> str:
    value = at_peak.get(cat, 0)
    return f"{LABELS[cat]}: {format_bytes(value)} ({100 * value / peak if peak else 0:.0f}%)"


def _nice_ticks(top: float, count: int = 7) -> list[float]:
    """Round tick values from 0 to at most ``top`` (in display units)."""
    if top <= 0:
        return [0.0]
    raw = top / count
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    return [i * step for i in range(int(top / step) + 1)]


def _fmt_tick(v: float) -> str:
    return f"{v:g}"


def _span_label(span, px_width: float, char_px: float) -> str:
    full, short = PHASE_NAMES.get(span.phase, span.phase), PHASE_SHORT.get(span.phase, span.phase[:1])
    if span.phase == "optimizer":
        full = "optimizer"
    for text in (full, short, short[:1]):
        if text and len(text) * char_px + 2 <= px_width:
            return text
    return ""


def _iteration_ranges(timeline: Timeline) -> list[tuple[int, int, int]]:
    """(iteration, first event, one past the last) for each traced step (setup excluded)."""
    out: dict[int, list[int]] = {}
    for s in timeline.spans:
        if s.iteration >= 1:
            r = out.setdefault(s.iteration, [s.start, s.end])
            r[0], r[1] = min(r[0], s.start), max(r[1], s.end)
    return [(it, a, b) for it, (a, b) in sorted(out.items())]


# ---- matplotlib ------------------------------------------------------------------------------------


def _matplotlib_figure(timeline: Timeline, report: Report | None, lines: Sequence[Line] = ()):
    try:
        from matplotlib.figure import Figure
        from matplotlib.ticker import FuncFormatter
    except ImportError as exc:
        raise MemestError(
            "writing a PNG or SVG plot needs matplotlib: pip install 'memest[plot]' "
            "(or write .html, which needs nothing extra)"
        ) from exc

    unit, size = display_unit(timeline.peak.bytes)
    fig = Figure(figsize=(13, 6.2))
    fig.subplots_adjust(left=0.07, right=0.76, top=0.80, bottom=0.10)
    ax = fig.add_subplot()
    n = max(timeline.n_events, 1)
    xs = list(timeline.index) + [n]  # step-post: the last value holds to the end

    stack = _stack(timeline)
    at_peak = _at_peak(timeline)
    if stack:
        ys = [[v / size for v in series] + [series[-1] / size] for _, series in stack]
        ax.stackplot(
            xs, ys, step="post", colors=[COLOURS[c] for c, _ in stack], linewidth=0,
            labels=[_legend_text(c, at_peak, timeline.peak.bytes) for c, _ in stack],
        )
    ax.set_xlim(0, n)
    top_bytes, drawn, above = chart_lines(timeline, lines)
    ax.set_ylim(0, max(top_bytes / size, 1e-9))
    _mpl_lines(ax, drawn, above, size)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: _fmt_tick(v)))
    ax.set_ylabel(f"allocated ({unit})")
    ax.set_xlabel(f"memory events in order (allocations and frees; {timeline.n_events:,} in all)")
    ax.grid(axis="y", color="#dddddd", linewidth=0.6)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)

    _mpl_phases(fig, ax, timeline, n)
    _mpl_peak(ax, timeline, n, size)

    title, sub = title_lines(timeline, report)
    fig.text(0.07, 0.965, title, fontsize=13, weight="bold", ha="left", va="top")
    fig.text(0.07, 0.925, sub, fontsize=9.5, color="#444444", ha="left", va="top")
    legend = ax.legend(
        reversed(ax.get_legend_handles_labels()[0]), reversed(ax.get_legend_handles_labels()[1]),
        loc="upper left", bbox_to_anchor=(1.02, 1.0), frameon=False, fontsize=9,
        title="alive at the peak", title_fontsize=9.5,
    )
    legend._legend_box.align = "left"
    return fig


def _mpl_phases(fig, ax, timeline: Timeline, n: int) -> None:
    from matplotlib.transforms import blended_transform_factory

    trans = blended_transform_factory(ax.transData, ax.transAxes)
    axes_px = fig.get_size_inches()[0] * 72 * ax.get_position().width  # axes width in points
    char_pt = 0.6 * 8  # approximate width of one character at font size 8
    by_iteration: dict[int, int] = {}
    for span in timeline.spans:
        k = by_iteration[span.iteration] = by_iteration.get(span.iteration, -1) + 1
        if span.iteration == 0 or k % 2 == 1:
            ax.axvspan(span.start, span.end, color="#000000", alpha=0.045, linewidth=0, zorder=0)
        if span.start > 0:
            ax.axvline(span.start, color="#999999", linewidth=0.5, zorder=0.5)
        label = _span_label(span, (span.end - span.start) / n * axes_px, char_pt)
        if label:
            ax.text((span.start + span.end) / 2, 1.012, label, transform=trans, ha="center", va="bottom",
                    fontsize=8, color="#333333")
    for it, a, b in _iteration_ranges(timeline):
        ax.axvline(a, color="#333333", linewidth=1.1, zorder=3)
        ax.text((a + b) / 2, 1.065, f"step {it}", transform=trans, ha="center", va="bottom", fontsize=9.5,
                weight="bold")


def _mpl_lines(ax, drawn: Sequence[Line], above: Sequence[Line], size: int) -> None:
    """Each line across the axes, labelled at its right end; lines off the chart named at the top right."""
    from matplotlib.transforms import blended_transform_factory

    trans = blended_transform_factory(ax.transAxes, ax.transData)
    for line in drawn:
        colour, dash = LINE_STYLE[line.kind]
        artist = ax.axhline(line.bytes / size, color=colour, linestyle=dash, linewidth=1.2, zorder=4)
        artist.set_gid(f"memest-{line.kind}")
        ax.text(0.995, line.bytes / size, line.label, transform=trans, ha="right", va="bottom", fontsize=8.5,
                color=colour, zorder=4, gid=f"memest-{line.kind}-label")
    if above:
        text = "above the chart: " + "; ".join(x.label for x in above)
        ax.text(0.995, 0.995, text, transform=ax.transAxes, ha="right", va="top", fontsize=8.5, color="#222222",
                gid="memest-above")


def _mpl_peak(ax, timeline: Timeline, n: int, size: int) -> None:
    p = timeline.peak
    y = p.bytes / size
    ax.plot([p.index + 0.5], [y], marker="o", markersize=6, color="black", zorder=5)
    frac = p.index / n
    right = frac < 0.55
    text = _peak_text(timeline)
    ax.annotate(
        text, xy=(p.index + 0.5, y), xycoords="data",
        xytext=(frac + (0.04 if right else -0.04), 0.97), textcoords="axes fraction",
        ha="left" if right else "right", va="top", fontsize=9, multialignment="left",
        bbox=dict(boxstyle="round,pad=0.4", facecolor="white", edgecolor="#333333", linewidth=0.8),
        arrowprops=dict(arrowstyle="->", color="#333333", linewidth=0.9, shrinkB=4),
        zorder=6,
    )


def _peak_text(timeline: Timeline) -> str:
    p = timeline.peak
    lines = [f"peak {format_bytes(p.bytes)}", f"step {p.iteration}, {PHASE_NAMES.get(p.phase, p.phase)}"]
    if p.op:
        lines.append(f"op {p.op.removesuffix('.default')}")
    if p.module:
        lines.append(f"in {p.module}")
    return "\n".join(lines)


# ---- HTML with an inline SVG ----------------------------------------------------------------------

_W, _H = 1100, 500
_LEFT, _RIGHT, _TOP, _BOTTOM = 70, 250, 70, 50  # margins of the plot area


def timeline_svg(timeline: Timeline, report: Report | None = None, lines: Sequence[Line] = ()) -> str:
    """The timeline as a standalone SVG element (stacked areas, phases, peak, budget lines, legend); no script."""
    esc = html.escape
    unit, size = display_unit(timeline.peak.bytes)
    pw, ph = _W - _LEFT - _RIGHT, _H - _TOP - _BOTTOM
    n = max(timeline.n_events, 1)
    top, drawn, above = chart_lines(timeline, lines)

    def x(i: float) -> float:
        return _LEFT + i / n * pw

    def y(b: float) -> float:
        return _TOP + ph - b / top * ph

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {_W} {_H}" width="{_W}" height="{_H}" '
        'font-family="DejaVu Sans, Helvetica, Arial, sans-serif" font-size="11" role="img">',
        f"<title>{esc(peak_label(timeline))}</title>",
        f'<rect x="0" y="0" width="{_W}" height="{_H}" fill="white"/>',
    ]
    # phase bands and labels
    by_iteration: dict[int, int] = {}
    for span in timeline.spans:
        k = by_iteration[span.iteration] = by_iteration.get(span.iteration, -1) + 1
        x0, x1 = x(span.start), x(span.end)
        tip = f"step {span.iteration}, {PHASE_NAMES.get(span.phase, span.phase)}: events {span.start:,}–{span.end - 1:,}"
        if span.iteration == 0:
            tip = f"setup (alive before the step): events {span.start:,}–{span.end - 1:,}"
        shade = "#000000" if span.iteration == 0 or k % 2 == 1 else "#ffffff"
        out.append(f'<rect x="{x0:.1f}" y="{_TOP}" width="{max(x1 - x0, 0.5):.1f}" height="{ph}" fill="{shade}" '
                   f'fill-opacity="0.05"><title>{esc(tip)}</title></rect>')
        label = _span_label(span, x1 - x0, 6.2)
        if label:
            out.append(f'<text x="{(x0 + x1) / 2:.1f}" y="{_TOP - 6}" text-anchor="middle" fill="#333">{esc(label)}</text>')
    # y grid and ticks
    for v in _nice_ticks(top / size):
        yy = y(v * size)
        out.append(f'<line x1="{_LEFT}" x2="{_LEFT + pw}" y1="{yy:.1f}" y2="{yy:.1f}" stroke="#ddd" stroke-width="0.6"/>')
        out.append(f'<text x="{_LEFT - 6}" y="{yy + 4:.1f}" text-anchor="end">{_fmt_tick(v)}</text>')
    for v in _nice_ticks(n, 8):
        xx = x(v)
        out.append(f'<line x1="{xx:.1f}" x2="{xx:.1f}" y1="{_TOP + ph}" y2="{_TOP + ph + 4}" stroke="#333"/>')
        out.append(f'<text x="{xx:.1f}" y="{_TOP + ph + 17}" text-anchor="middle">{v:,.0f}</text>')
    # stacked areas, step-post
    stack = _stack(timeline)
    xs = list(timeline.index) + [n]
    lower = [0] * len(timeline.index)
    for cat, series in stack:
        upper = [a + b for a, b in zip(lower, series, strict=True)]
        out.append(f'<path d="{_step_area(xs, lower, upper, x, y)}" fill="{COLOURS[cat]}" stroke="none">'
                   f"<title>{esc(LABELS[cat])}</title></path>")
        lower = upper
    # phase boundaries, steps
    for span in timeline.spans:
        if span.start > 0:
            out.append(f'<line x1="{x(span.start):.1f}" x2="{x(span.start):.1f}" y1="{_TOP}" y2="{_TOP + ph}" '
                       'stroke="#999" stroke-width="0.5"/>')
    for it, a, b in _iteration_ranges(timeline):
        out.append(f'<line x1="{x(a):.1f}" x2="{x(a):.1f}" y1="{_TOP - 30}" y2="{_TOP + ph}" stroke="#333" stroke-width="1.1"/>')
        out.append(f'<text x="{(x(a) + x(b)) / 2:.1f}" y="{_TOP - 24}" text-anchor="middle" font-weight="bold" '
                   f'font-size="12">step {it}</text>')
    # axes
    out.append(f'<line x1="{_LEFT}" x2="{_LEFT}" y1="{_TOP}" y2="{_TOP + ph}" stroke="#333"/>')
    out.append(f'<line x1="{_LEFT}" x2="{_LEFT + pw}" y1="{_TOP + ph}" y2="{_TOP + ph}" stroke="#333"/>')
    out.append(f'<text x="{_LEFT + pw / 2:.1f}" y="{_H - 15}" text-anchor="middle">memory events in order '
               f"(allocations and frees; {timeline.n_events:,} in all)</text>")
    out.append(f'<text transform="translate(20 {_TOP + ph / 2:.1f}) rotate(-90)" text-anchor="middle">'
               f"allocated ({unit})</text>")
    for line in drawn:
        colour, dash = LINE_STYLE[line.kind]
        yy = y(line.bytes)
        dashes = ' stroke-dasharray="6 4"' if dash == "--" else ""
        out.append(f'<line class="memest-{line.kind}" x1="{_LEFT}" x2="{_LEFT + pw}" y1="{yy:.1f}" y2="{yy:.1f}" '
                   f'stroke="{colour}" stroke-width="1.2"{dashes}>'
                   f"<title>{esc(line.label)}</title></line>")
        out.append(f'<text class="memest-{line.kind}-label" x="{_LEFT + pw - 4}" y="{yy - 4:.1f}" text-anchor="end" '
                   f'fill="{colour}">{esc(line.label)}</text>')
    if above:
        out.append(f'<text class="memest-above" x="{_LEFT + pw - 4}" y="{_TOP + 14}" text-anchor="end">'
                   f"{esc('above the chart: ' + '; '.join(x.label for x in above))}</text>")
    out += _svg_peak(timeline, x, y, pw)
    out += _svg_legend(timeline, stack)
    out.append("</svg>")
    return "\n".join(out)


def _step_area(xs, lower, upper, x, y) -> str:
    top_pts, bottom_pts = [], []
    for k in range(len(upper)):
        x0, x1 = x(xs[k]), x(xs[k + 1])
        top_pts += [f"{x0:.1f},{y(upper[k]):.1f}", f"{x1:.1f},{y(upper[k]):.1f}"]
        bottom_pts += [f"{x0:.1f},{y(lower[k]):.1f}", f"{x1:.1f},{y(lower[k]):.1f}"]
    if not top_pts:
        return "M0,0"
    return "M" + " L".join(top_pts + bottom_pts[::-1]) + " Z"


def _svg_peak(timeline: Timeline, x, y, pw) -> list[str]:
    esc = html.escape
    p = timeline.peak
    px, py = x(p.index + 0.5), y(p.bytes)  # the middle of the peak event's step
    lines = _peak_text(timeline).split("\n")
    box_w = max(len(s) for s in lines) * 6.4 + 16
    box_h = len(lines) * 15 + 10
    right = (px - _LEFT) / pw < 0.55
    bx = px + 30 if right else px - 30 - box_w
    bx = min(max(bx, _LEFT + 4), _LEFT + pw - box_w - 4) if box_w < pw else _LEFT
    by = _TOP + 6
    ax_, ay_ = (bx if right else bx + box_w), by + box_h / 2
    out = [
        f'<line x1="{ax_:.1f}" y1="{ay_:.1f}" x2="{px:.1f}" y2="{py:.1f}" stroke="#333" stroke-width="0.9"/>',
        f'<circle cx="{px:.1f}" cy="{py:.1f}" r="4" fill="black"><title>{esc(peak_label(timeline))}</title></circle>',
        f'<rect x="{bx:.1f}" y="{by:.1f}" width="{box_w:.1f}" height="{box_h}" rx="4" fill="white" stroke="#333" stroke-width="0.8"/>',
    ]
    for i, s in enumerate(lines):
        weight = ' font-weight="bold"' if i == 0 else ""
        out.append(f'<text x="{bx + 8:.1f}" y="{by + 18 + 15 * i:.1f}"{weight}>{esc(s)}</text>')
    return out


def _svg_legend(timeline: Timeline, stack) -> list[str]:
    esc = html.escape
    at_peak = _at_peak(timeline)
    lx, ly = _W - _RIGHT + 20, _TOP + 4
    out = [f'<text x="{lx}" y="{ly}" font-weight="bold">alive at the peak</text>']
    for k, (cat, _) in enumerate(reversed(stack)):
        yy = ly + 20 + 20 * k
        out.append(f'<rect x="{lx}" y="{yy - 10}" width="14" height="12" fill="{COLOURS[cat]}"/>')
        out.append(f'<text x="{lx + 20}" y="{yy}">{esc(_legend_text(cat, at_peak, timeline.peak.bytes))}</text>')
    return out


def html_page(timeline: Timeline, report: Report | None, lines: Sequence[Line] = ()) -> str:
    """A self-contained page: title, the SVG, and the breakdown at the peak as a table."""
    esc = html.escape
    title, sub = title_lines(timeline, report)
    at_peak = _at_peak(timeline)
    peak = timeline.peak.bytes or 1
    rows = "\n".join(
        f"<tr><td><span class=sw style='background:{COLOURS[c]}'></span>{esc(LABELS[c])}</td>"
        f"<td class=n>{esc(format_bytes(at_peak.get(c, 0)))}</td><td class=n>{100 * at_peak.get(c, 0) / peak:.1f}%</td></tr>"
        for c in reversed(STACK_ORDER) if c in at_peak
    )
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>memest: {esc(title)}</title>
<style>
body {{ font-family: DejaVu Sans, Helvetica, Arial, sans-serif; margin: 24px; color: #222; }}
h1 {{ font-size: 18px; margin: 0 0 4px; }}
p.sub {{ color: #555; margin: 0 0 12px; font-size: 13px; }}
svg {{ max-width: 100%; height: auto; }}
table {{ border-collapse: collapse; font-size: 13px; margin-top: 12px; }}
td, th {{ padding: 3px 10px; border-bottom: 1px solid #eee; text-align: left; }}
td.n {{ text-align: right; font-variant-numeric: tabular-nums; }}
.sw {{ display: inline-block; width: 10px; height: 10px; margin-right: 6px; }}
</style>
</head>
<body>
<h1>{esc(title)}</h1>
<p class="sub">{esc(sub)}</p>
{timeline_svg(timeline, report, lines)}
<p>peak {esc(peak_label(timeline))}</p>
<table>
<tr><th>alive at the peak</th><th>bytes</th><th>share</th></tr>
{rows}
</table>
<p class="sub">Shaded bands and labels are the phases of each traced step; hover for details.
Bytes are binary units (1 GiB = 2<sup>30</sup> bytes). Made by memest.</p>
</body>
</html>
"""

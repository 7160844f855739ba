"""Markdown renderings of what the CLI prints (for PR comments and CI job summaries).

``table_markdown`` is the one table writer; ``estimate_markdown`` is the ``estimate`` view: summary,
breakdown at the peak, per-layer table to a depth and the fit table.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from memest.device.fit import FitRow
from memest.report.analysis import BREAKDOWN_KEYS, Report
from memest.spec.choices import Verdict
from memest.units import format_bound, format_bytes, format_count

_NUMERIC = re.compile(r"^[-+]?[0-9][0-9.,]*(\s|%|[A-Za-z]|$)")


def escape_cell(value: object) -> str:
    """A table cell on one line: pipes escaped, line breaks as <br>."""
    text = "" if value is None else str(value)
    text = text.replace("\\|", "|").replace("|", "\\|")
    return re.sub(r"\r\n|\r|\n", "<br>", text).strip()


def _is_numeric(cells: list[str]) -> bool:
    filled = [c for c in cells if c not in ("", "-")]
    return bool(filled) and all(_NUMERIC.match(c) for c in filled)


def table_markdown(
    headers: Sequence[object], rows: Sequence[Sequence[object]], align: Sequence[str] | None = None
) -> str:
    """A GitHub-flavoured Markdown table. ``align``: 'left' / 'right' / 'center' per column; by default
    columns whose cells all start with a number are right-aligned. Short rows are padded."""
    width = len(headers)
    cells = [[escape_cell(c) for c in list(row)[:width]] + [""] * (width - len(row)) for row in rows]
    if align is None:
        align = ["right" if _is_numeric([r[j] for r in cells]) else "left" for j in range(width)]
    rule = {"left": ":---", "right": "---:", "center": ":---:"}
    lines = [
        "| " + " | ".join(escape_cell(h) for h in headers) + " |",
        "| " + " | ".join(rule[a] for a in align) + " |",
    ]
    lines += ["| " + " | ".join(r) + " |" for r in cells]
    return "\n".join(lines)


def summary_items(report: Report) -> list[tuple[str, str]]:
    """(label, value) pairs of the estimate summary, plain text (the rich view's rows, no markup)."""
    spec = report.spec
    run = f"batch {spec['batch']}" + (f", seq {spec['seq']}" if spec.get("seq") else "")
    run += f", {spec['optim']}, {spec['precision']}, target {spec['target']}, {spec['iterations']} steps traced"
    items = [("run", run)]
    if spec.get("grad_accum", 1) > 1:
        items.append(("accumulation", f"{spec['grad_accum']} micro-steps of batch {spec['batch']}: "
                                      f"effective batch {report.effective_batch}"))
    if report.attention_backends:
        items.append(("attention", ", ".join(f"{k} x{v}" for k, v in report.attention_backends.items())))
    if report.checkpointed:
        base = report.step_flops - report.recompute_flops
        pct = 100 * report.recompute_flops / base if base else 0.0
        items.append(("checkpointing", f"{len(report.checkpointed)} modules; recompute costs {pct:.1f}% extra FLOPs"))
    items.append(("parameters", f"{format_count(report.param_count)} ({format_bytes(report.param_bytes)})"))
    items.append(("peak allocated", f"**{format_bytes(report.peak_allocated_bytes)}**"))
    where = f"step {report.peak_iteration}, {report.phase_at_peak}"
    if report.module_at_peak:
        where += f", in `{report.module_at_peak}`"
    if report.op_at_peak:
        where += f", op `{report.op_at_peak}`"
    items.append(("peak happens", where))
    if report.device is not None:
        dev = report.device
        items.append(("torch would report", f"max_memory_allocated {format_bytes(dev.allocated_peak_bytes)}, "
                                            f"max_memory_reserved {format_bytes(dev.reserved_peak_bytes)}"))
        items.append(("predicted device use", f"{format_bytes(dev.device_bytes)} (range {format_bytes(dev.bytes_low)}"
                                              f" - {format_bound(dev.bytes_high)}; what nvidia-smi would show on a GPU "
                                              "with room to spare)"))
        items.append(("needed", f"**{format_bytes(dev.min_budget_bytes)}** (range {format_bytes(dev.needed_bytes_low)}"
                                f" - {format_bound(dev.needed_bytes_high)}; the smallest device budget the step runs in)"))
    diff = report.folklore_bytes - report.peak_allocated_bytes
    rel = diff / report.peak_allocated_bytes if report.peak_allocated_bytes else 0
    items.append(("folklore formula", f"{format_bytes(report.folklore_bytes)} ({report.folklore_formula}): "
                                      f"{100 * rel:+.0f}% vs the trace"))
    return items


def breakdown_rows(report: Report) -> list[list[str]]:
    peak = report.peak_allocated_bytes
    rows = []
    for key in BREAKDOWN_KEYS:
        value = report.breakdown_at_peak.get(key, 0)
        label = "other (buffers, inputs)" if key == "other" else key.replace("_", " ")
        rows.append([label, format_bytes(value), f"{100 * value / peak if peak else 0:.1f}%"])
    return rows


def layer_rows(report: Report, depth: int, expand: bool = False) -> tuple[list[str], list[list[str]]]:
    from memest.report.layers import select_layers

    headers = ["module", "type", "output shape", "params", "weights+grads+optim", "saved for bwd",
               "alive at peak", "% of peak"]
    rows = [
        [
            line.name or "(model)",
            line.type,
            line.output_shape,
            format_count(line.params),
            format_bytes(line.state_bytes),
            format_bytes(line.activation_bytes),
            format_bytes(line.bytes_at_peak),
            f"{100 * line.share_of_peak:.1f}%",
        ]
        for line in select_layers(report.layers, depth, expand)
    ]
    return headers, rows


FIT_HEADERS = ["against", "total", "used", "available", "needed", "headroom", "fits"]


def _verdict_cell(r: FitRow, yes: str, no: str, tight: str) -> str:
    if r.verdict == Verdict.TIGHT:
        return tight
    return yes if r.fits else no


def fit_cells(rows: list[FitRow], yes: str = "yes", no: str = "**no**", tight: str = "**tight**") -> list[list[str]]:
    """Cells of the "does it fit?" table (shared with the rich table in console.py). tight: the expected
    need fits, the high end of its range does not."""
    return [
        [
            r.label,
            format_bytes(r.total_bytes) if r.total_bytes is not None else "-",
            format_bytes(r.used_bytes) if r.used_bytes is not None else "-",
            format_bytes(r.capacity_bytes),
            format_bytes(r.needed_bytes),
            format_bytes(r.headroom_bytes),
            _verdict_cell(r, yes, no, tight),
        ]
        for r in rows
    ]


def fit_rows_markdown(rows: list[FitRow]) -> str:
    return table_markdown(FIT_HEADERS, fit_cells(rows))


def estimate_markdown(report: Report, fits: list[FitRow], depth: int = 2, gpu_reason: str = "",
                      expand: bool = False) -> str:
    """The ``estimate`` view in Markdown: summary, breakdown at the peak, layers to ``depth``, fit."""
    parts = [f"### memest: {escape_cell(report.model)} ({escape_cell(report.model_type)})", ""]
    parts += [f"- **{label}**: {value}" for label, value in summary_items(report)]
    parts += ["", table_markdown(["alive at the peak", "bytes", "share"], breakdown_rows(report))]
    from memest.report.layers import collapse_note, select_layers

    headers, rows = layer_rows(report, depth, expand)
    parts += ["", f"#### Per layer (depth {depth})", "", table_markdown(headers, rows)]
    note = collapse_note(select_layers(report.layers, depth, expand))
    if note:
        parts += ["", f"_{note}_"]
    if report.notes:
        parts += ["", "\n>\n".join(f"> note: {note}" for note in report.notes)]
    parts += [""]
    if fits:
        parts += ["#### Does it fit?", "", fit_rows_markdown(fits)]
    elif gpu_reason:
        parts += [f"GPUs: {gpu_reason}; pass `--gpu 11GB` to compare with a budget."]
    return "\n".join(parts).rstrip() + "\n"

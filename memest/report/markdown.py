"""Markdown renderings of what the CLI prints (for PR comments and CI job summaries).

``table_markdown`` is the one table writer; ``estimate_markdown`` is the ``estimate`` view: the summary rows
(report/summary.py, as the console shows them), breakdown at the peak, per-layer table to a depth, notes and
the fit table.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from memest.device.fit import FitRow
from memest.report.analysis import Report
from memest.report.layers import collapse_note, select_layers
from memest.report.summary import RowKind, SummaryRow, summary_rows
from memest.spec.choices import Verdict
from memest.units import format_bytes, format_count

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


def summary_lines(rows: list[SummaryRow]) -> list[str]:
    """The summary rows (report/summary.py) but the breakdown and the notes, as a list: a row without a label
    nests under the one above."""
    lines = []
    for row in rows:
        if row.kind not in (RowKind.TEXT, RowKind.HEADLINE):
            continue
        text = _cell_text(row)
        if row.label:
            lines.append(f"- **{row.label}**: {text}")
        else:  # a leading + (a fixed cost) escaped, so Markdown reads no list marker
            lines.append("  - " + ("\\" + text if text.startswith(("+", "-", "*")) else text))
    return lines


def _cell_text(row: SummaryRow) -> str:
    """The row's text with its headline figure in bold and module / op names as code."""
    if row.kind is RowKind.HEADLINE:
        return f"**{row.value}**" + (f" {row.detail}" if row.detail else "")
    text, out, last = row.text, "", 0
    for start, end in row.code:
        out += f"{text[last:start]}`{text[start:end]}`"
        last = end
    return out + text[last:]


def breakdown_rows(rows: list[SummaryRow]) -> list[list[str]]:
    """What is alive at the peak, by category: the summary's breakdown rows as table cells."""
    return [[row.label, row.value, row.detail.strip()] for row in rows if row.kind is RowKind.PART]


def layer_rows(report: Report, depth: int, expand: bool = False) -> tuple[list[str], list[list[str]]]:

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
    summary = summary_rows(report)
    parts = [f"### memest: {escape_cell(report.model)} ({escape_cell(report.model_type)})", ""]
    parts += summary_lines(summary)
    parts += ["", table_markdown(["alive at the peak", "bytes", "share"], breakdown_rows(summary))]

    headers, rows = layer_rows(report, depth, expand)
    parts += ["", f"#### Per layer (depth {depth})", "", table_markdown(headers, rows)]
    note = collapse_note(select_layers(report.layers, depth, expand))
    if note:
        parts += ["", f"_{note}_"]
    notes = [row.value for row in summary if row.kind is RowKind.NOTE]
    if notes:
        parts += ["", "\n>\n".join(f"> note: {note}" for note in notes)]
    parts += [""]
    if fits:
        parts += ["#### Does it fit?", "", fit_rows_markdown(fits)]
    elif gpu_reason:
        parts += [f"GPUs: {gpu_reason}; pass `--gpu 11GB` to compare with a budget."]
    return "\n".join(parts).rstrip() + "\n"

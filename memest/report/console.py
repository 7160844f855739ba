"""Rich rendering of a Report: the per-layer table, the summary and the GPU comparison."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from memest.device.fit import FitRow
from memest.report.analysis import Report
from memest.report.layers import collapse_note, select_layers
from memest.report.markdown import FIT_HEADERS, fit_cells
from memest.report.summary import RowKind, SummaryRow, summary_rows
from memest.units import format_bytes, format_count

# per-layer columns: (header, justify, drop order: higher goes first when the terminal is too narrow;
# 0 never goes). Numbers are never truncated: columns are left out instead, and the caption says which.
LAYER_COLUMNS = (
    ("module", "left", 0),
    ("type", "left", 5),
    ("output shape", "left", 6),
    ("params", "right", 4),
    ("weights+grads+optim", "right", 2),
    ("saved for bwd", "right", 3),
    ("alive at peak", "right", 0),
    ("% of peak", "right", 1),
)


# headers on two lines where that keeps number columns narrow
HEADER_LINES = {"weights+grads+optim": "weights+grads\n+optim", "saved for bwd": "saved\nfor bwd",
                "alive at peak": "alive at\npeak", "% of peak": "% of\npeak", "output shape": "output\nshape"}


def _layer_cells(line) -> dict[str, str]:
    return {
        "module": "  " * line.depth + line.label,
        "type": line.type,
        "output shape": line.output_shape,
        "params": format_count(line.params),
        "weights+grads+optim": format_bytes(line.state_bytes),
        "saved for bwd": format_bytes(line.activation_bytes),
        "alive at peak": format_bytes(line.bytes_at_peak),
        "% of peak": f"{100 * line.share_of_peak:.1f}%",
    }


def layer_table(report: Report, depth: int, expand: bool = False, width: int | None = None) -> Table:
    """The per-layer table to ``depth``, repeated blocks collapsed unless ``expand``, fitted to ``width``
    (the console's) by leaving out low-priority columns, never by truncating a number."""

    lines = select_layers(report.layers, depth, expand)
    cells = [_layer_cells(line) for line in lines]
    columns = list(LAYER_COLUMNS)
    dropped: list[str] = []

    longest = {name: max([len(part) for part in HEADER_LINES.get(name, name).split("\n")] + [len(c[name]) for c in cells])
               for name, _, _ in LAYER_COLUMNS}

    def build() -> Table:
        table = Table(title=f"{report.model} ({report.model_type}) — per layer", title_justify="left")
        for name, justify, _ in columns:
            wraps = name in ("module", "type", "output shape")  # text may wrap, within a readable width
            table.add_column(HEADER_LINES.get(name, name), justify=justify, no_wrap=not wraps,
                             overflow="fold",
                             min_width=min(longest[name], 24) if wraps else None)
        for c in cells:
            table.add_row(*(c[name] for name, _, _ in columns))
        notes = []
        if dropped:
            notes.append(f"left out at this width: {', '.join(dropped)} (a wider terminal, --markdown or --json "
                         "shows them)")
        note = collapse_note(lines)
        if note:
            notes.append(note)
        if notes:
            table.caption, table.caption_justify = "\n".join(notes), "left"
        return table

    def needed_width() -> int:  # numbers in full, text columns at their minimum, padding 2, borders
        text = ("module", "type", "output shape")
        return sum(min(longest[n], 24) if n in text else longest[n] for n, _, _ in columns) + 3 * len(columns) + 1

    table = build()
    while width is not None and needed_width() > width:
        droppable = [c for c in columns if c[2] > 0]
        if not droppable:
            break
        victim = max(droppable, key=lambda c: c[2])
        columns.remove(victim)
        dropped.append(victim[0])
        table = build()
    return table


def summary_table(rows: list[SummaryRow]) -> Table:
    """The summary rows (report/summary.py) as a two-column table; notes are printed under it."""
    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_column(style="bold")
    table.add_column()
    for row in rows:
        if row.kind is RowKind.PART:
            table.add_row(f"  {row.label}", f"{row.value:>12}  {row.detail}")
        elif row.kind is RowKind.HEADLINE:
            table.add_row(row.label, f"[bold]{row.value}[/bold]" + (f" {row.detail}" if row.detail else ""))
        elif row.kind is RowKind.TEXT:
            table.add_row(row.label, row.text)
    return table


def fit_table(rows: list[FitRow], width: int | None = None) -> Table:
    """Numbers in full: at a narrow width the total and used columns go first."""

    cells = fit_cells(rows, yes="[green]yes[/green]", no="[red]no[/red]", tight="[yellow]tight[/yellow]")
    plain = fit_cells(rows)
    keep = list(range(len(FIT_HEADERS)))

    def needed_width() -> int:
        widths = [max([len(FIT_HEADERS[j])] + [len(r[j]) for r in plain]) for j in keep]
        return sum(min(w, 24) if FIT_HEADERS[j] == "against" else w for w, j in zip(widths, keep, strict=True)) \
            + 3 * len(keep) + 1

    for optional in ("used", "total"):
        if width is not None and needed_width() > width:
            keep.remove(FIT_HEADERS.index(optional))
    table = Table(title="Does it fit?", title_justify="left")
    for j in keep:
        col = FIT_HEADERS[j]
        table.add_column(col, justify="left" if col == "against" else "right", no_wrap=col != "against",
                         overflow="fold", min_width=min(24, len(col)) if col == "against" else None)
    for r in cells:
        table.add_row(*(r[j] for j in keep))
    return table


def make_console() -> Console:
    """Full-width tables also when piped to a file or a CI log (rich assumes 80 columns there); COLUMNS,
    when set to a width, is honoured in both cases."""
    import os
    import sys

    columns = os.environ.get("COLUMNS", "").strip()
    if columns.isdigit() and int(columns) > 0:
        return Console(width=int(columns))
    return Console() if sys.stdout.isatty() else Console(width=160)


def print_estimate(console: Console, report: Report, fits: list[FitRow], gpu_reason: str, depth: int,
                   expand: bool = False) -> None:
    rows = summary_rows(report)
    console.print(layer_table(report, depth, expand=expand, width=console.width))
    console.print(summary_table(rows))
    for row in rows:
        if row.kind is RowKind.NOTE:
            console.print(f"[dim]note: {row.value}[/dim]")
    if fits:
        console.print(fit_table(fits, width=console.width))
    else:
        console.print(f"GPUs: {gpu_reason}; pass --gpu 11GB to compare with a budget.")



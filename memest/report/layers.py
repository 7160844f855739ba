"""Which per-layer rows a view shows: the module tree to a depth, with runs of identical repeated blocks
(a transformer's ``h.0`` … ``h.11``) collapsed into one row of totals unless ``expand``. Data in, rows
out; the rich and Markdown views both use it."""

from __future__ import annotations

import re
from dataclasses import dataclass

from memest.report.analysis import LayerRow

_INDEXED = re.compile(r"^(?P<prefix>.*?)(?P<index>[0-9]+)$")


@dataclass
class LayerLine:
    name: str  # qualified name; a collapsed run: 'h.0–11'
    label: str  # what the table shows in the module column (last component, or the run)
    type: str  # 'GPT2Block', or 'GPT2Block ×12' for a run
    depth: int
    output_shape: str
    params: int
    state_bytes: int  # weights + gradients + optimizer state
    activation_bytes: int  # saved for backward
    bytes_at_peak: int
    share_of_peak: float
    count: int = 1  # blocks in a collapsed run (figures are totals over the run)
    at_peak_min: int = 0  # a run: the smallest and largest one block holds at the peak
    at_peak_max: int = 0


def _line(row: LayerRow) -> LayerLine:
    label = row.name.rpartition(".")[2] if row.name else "(model)"
    return LayerLine(row.name, label, row.type, row.depth, row.output_shape, row.params,
                     row.param_bytes + row.grad_bytes + row.optimizer_bytes, row.activation_bytes,
                     row.bytes_at_peak, row.share_of_peak, 1, row.bytes_at_peak, row.bytes_at_peak)


def _signature(row: LayerRow) -> tuple:
    """What must agree for blocks to be 'identical': type, shape and every per-block figure known before
    the peak (parameters, their state, saved activations). What is alive at the peak may differ."""
    return (row.type, row.output_shape, row.params, row.param_bytes, row.grad_bytes, row.optimizer_bytes,
            row.activation_bytes)


def _children(rows: list[LayerRow], start: int) -> list[int]:
    """Indices of the direct children of rows[start] (rows are in pre-order: named_modules order)."""
    depth, out = rows[start].depth, []
    for i in range(start + 1, len(rows)):
        if rows[i].depth <= depth:
            break
        if rows[i].depth == depth + 1:
            out.append(i)
    return out


def _runs(rows: list[LayerRow], children: list[int]) -> list[list[int]]:
    """Consecutive children with consecutive numeric names (h.0, h.1, …) and the same signature."""
    runs: list[list[int]] = []
    for i in children:
        match = _INDEXED.match(rows[i].name)
        if runs:
            prev = rows[runs[-1][-1]]
            prev_match = _INDEXED.match(prev.name)
            if (match and prev_match and match["prefix"] == prev_match["prefix"]
                    and int(match["index"]) == int(prev_match["index"]) + 1
                    and _signature(rows[i]) == _signature(prev)):
                runs[-1].append(i)
                continue
        runs.append([i])
    return runs


def _collapsed(rows: list[LayerRow], run: list[int]) -> LayerLine:
    first, last = rows[run[0]], rows[run[-1]]
    prefix = _INDEXED.match(first.name)["prefix"]
    lo, hi = _INDEXED.match(first.name)["index"], _INDEXED.match(last.name)["index"]
    at_peak = [rows[i].bytes_at_peak for i in run]
    short_prefix = prefix.rpartition(".")[0].rpartition(".")[2]
    label = f"{short_prefix + '.' if short_prefix else ''}{lo}–{hi}"
    return LayerLine(
        name=f"{prefix}{lo}–{hi}", label=label, type=f"{first.type} ×{len(run)}", depth=first.depth,
        output_shape=first.output_shape, params=sum(rows[i].params for i in run),
        state_bytes=sum(rows[i].param_bytes + rows[i].grad_bytes + rows[i].optimizer_bytes for i in run),
        activation_bytes=sum(rows[i].activation_bytes for i in run), bytes_at_peak=sum(at_peak),
        share_of_peak=sum(rows[i].share_of_peak for i in run), count=len(run),
        at_peak_min=min(at_peak), at_peak_max=max(at_peak),
    )


def select_layers(layers: list[LayerRow], depth: int, expand: bool = False) -> list[LayerLine]:
    """The rows to show, in tree order, down to ``depth``."""
    rows = list(layers)
    out: list[LayerLine] = []

    def visit(i: int) -> None:
        if rows[i].depth > depth:
            return
        out.append(_line(rows[i]))
        for run in _runs(rows, _children(rows, i)) if not expand else [[c] for c in _children(rows, i)]:
            if len(run) >= 2:
                if rows[run[0]].depth <= depth:
                    out.append(_collapsed(rows, run))
            else:
                visit(run[0])

    roots = [i for i, r in enumerate(rows) if r.depth == min(r.depth for r in rows)] if rows else []
    for i in roots:
        visit(i)
    return out


def collapse_note(lines: list[LayerLine]) -> str | None:
    if not any(line.count > 1 for line in lines):
        return None
    return ("×N rows: N identical repeated blocks in one row; figures are totals over the run (alive at peak "
            "differs block by block: the row shows the run's total); --expand shows every block")

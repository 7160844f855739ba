"""Rich rendering of a Report: the per-layer table, the summary and the GPU comparison."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from memest.device.fit import FitRow
from memest.device.nvml import GpuQuery
from memest.report.analysis import BREAKDOWN_KEYS, Report
from memest.units import format_bound, format_bytes, format_count

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
    from memest.report.layers import collapse_note, select_layers

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


def summary_table(report: Report) -> Table:
    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_column(style="bold")
    table.add_column()
    spec = report.spec
    table.add_row(
        "run",
        f"batch {spec['batch']}" + (f", seq {spec['seq']}" if spec.get("seq") else "")
        + f", {spec['optim']}, {spec['precision']}, target {spec['target']}, {spec['iterations']} steps traced",
    )
    if report.attention_backends:
        used = ", ".join(f"{name} x{n}" for name, n in report.attention_backends.items())
        cc = spec.get("compute_capability") or ()
        table.add_row("attention", f"{used} (CUDA kernel rules for sm{''.join(str(x) for x in cc)})")
    if spec.get("grad_accum", 1) > 1:
        table.add_row("accumulation", f"{spec['grad_accum']} micro-steps of batch {spec['batch']}: effective batch {report.effective_batch}")
    if report.checkpointed:
        base = report.step_flops - report.recompute_flops
        pct = 100 * report.recompute_flops / base if base else 0.0
        table.add_row(
            "checkpointing",
            f"{len(report.checkpointed)} modules ({_names(report.checkpointed)}); recompute costs "
            f"{pct:.1f}% extra FLOPs per step",
        )
    if report.sharding:
        sh = report.sharding
        table.add_row(
            "parallel" if max(report.spec.get(k, 1) for k in ("tp", "pp", "ep")) > 1 else "data parallel",
            f"rank {sh.get('rank', 0)} of {sh['world_size']}" + (f", {sh['parallel']}" if sh.get("parallel") else "")
            + f"; effective batch {report.effective_batch}",
        )
        if sh.get("host_peak_bytes"):
            table.add_row("host memory", f"{format_bytes(sh['host_peak_bytes'])} peak offloaded to the CPU (not in the GPU peak)")
    table.add_row("parameters", f"{format_count(report.param_count)} ({format_bytes(report.param_bytes)})")
    table.add_row("peak allocated", f"[bold]{format_bytes(report.peak_allocated_bytes)}[/bold]")
    where = f"step {report.peak_iteration}, {report.phase_at_peak}"
    if report.module_at_peak:
        where += f", in {report.module_at_peak}"
    table.add_row("peak happens", f"{where}, op {report.op_at_peak}")
    for key in BREAKDOWN_KEYS:
        value = report.breakdown_at_peak[key]
        share = value / report.peak_allocated_bytes if report.peak_allocated_bytes else 0
        label = key.replace("_", " ")
        if key == "other":
            label = "other (buffers, inputs)"
        table.add_row(f"  {label}", f"{format_bytes(value):>12}  {100 * share:5.1f}%")
    if report.device is not None:
        dev = report.device
        table.add_row("torch would report", f"max_memory_allocated {format_bytes(dev.allocated_peak_bytes)} (+ cuBLAS workspaces, 512 B blocks)")
        table.add_row("", f"max_memory_reserved {format_bytes(dev.reserved_peak_bytes)} (caching-allocator replay)")
        for cost in dev.fixed_costs:
            if not cost.in_allocator:
                tag = "calibrated" if cost.calibrated else "assumption" if cost.source.startswith("assumption") else "evidence"
                spread = f", {format_bytes(cost.low)}-{format_bytes(cost.high)}" if cost.low != cost.high else ""
                table.add_row("", f"+ {cost.name.replace('_', ' ')} {format_bytes(cost.bytes)} ({tag}{spread})")
        table.add_row("predicted device use", f"{format_bytes(dev.device_bytes)} (range {format_bytes(dev.bytes_low)} - "
                      f"{format_bound(dev.bytes_high)}; what nvidia-smi would show on a GPU with room to spare)")
        table.add_row("needed", f"[bold]{format_bytes(dev.min_budget_bytes)}[/bold] (range "
                      f"{format_bytes(dev.needed_bytes_low)} - {format_bound(dev.needed_bytes_high)}; the smallest device "
                      "budget the step runs in: the allocator frees its cache before running out)")
    diff = report.folklore_bytes - report.peak_allocated_bytes
    rel = diff / report.peak_allocated_bytes if report.peak_allocated_bytes else 0
    table.add_row(
        "folklore formula",
        f"{format_bytes(report.folklore_bytes)} ({report.folklore_formula}): {100 * rel:+.0f}% vs the trace",
    )
    table.add_row("traced in", f"{report.trace_seconds:.2f} s")
    return table


def _names(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f", … (+{len(names) - 3})" if len(names) > 3 else "")


def fit_table(rows: list[FitRow], width: int | None = None) -> Table:
    """Numbers in full: at a narrow width the total and used columns go first."""
    from memest.report.markdown import FIT_HEADERS, fit_cells

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
    """Full-width tables also when piped to a file or a CI log (rich assumes 80 columns there)."""
    import sys

    return Console() if sys.stdout.isatty() else Console(width=160)


def print_estimate(console: Console, report: Report, fits: list[FitRow], gpu_reason: str, depth: int,
                   expand: bool = False) -> None:
    console.print(layer_table(report, depth, expand=expand, width=console.width))
    console.print(summary_table(report))
    for note in report.notes:
        console.print(f"[dim]note: {note}[/dim]")
    if fits:
        console.print(fit_table(fits, width=console.width))
    else:
        console.print(f"GPUs: {gpu_reason}; pass --gpu 11GB to compare with a budget.")


def gpus_table(query: GpuQuery) -> Table:
    table = Table(title="NVIDIA GPUs", title_justify="left")
    for col in ("index", "name", "total", "used", "free", "util", "processes"):
        table.add_column(col, justify="left" if col in ("name", "processes") else "right")
    for g in query.gpus:
        procs = ", ".join(f"{p.command}[{p.pid}] {format_bytes(p.used_bytes)}" for p in g.processes) or "-"
        table.add_row(
            str(g.index),
            g.name,
            format_bytes(g.total_bytes),
            format_bytes(g.used_bytes),
            format_bytes(g.free_bytes),
            f"{g.utilization}%" if g.utilization is not None else "-",
            procs,
        )
    return table


def check_rows(rows) -> tuple[list[str], list[list[str]]]:
    """Headers and cells of the `memest check` table (shared by the rich and Markdown views)."""
    headers = ["config", "model", "predicted", "with margin", "budget", "headroom", "verdict"]
    cells = [
        [
            r.name,
            r.model if r.model.startswith("hf:") else r.model.rsplit("/", 1)[-1],
            format_bytes(r.needed_bytes),
            f"{format_bytes(r.required_bytes)} (+{100 * r.margin:g}%)",
            f"{r.budget_label}",
            format_bytes(r.headroom_bytes),
            "fits" if r.fits else "DOES NOT FIT",
        ]
        for r in rows
    ]
    return headers, cells

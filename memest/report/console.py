"""Rich rendering of a Report: the per-layer table, the summary and the GPU comparison."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from ..device.fit import FitRow
from ..device.nvml import GpuQuery
from ..units import format_bytes, format_count
from .analysis import BREAKDOWN_KEYS, Report


def layer_table(report: Report, depth: int) -> Table:
    table = Table(title=f"{report.model} ({report.model_type}) — per layer", title_justify="left")
    for col, justify in (
        ("module", "left"),
        ("type", "left"),
        ("output shape", "left"),
        ("params", "right"),
        ("weights+grads+optim", "right"),
        ("saved for bwd", "right"),
        ("alive at peak", "right"),
        ("% of peak", "right"),
    ):
        table.add_column(col, justify=justify, no_wrap=True)
    for row in report.layers:
        if row.depth > depth:
            continue
        name = "  " * row.depth + (row.name.rpartition(".")[2] if row.name else "(model)")
        model_state = row.param_bytes + row.grad_bytes + row.optimizer_bytes
        table.add_row(
            name,
            row.type,
            row.output_shape,
            format_count(row.params),
            format_bytes(model_state),
            format_bytes(row.activation_bytes),
            format_bytes(row.bytes_at_peak),
            f"{100 * row.share_of_peak:.1f}%",
        )
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
            "data parallel",
            f"rank 0 of {sh['world_size']}" + (f", {sh['parallel']}" if sh.get("parallel") else "")
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
                tag = "calibrated" if cost.calibrated else "assumption" if cost.source.startswith("assumption") else "default"
                table.add_row("", f"+ {cost.name.replace('_', ' ')} {format_bytes(cost.bytes)} ({tag})")
        table.add_row("predicted device use", f"[bold]{format_bytes(dev.device_bytes)}[/bold] (what nvidia-smi would show)")
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


def fit_table(rows: list[FitRow]) -> Table:
    from .markdown import FIT_HEADERS, fit_cells

    table = Table(title="Does it fit?", title_justify="left")
    for col in FIT_HEADERS:
        table.add_column(col, justify="left" if col == "against" else "right")
    for cells in fit_cells(rows, yes="[green]yes[/green]", no="[red]no[/red]"):
        table.add_row(*cells)
    return table


def make_console() -> Console:
    """Full-width tables also when piped to a file or a CI log (rich assumes 80 columns there)."""
    import sys

    return Console() if sys.stdout.isatty() else Console(width=160)


def print_estimate(console: Console, report: Report, fits: list[FitRow], gpu_reason: str, depth: int) -> None:
    console.print(layer_table(report, depth))
    console.print(summary_table(report))
    for note in report.notes:
        console.print(f"[dim]note: {note}[/dim]")
    if fits:
        console.print(fit_table(fits))
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

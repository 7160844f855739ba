"""The command line: parse -> call -> render -> exit code. No estimation logic lives here."""

from __future__ import annotations

import os
import sys
from typing import Annotated, Optional

import typer

from .errors import EXIT_DOES_NOT_FIT, EXIT_OK, MemestError

app = typer.Typer(
    name="memest",
    help="How much GPU memory will this PyTorch training step need? Traced on fake tensors, no GPU touched.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

Model = Annotated[str, typer.Argument(help="model.py[:factory], hf:NAME (bundled config) or hf:path/config.json")]
Batch = Annotated[int, typer.Option("--batch", "-b", help="Batch size (per step).")]
Seq = Annotated[Optional[int], typer.Option("--seq", "-s", help="Sequence length (models that take one).")]
Optim = Annotated[str, typer.Option("--optim", help="sgd | sgd-momentum | adam | adamw | adafactor")]
Precision = Annotated[str, typer.Option("--precision", help="fp32 | bf16 | fp16 | bf16-mixed | fp16-mixed")]
Target = Annotated[str, typer.Option("--target", help="cuda: what a CUDA run allocates; cpu: CPU training.")]
Gpu = Annotated[
    Optional[str],
    typer.Option("--gpu", help="Compare with a budget (11GB = 10^9 B, 11GiB = 2^30 B), a card (rtx2080ti) or device 0."),
]
Attention = Annotated[
    str, typer.Option("--attention", help="--target cuda SDPA kernel: auto (PyTorch's rules) | flash | efficient | math")
]
Fused = Annotated[bool, typer.Option("--fused", help="--target cuda: fused optimizer kernels instead of foreach.")]
GradAccum = Annotated[int, typer.Option("--grad-accum", help="Micro-steps per optimizer step (--batch is the micro-batch).")]
Checkpointing = Annotated[
    str, typer.Option("--checkpointing", help="none | blocks | every:N | module.name,other.name (activation checkpointing)")
]
ZeroGrad = Annotated[str, typer.Option("--zero-grad", help="none: grads set to None after the step; zeros: kept as zeros.")]
Mode = Annotated[str, typer.Option("--mode", help="train | inference | generate (decoder models, KV cache)")]
NewTokens = Annotated[int, typer.Option("--new-tokens", help="--mode generate: tokens generated after a --seq prompt.")]
Cache = Annotated[str, typer.Option("--cache", help="--mode generate: dynamic (grows) | static (preallocated) KV cache")]
WorldSize = Annotated[int, typer.Option("--world-size", help="Data-parallel ranks (estimates are per rank).")]
Shard = Annotated[str, typer.Option("--shard", help="none | zero1 | zero2 | zero3 (FSDP full shard)")]
Offload = Annotated[str, typer.Option("--offload", help="none | optimizer | params (params needs --shard zero3)")]
Margin = Annotated[Optional[str], typer.Option("--margin", help="Required headroom, e.g. 10%: needed x 1.1 must fit.")]
Markdown = Annotated[bool, typer.Option("--markdown", help="Print Markdown instead of terminal tables.")]
Plot = Annotated[Optional[str], typer.Option("--plot", help="Write memory over the step to FILE.png, .svg or .html.")]
Depth = Annotated[int, typer.Option("--depth", help="Module-tree depth shown in the table.")]
Json = Annotated[bool, typer.Option("--json", help="One JSON document on stdout (schema in README).")]
FailIfNotFits = Annotated[
    bool, typer.Option("--fail-if-not-fits", help="Exit 1 when the estimate does not fit (for CI).")
]
Debug = Annotated[bool, typer.Option("--debug", help="Show tracebacks.")]


def _sharding_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("memest.trace.distributed") is not None


def _hide_cuda() -> None:
    """memest must never create a CUDA context (hundreds of MiB on a card that may run a live job):
    hide CUDA devices from torch in this process before torch is used. NVML still sees every GPU."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ""


def _calibration_for(gpu: str | None, query) -> dict | None:
    """A stored `memest calibrate` result for the GPU being compared against, if any."""
    if query is None or not query.gpus:
        return None
    chosen = [g for g in query.gpus if gpu is None or g.index == int(gpu)][:1]
    if not chosen:
        return None
    import torch

    from .device.calibration import lookup

    return lookup(chosen[0].name, query.driver, torch.__version__)


def _fail(exc: MemestError, debug: bool) -> None:
    if debug:
        raise exc
    typer.echo(f"memest: error: {exc}", err=True)
    raise typer.Exit(exc.exit_code)


@app.command()
def estimate(
    model: Model,
    batch: Batch = 1,
    seq: Seq = None,
    optim: Optim = "adam",
    precision: Precision = "fp32",
    target: Target = "cuda",
    attention: Attention = "auto",
    fused: Fused = False,
    grad_accum: GradAccum = 1,
    checkpointing: Checkpointing = "none",
    zero_grad: ZeroGrad = "none",
    mode: Mode = "train",
    new_tokens: NewTokens = 0,
    cache: Cache = "dynamic",
    world_size: WorldSize = 1,
    shard: Shard = "none",
    offload: Offload = "none",
    gpu: Gpu = None,
    depth: Depth = 3,
    json: Json = False,
    markdown: Markdown = False,
    plot: Plot = None,
    fail_if_not_fits: FailIfNotFits = False,
    debug: Debug = False,
) -> None:
    """Trace two training steps on fake tensors; print memory per layer, the peak and whether it fits."""
    _hide_cuda()
    from .device.fit import fit_rows, resolve_budget, target_compute_capability
    from .spec import RunSpec

    try:
        if gpu is not None:
            resolve_budget(gpu)  # a bad budget fails before the (slower) trace
        if plot is not None:
            from pathlib import Path

            from .report.plot import FORMATS

            if Path(plot).suffix.lower() not in FORMATS:  # fail before the trace, not after it
                raise MemestError(f"cannot write a plot to {plot!r}: use a file name ending in {', '.join(FORMATS)}")
        query = None
        if gpu is None or gpu.strip().isdigit():
            from .device.nvml import query_gpus

            query = query_gpus()
        spec = RunSpec(
            model=model, batch=batch, seq=seq, optim=optim, precision=precision, target=target,
            attention=attention, fused=fused, compute_capability=target_compute_capability(gpu, query),
            grad_accum=grad_accum, checkpointing=checkpointing, zero_grad=zero_grad, mode=mode,
            new_tokens=new_tokens, cache=cache, world_size=world_size, shard=shard, offload=offload,
        )
        if (world_size > 1 or shard != "none" or offload != "none") and not _sharding_available():
            raise MemestError("--world-size, --shard and --offload are not available in this build yet")
        from .pipeline import estimate as run_estimate

        result = run_estimate(spec, calibration=_calibration_for(gpu, query) if target == "cuda" else None)
        report = result.report
        fits = fit_rows(result.needed_bytes, gpu, query, check=result.fits)
    except MemestError as exc:
        _fail(exc, debug)
        return
    reason = query.reason if query is not None else ""
    timeline = None
    if plot is not None or not (json or markdown):
        from .report.timeline import category_timeline

        timeline = category_timeline(result.trace)
    if plot is not None:
        try:
            from .report.plot import plot_timeline

            written = plot_timeline(timeline, report, plot)
        except MemestError as exc:
            _fail(exc, debug)
            return
        typer.echo(f"memest: wrote {written}", err=True)
    if markdown:
        from .report.markdown import estimate_markdown

        sys.stdout.write(estimate_markdown(report, fits, depth=depth, gpu_reason=reason) + "\n")
    elif json:
        from .report.json_doc import json_document

        sys.stdout.write(json_document(report, fits, reason, result.needed_bytes) + "\n")
    else:
        from .report.console import make_console, print_estimate
        from .report.timeline import terminal_timeline

        console = make_console()
        print_estimate(console, report, fits, reason, depth)
        for line in terminal_timeline(timeline):
            console.print(line, markup=False, highlight=False)
    if fail_if_not_fits and fits and not all(f.fits for f in fits):
        raise typer.Exit(EXIT_DOES_NOT_FIT)
    raise typer.Exit(EXIT_OK)




@app.command()
def check(
    configs: Annotated[list[str], typer.Argument(help="YAML run configs (see configs/ and README).")],
    gpu: Gpu = None,
    margin: Margin = None,
    batch: Annotated[Optional[int], typer.Option("--batch", "-b", help="Override every config's batch.")] = None,
    seq: Annotated[Optional[int], typer.Option("--seq", "-s", help="Override every config's seq.")] = None,
    optim: Annotated[Optional[str], typer.Option("--optim", help="Override the optimizer.")] = None,
    precision: Annotated[Optional[str], typer.Option("--precision", help="Override the precision.")] = None,
    grad_accum: Annotated[Optional[int], typer.Option("--grad-accum", help="Override accumulation steps.")] = None,
    checkpointing: Annotated[Optional[str], typer.Option("--checkpointing", help="Override checkpointing.")] = None,
    json: Json = False,
    markdown: Markdown = False,
    debug: Debug = False,
) -> None:
    """CI gate: exit 0 when every config fits its GPU or budget, 1 when any does not, 2 for a bad config."""
    _hide_cuda()
    from .config import load_config, parse_margin
    from .device.nvml import query_gpus
    from .plan.check import check_config

    overrides = dict(batch=batch, seq=seq, optim=optim, precision=precision, grad_accum=grad_accum,
                     checkpointing=checkpointing)
    try:
        margin_value = parse_margin(margin) if margin is not None else None
        loaded = [load_config(path) for path in configs]  # every config is valid before any is traced
        query = query_gpus()
        rows = [check_config(cfg, overrides, gpu, margin_value, query) for cfg in loaded]
    except MemestError as exc:
        _fail(exc, debug)
        return
    if json:
        import json as _json

        doc = {"schema_version": 1, "fits": all(r.fits for r in rows), "configs": [r.to_dict() for r in rows]}
        sys.stdout.write(_json.dumps(doc, indent=2) + "\n")
    else:
        from .report.console import check_rows, make_console

        headers, table_rows = check_rows(rows)
        if markdown:
            from .report.markdown import table_markdown

            sys.stdout.write(table_markdown(headers, table_rows) + "\n")
        else:
            from rich.table import Table

            table = Table(title="memest check", title_justify="left")
            for h in headers:
                table.add_column(h, justify="left" if h in ("config", "model", "budget", "verdict") else "right")
            for r in table_rows:
                table.add_row(*r)
            make_console().print(table)
    raise typer.Exit(EXIT_OK if all(r.fits for r in rows) else EXIT_DOES_NOT_FIT)


def _planner(model, batch, seq, optim, precision, target, grad_accum, checkpointing, gpu, need_budget: bool):
    """(Runner, budget label, capacity) for whatif / max-batch / advise."""
    from .device.nvml import query_gpus
    from .plan.check import budget_for
    from .plan.runner import Runner, stderr_progress
    from .spec import RunSpec

    query = query_gpus() if gpu is None or gpu.strip().isdigit() else None
    label, capacity, cc = None, None, (9, 0)
    if gpu is not None or need_budget or (query and query.gpus):
        label, capacity, cc = budget_for(gpu, query)
    spec = RunSpec(model=model, batch=batch, seq=seq, optim=optim, precision=precision, target=target,
                   grad_accum=grad_accum, checkpointing=checkpointing, compute_capability=cc)
    return Runner(spec, progress=stderr_progress), label, capacity


def _print_table(title: str, headers: list[str], rows: list[list[str]], markdown: bool) -> None:
    if markdown:
        from .report.markdown import table_markdown

        sys.stdout.write(table_markdown(headers, rows) + "\n")
        return
    from rich.table import Table

    from .report.console import make_console

    table = Table(title=title, title_justify="left")
    for h in headers:
        table.add_column(h)
    for r in rows:
        table.add_row(*r)
    make_console().print(table)


def _dump(doc) -> None:
    import json as _json

    sys.stdout.write(_json.dumps(doc, indent=2) + "\n")


@app.command()
def whatif(
    model: Model,
    seq: Annotated[Optional[str], typer.Option("--seq", "-s", help="Sequence lengths, e.g. 512,1024,2048,4096.")] = None,
    batch: Annotated[Optional[str], typer.Option("--batch", "-b", help="Batch sizes, e.g. 1,2,4,8.")] = None,
    optim: Optim = "adam",
    precision: Precision = "fp32",
    target: Target = "cuda",
    grad_accum: GradAccum = 1,
    checkpointing: Checkpointing = "none",
    gpu: Gpu = None,
    json: Json = False,
    markdown: Markdown = False,
    debug: Debug = False,
) -> None:
    """Peaks and device usage over a grid of sequence lengths and batch sizes, the fitted scaling,
    and the largest seq and batch that fit."""
    _hide_cuda()
    from .plan.whatif import parse_sizes, sweep
    from .units import format_bytes

    try:
        seqs = parse_sizes(seq, "--seq")
        batches = parse_sizes(batch, "--batch")
        if seqs is None and batches is None:
            raise MemestError("whatif needs sizes to sweep: --seq 512,1024,2048 and/or --batch 1,2,4,8")
        runner, label, capacity = _planner(model, (batches or [1])[0], (seqs or [None])[0], optim, precision, target,
                                           grad_accum, checkpointing, gpu, need_budget=False)
        result = sweep(runner, batches, seqs, capacity)
    except MemestError as exc:
        _fail(exc, debug)
        return
    if json:
        _dump({"schema_version": 1, "budget": label, "capacity_bytes": capacity, **result.to_dict()})
        return
    headers = ["batch", "seq", "peak allocated", "device" if target == "cuda" else "needed", "fits", "how"]
    rows = [[str(p.batch), str(p.seq or "-"), format_bytes(p.peak_bytes), format_bytes(p.needed_bytes),
             "-" if p.fits is None else ("yes" if p.fits else "no"), "traced" if p.traced else "fit"]
            for p in result.points]
    _print_table(f"memest whatif {model}" + (f" against {label}" if label else ""), headers, rows, markdown)
    for line in result.plain_words:
        typer.echo(line)
    v = result.verification
    if v:
        typer.echo(f"fit checked by a direct trace at batch {v['batch']}, seq {v['seq']}: peak error "
                   f"{100 * v['peak_error']:+.3f}%, device error {100 * v['needed_error']:+.3f}%")
    if result.fallback:
        typer.echo(f"note: {result.fallback}")
    if result.largest_batch is not None:
        typer.echo(f"largest batch that fits (fit): {result.largest_batch}")
    if result.largest_seq is not None:
        typer.echo(f"largest seq that fits (fit): {result.largest_seq}")
    typer.echo(f"{result.traces} traces for {len(result.points)} points")


@app.command("max-batch")
def max_batch(
    model: Model,
    gpu: Annotated[str, typer.Option("--gpu", help="Budget (24GB, 24GiB), card name or device index.")],
    seq: Seq = None,
    batch: Annotated[int, typer.Option("--batch", "-b", help="Batch when searching the sequence length.")] = 1,
    seq_search: Annotated[bool, typer.Option("--seq-search", help="Search the longest sequence instead.")] = False,
    optim: Optim = "adam",
    precision: Precision = "fp32",
    target: Target = "cuda",
    grad_accum: GradAccum = 1,
    checkpointing: Checkpointing = "none",
    limit: Annotated[int, typer.Option("--limit", help="Largest size tried.")] = 65536,
    json: Json = False,
    markdown: Markdown = False,
    debug: Debug = False,
) -> None:
    """The largest batch (or, with --seq-search, sequence length) that fits, found by search over
    traces; exact at the boundary."""
    _hide_cuda()
    from .plan.search import largest_fitting
    from .units import format_bytes

    try:
        runner, label, capacity = _planner(model, batch, seq, optim, precision, target, grad_accum, checkpointing,
                                           gpu, need_budget=True)
        key = "seq" if seq_search else "batch"
        if seq_search and runner.source.max_seq:
            limit = min(limit, runner.source.max_seq)
        start = (seq or 512) if seq_search else 1
        result = largest_fitting(runner, key, capacity, start=start, limit=limit)
    except MemestError as exc:
        _fail(exc, debug)
        return
    if json:
        _dump({"schema_version": 1, "budget": label, "traces": runner.traces, **result.to_dict()})
        return
    rows = [[str(v), format_bytes(n), "yes" if ok else "no"] for v, n, ok in sorted(set(result.probes))]
    _print_table(f"memest max-batch {model} against {label}", [key, "needed", "fits"], rows, markdown)
    if result.value == 0:
        typer.echo(f"even {key} 1 does not fit {label}: it needs {format_bytes(result.next_needed_bytes or 0)}; "
                   f"see memest advise")
    elif result.hit_limit:
        typer.echo(f"largest {key} that fits: at least {result.value} (the search stopped at --limit {limit})")
    else:
        typer.echo(f"largest {key} that fits: {result.value} ({format_bytes(result.needed_bytes)}); "
                   f"{result.value + 1} needs {format_bytes(result.next_needed_bytes)}")


@app.command()
def advise(
    model: Model,
    gpu: Annotated[str, typer.Option("--gpu", help="Budget (11GB, 11GiB), card name or device index.")],
    batch: Batch = 1,
    seq: Seq = None,
    optim: Optim = "adam",
    precision: Precision = "fp32",
    target: Target = "cuda",
    grad_accum: GradAccum = 1,
    checkpointing: Checkpointing = "none",
    json: Json = False,
    markdown: Markdown = False,
    debug: Debug = False,
) -> None:
    """Memory savers re-traced against a budget, ranked by time cost, and the cheapest combination
    that fits, with its command line."""
    _hide_cuda()
    from .plan.advise import advise as run_advise
    from .units import format_bytes

    try:
        runner, label, capacity = _planner(model, batch, seq, optim, precision, target, grad_accum, checkpointing,
                                           gpu, need_budget=True)
        advice = run_advise(runner, capacity)
    except MemestError as exc:
        _fail(exc, debug)
        return
    if json:
        _dump({"schema_version": 1, "budget": label, **advice.to_dict()})
        return
    typer.echo(f"as configured: {format_bytes(advice.base_needed_bytes)} against {label} "
               f"({format_bytes(capacity)}): {'fits' if advice.base_fits else 'does not fit'}")
    rows = [[r.name, format_bytes(r.needed_bytes), "yes" if r.fits else "no", r.time_cost] for r in advice.remedies]
    _print_table("remedies (each re-traced), cheapest first among those that fit",
                 ["remedy", "needed", "fits", "time cost"], rows, markdown)
    if advice.combination is None:
        typer.echo("no combination of these remedies fits; a larger GPU or more GPUs are needed")
    else:
        typer.echo(f"cheapest that fits: {advice.combination.name} ({format_bytes(advice.combination.needed_bytes)})")
        typer.echo(f"  {advice.command} --gpu {gpu}")
    typer.echo(f"{advice.traces} traces")


@app.command()
def gpus(json: Json = False, markdown: Markdown = False) -> None:
    """Live table of NVIDIA GPUs and their processes (NVML)."""
    from .device.nvml import query_gpus

    query = query_gpus()
    if json:
        import json as _json

        doc = {"gpus": [g.to_dict() for g in query.gpus], "reason": query.reason}
        sys.stdout.write(_json.dumps(doc, indent=2) + "\n")
        return
    if not query.gpus:
        typer.echo(query.reason)
        return
    if markdown:
        from .report.markdown import table_markdown
        from .units import format_bytes

        rows = [[str(g.index), g.name, format_bytes(g.total_bytes), format_bytes(g.used_bytes), format_bytes(g.free_bytes)]
                for g in query.gpus]
        sys.stdout.write(table_markdown(["index", "name", "total", "used", "free"], rows) + "\n")
        return
    from .report.console import gpus_table, make_console

    make_console().print(gpus_table(query))


@app.command()
def calibrate(
    device: Annotated[int, typer.Option("--device", help="NVML/CUDA index of the GPU to measure.")] = 0,
    json: Json = False,
    debug: Debug = False,
) -> None:
    """Measure this GPU's CUDA context and cuBLAS workspace once (this command does use the GPU, briefly,
    ~1 GiB); later estimates on the same GPU, driver and torch version use the measurements."""
    from .device.nvml import query_gpus

    query = query_gpus()
    try:
        if not query.gpus:
            raise MemestError(f"memest calibrate needs an NVIDIA GPU: {query.reason}")
        from .device.calibration import measure, save

        entry = measure(device)
        path = save(entry)
    except MemestError as exc:
        _fail(exc, debug)
        return
    if json:
        import json as _json

        sys.stdout.write(_json.dumps({"saved_to": str(path), **entry}, indent=2) + "\n")
        return
    from .units import format_bytes

    typer.echo(f"{entry['gpu_name']} (driver {entry['driver']}, torch {entry['torch_version']}):")
    typer.echo(f"  CUDA context     {format_bytes(entry['context_bytes'] or 0)}")
    typer.echo(f"  cuBLAS workspace {format_bytes(entry['cublas_workspace_bytes'])}")
    typer.echo(f"saved to {path}")


def main() -> None:
    app()


if __name__ == "__main__":
    main()

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
        from .estimate import estimate as run_estimate

        result = run_estimate(spec, calibration=_calibration_for(gpu, query) if target == "cuda" else None)
        report = result.report
        fits = fit_rows(result.needed_bytes, gpu, query, check=result.fits)
    except MemestError as exc:
        _fail(exc, debug)
        return
    reason = query.reason if query is not None else ""
    if json:
        from .report.json_doc import json_document

        sys.stdout.write(json_document(report, fits, reason, result.needed_bytes) + "\n")
    else:
        from .report.console import make_console, print_estimate

        print_estimate(make_console(), report, fits, reason, depth)
    if fail_if_not_fits and fits and not all(f.fits for f in fits):
        raise typer.Exit(EXIT_DOES_NOT_FIT)
    raise typer.Exit(EXIT_OK)


Margin = Annotated[Optional[str], typer.Option("--margin", help="Required headroom, e.g. 10%: needed x 1.1 must fit.")]
Markdown = Annotated[bool, typer.Option("--markdown", help="Print a Markdown table (for PR comments, CI summaries).")]


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


@app.command()
def gpus(json: Json = False) -> None:
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

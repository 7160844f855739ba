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
Depth = Annotated[int, typer.Option("--depth", help="Module-tree depth shown in the table.")]
Json = Annotated[bool, typer.Option("--json", help="One JSON document on stdout (schema in README).")]
FailIfNotFits = Annotated[
    bool, typer.Option("--fail-if-not-fits", help="Exit 1 when the estimate does not fit (for CI).")
]
Debug = Annotated[bool, typer.Option("--debug", help="Show tracebacks.")]


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
    gpu: Gpu = None,
    depth: Depth = 3,
    json: Json = False,
    fail_if_not_fits: FailIfNotFits = False,
    debug: Debug = False,
) -> None:
    """Trace two training steps on fake tensors; print memory per layer, the peak and whether it fits."""
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
        )
        from .estimate import estimate as run_estimate

        report = run_estimate(spec)
        fits = fit_rows(report.peak_allocated_bytes, gpu, query)
    except MemestError as exc:
        _fail(exc, debug)
        return
    reason = query.reason if query is not None else ""
    if json:
        from .report.json_doc import json_document

        sys.stdout.write(json_document(report, fits, reason) + "\n")
    else:
        from .report.console import make_console, print_estimate

        print_estimate(make_console(), report, fits, reason, depth)
    if fail_if_not_fits and fits and not all(f.fits for f in fits):
        raise typer.Exit(EXIT_DOES_NOT_FIT)
    raise typer.Exit(EXIT_OK)


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


def main() -> None:
    # memest must never create a CUDA context (hundreds of MiB on a card that may run a live job):
    # hide CUDA devices from torch in this process. NVML (memest gpus, --gpu) still sees every GPU.
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    app()


if __name__ == "__main__":
    main()

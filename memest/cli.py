"""The command line: declarations and calls. Each command's options come from the one table
(spec/options.py); each command parses, calls the app layer (app.py), and hands the result's View to the one
emit path; ``_run`` maps every error to its exit code."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Annotated

import typer

from memest.app import (
    run_advise,
    run_calibrate,
    run_check,
    run_estimate,
    run_gpus,
    run_max_batch,
    run_plan_parallel,
    run_serve,
    run_whatif,
    stderr_progress,
)
from memest.errors import EXIT_DOES_NOT_FIT, EXIT_OK, MemestError
from memest.exits import InWorker, OneLineErrors, output_format, run_command
from memest.report.views import (
    advise_view,
    calibrate_view,
    check_view,
    estimate_view,
    gpus_view,
    max_batch_view,
    plan_parallel_view,
    serve_view,
    whatif_view,
    with_trainer,
)
from memest.serve.engine import ServeSpec
from memest.spec import options
from memest.spec.choices import Choice, OutputFormat, Verdict
from memest.spec.config import spec_from_trainer
from memest.version import versions_line

app = typer.Typer(
    name="memest", cls=OneLineErrors,
    help="How much GPU memory will this PyTorch training step need? Traced on fake tensors, no GPU touched.",
    no_args_is_help=True, add_completion=True, pretty_exceptions_enable=False,
)


_SERVE_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ServeSpec)}


def _show_version(asked: bool) -> None:
    if asked:
        typer.echo(versions_line())
        raise typer.Exit(0)


@app.callback()
def _root(version: Annotated[bool, typer.Option("--version", is_eager=True, callback=_show_version,
                                                help="Print memest's, torch's and transformers' versions.")] = False) -> None:
    """How much GPU memory will this PyTorch training step need? Traced on fake tensors, no GPU touched."""


def _parameter(opt: options.Option, command: str) -> inspect.Parameter:
    if opt.argument:
        info = typer.Argument(help=opt.help)
    else:  # plan-parallel refuses what it searches (the app layer says why): not in its help
        info = typer.Option(*opt.flags, help=opt.help, hidden=opt.searched and command == "plan-parallel")
    default = inspect.Parameter.empty if opt.default is options.REQUIRED else opt.default_value
    if default is options.SERVE:
        default = _SERVE_DEFAULTS[opt.name]
        default = opt.kind(default) if issubclass(opt.kind, Choice) else default
    return inspect.Parameter(opt.name, inspect.Parameter.KEYWORD_ONLY, default=default,
                             annotation=Annotated[options.annotation(opt), info])


def command(name: str):
    """Register ``fn`` as the command ``name``, its parameters those the options table gives it."""
    def register(fn):
        parameters = [_parameter(o, name) for o in options.for_command(name)]
        fn.__signature__ = inspect.Signature(parameters, return_annotation=None)
        return app.command(name)(fn)

    return register


def _progress(on: bool = True):

    return stderr_progress if on else None


def _worker(model: str, o: dict, name: str) -> InWorker:
    """The command's work in a worker process, stopped after --timeout (the command's own default)."""
    default = next(opt.default for opt in options.for_command(name) if opt.name == "timeout")
    return InWorker(model, o["timeout"], default)


def _format(o: dict):
    return lambda: output_format(o["format"], o["json"], o.get("markdown", False))


def _given(o: dict) -> set[str]:
    """The options the user gave on the command line (not their defaults): they override a --from file."""
    try:  # typer >= 0.20 vendors click as typer._click
        from typer._click.core import ParameterSource
        from typer._click.globals import get_current_context
    except ImportError:
        from click.core import ParameterSource
        from click.globals import get_current_context

    ctx = get_current_context()
    return {name for name in o if ctx.get_parameter_source(name) in
            (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)}


def _read_from(o: dict, spec: dict, given: set[str], command: str, drop: tuple[str, ...] = ()):
    """``--from FILE`` (every command that traces one step's run): the file's run, the flags the user gave over
    it, its unknown keys warned on stderr; without it, MODEL is required. Returns (TrainerConfig or None, spec)."""
    if o["from_file"] is None:
        if spec["model"] is None:
            raise MemestError(f"{command} needs a MODEL (model.py, hf:NAME, hf:path/config.json) or --from FILE "
                              "(a trainer config: axolotl, LLaMA-Factory, DeepSpeed JSON, ...)")
        return None, spec
    trainer, spec = spec_from_trainer(o["from_file"], spec, given, drop, command)
    if trainer.unknown:
        typer.echo(f"memest: warning: {o['from_file']}: {len(trainer.unknown)} key(s) not understood (not "
                   f"modelled): {', '.join(trainer.unknown)}", err=True)
    return trainer, spec


def _model_name(spec: dict, o: dict) -> str:
    """What a worker's error names: the model, else the --from file."""
    return spec["model"] or o["from_file"] or ""


@command("estimate")
def estimate(**o) -> None:
    """Trace two training steps on fake tensors; print memory per layer, the peak and whether it fits."""
    spec = options.step_spec(o, "estimate")
    given = _given(o)
    trainer = None

    def work():
        nonlocal spec, trainer
        trainer, spec = _read_from(o, spec, given, "estimate")
        if o["depth"] < 0:  # an empty table otherwise (issue 22, 35)
            raise MemestError(f"--depth {o['depth']}: the module-tree depth is 0 (the model) or more, e.g. --depth 3")
        fail = o["fail_if_not_fits"]
        result = run_estimate(spec, o["gpu"], fail_if_not_fits=fail, plot=o["plot"],
                              timeline=_format(o)() == OutputFormat.TABLE, progress=_progress(),
                              calibration=o["calibration"],
                              colocate=None if o["colocate_serve"] is None else {"utilization": o["colocate_serve"]})
        if result.plot_path is not None:
            typer.echo(f"memest: wrote {result.plot_path}", err=True)
        code = EXIT_DOES_NOT_FIT if fail and result.passes(o["strict"]) is False else EXIT_OK
        if fail and not o["strict"] and result.verdict == Verdict.TIGHT:  # as check says it (README, usage.md)
            typer.echo("memest: warning: TIGHT: counted as fitting; --strict counts tight as not fitting", err=True)
        return with_trainer(estimate_view(result, o["depth"], o["expand"]), trainer), code

    run_command(work, _format(o), o["debug"], worker=_worker(_model_name(spec, o), o, "estimate"))


@command("check")
def check(**o) -> None:
    """CI gate: exit 0 when every config fits its GPU or budget (tight counts as fitting unless --strict),
    1 when any does not, 2 for a bad config."""
    overrides = options.step_spec(o, "check")

    def work():

        result = run_check(o["configs"], overrides, o["gpu"], o["margin"], progress=_progress(), strict=o["strict"],
                           calibration=o["calibration"], timeout=o["timeout"])
        for row in result.rows:
            if row.trainer is not None and row.trainer.unknown:
                typer.echo(f"memest: warning: {row.path}: from {row.trainer.path}: {len(row.trainer.unknown)} key(s) "
                           f"not understood (not modelled): {', '.join(row.trainer.unknown)}", err=True)
        if result.tight and not o["strict"]:
            typer.echo(f"memest: warning: TIGHT ({', '.join(r.name for r in result.tight)}): counted as fitting; "
                       "--strict counts tight as not fitting", err=True)
        return check_view(result), EXIT_OK if result.fits else EXIT_DOES_NOT_FIT

    run_command(work, _format(o), o["debug"])


def _sizes(text: str | None, flag: str):
    from memest.plan.whatif import parse_sizes

    return parse_sizes(text, flag)


@command("whatif")
def whatif(**o) -> None:
    """Peaks and needed memory over a grid of sequence lengths and batch sizes, the fitted scaling, and
    the largest seq and batch that fit."""
    spec = options.step_spec(o, "whatif")
    given = _given(o) - {"batch", "seq"}  # the grids: a --from file's batch and seq are the fixed sizes

    def work():
        trainer, base = _read_from(o, {**spec, "batch": None, "seq": None}, given, "whatif")
        base = {k: v for k, v in base.items() if k not in ("batch", "seq") or v is not None}
        run = run_whatif(base, _sizes(o["batch"], "--batch"), _sizes(o["seq"], "--seq"), o["gpu"],
                         progress=_progress(), calibration=o["calibration"])
        return with_trainer(whatif_view(run), trainer), EXIT_OK

    run_command(work, _format(o), o["debug"], worker=_worker(_model_name(spec, o), o, "whatif"))


@command("max-batch")
def max_batch(**o) -> None:
    """The largest batch (or, with --seq-search, sequence length) that fits, found by search over traces;
    exact at the boundary."""
    spec = options.step_spec(o, "max-batch")
    given = _given(o)

    def work():
        trainer, run_spec = _read_from(o, spec, given, "max-batch")
        run = run_max_batch(run_spec, o["gpu"], o["seq_search"], o["limit"], progress=_progress(),
                            calibration=o["calibration"])
        return with_trainer(max_batch_view(run), trainer), EXIT_OK

    run_command(work, _format(o), o["debug"], worker=_worker(_model_name(spec, o), o, "max-batch"))


@command("advise")
def advise(**o) -> None:
    """Memory savers re-traced against a budget, ranked by time cost, and the cheapest combination that
    fits, with its command line."""
    spec = options.step_spec(o, "advise")
    given = _given(o)

    def work():
        trainer, run_spec = _read_from(o, spec, given, "advise")
        return with_trainer(advise_view(run_advise(run_spec, o["gpu"], progress=_progress(),
                                                   calibration=o["calibration"], gpus=o["gpus"])), trainer), EXIT_OK

    run_command(work, _format(o), o["debug"], worker=_worker(_model_name(spec, o), o, "advise"))


@command("serve")
def serve(**o) -> None:
    """Serving capacity: the engine's start-up arithmetic (vLLM or SGLang), KV tokens and blocks, how many
    sequences fit at --max-model-len, the longest context, and whether it starts (with fixes)."""
    def work():

        args = {"model": o["model"], **options.serve_args(o)}
        run = run_serve(args, o["gpu"], progress=_progress(), calibration=o["calibration"])
        code = EXIT_DOES_NOT_FIT if o["fail_if_not_starts"] and not run.plan.starts else EXIT_OK
        return serve_view(run), code

    run_command(work, _format(o), o["debug"], worker=_worker(o["model"], o, "serve"))


@command("plan-parallel")
def plan_parallel(**o) -> None:
    """dp x tp (x pp) layouts of --gpus GPUs: each rank's need, those that fit ranked by communication per step."""
    spec = options.step_spec(o, "plan-parallel")
    given = _given(o)
    searched = tuple(opt.name for opt in options.for_command("plan-parallel") if opt.searched)

    def work():
        trainer, run_spec = _read_from(o, spec, given, "plan-parallel", drop=searched)
        view = plan_parallel_view(run_plan_parallel(run_spec, o["gpus"], o["gpu"], progress=_progress(),
                                                    calibration=o["calibration"], top=o["top"]))
        return with_trainer(view, trainer), EXIT_OK

    run_command(work, _format(o), o["debug"], worker=_worker(_model_name(spec, o), o, "plan-parallel"))


@command("gpus")
def gpus(**o) -> None:
    """Live table of NVIDIA GPUs and their processes (NVML)."""
    def work():

        return gpus_view(run_gpus()), EXIT_OK

    run_command(work, _format(o), o["debug"])


@command("calibrate")
def calibrate(**o) -> None:
    """Measure this GPU's CUDA context, libraries (cuBLAS, cuDNN, NCCL) and cuBLAS workspace once (this
    command does use the GPU, briefly, ~1 GiB); later estimates on the same GPU, driver and torch version
    use the measurements, and --out FILE makes them portable."""
    def work():

        return calibrate_view(run_calibrate(o["device"], o["out"], o["nccl"])), EXIT_OK

    run_command(work, _format(o), o["debug"], hide_gpus=False)


def main() -> None:
    # one name however it is started (`memest`, `python -m memest`): the usage lines and shell completion's
    # _MEMEST_COMPLETE variable (typer's --install-completion / --show-completion) read it
    app(prog_name="memest")


if __name__ == "__main__":
    main()

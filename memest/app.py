"""The app layer: what every command does between parsing and printing.

Each ``run_*`` function resolves the model source, the GPU / budget / GPU generation / calibration
once (``resolve_gpu``), runs the pipeline or a planner with user code guarded (``user_code``), and
returns a result object. The CLI (cli.py) and the Python API (api.py) are thin clients of this
module; views (report/views.py) turn results into tables, Markdown and JSON.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from memest.device import calibration, nvml  # by module: tests stand in for NVML and the measurement
from memest.device.calibration import cache_file, check_profile, describe, load_profile, lookup, save, write_profile
from memest.device.catalogue import DEFAULT_COMPUTE_CAPABILITY, compute_capability
from memest.device.fit import FitRow, no_device, passes, resolve_budget, verdict, worst
from memest.errors import MemestError, ModelLoadError
from memest.plan.check import check_config, check_serve_config, serve_spec
from memest.plan.parallel import plan_parallel
from memest.serve.colocate import check_colocate, colocated_engine
from memest.serve.gpu import serve_measured, serve_total
from memest.serve.plan import ServeSpec, plan_serve
from memest.serve.plan import validate as validate_serve
from memest.spec import RunSpec, options
from memest.spec.choices import Preference, Target, Verdict
from memest.spec.config import load_config, parse_margin
from memest.spec.options import searched_set
from memest.units import format_bytes
from memest.worker import DEFAULT_TIMEOUT_S, in_worker

Progress = Callable[[str], None]


def stderr_progress(message: str) -> None:
    print(f"memest: {message}", file=sys.stderr, flush=True)


def say_warnings(source, progress: Progress | None) -> None:
    """What the model source built that its config did not name (sources/hf_auto.py): on stderr as well as in
    the report, so that a CI log shows it."""
    for line in getattr(source, "warnings", ()) if progress is not None else ():
        progress(f"warning: {source.name}: {line}")


def hide_cuda() -> None:
    """memest must never create a CUDA context (hundreds of MiB on a card that may run a live job):
    the CLI hides CUDA devices from torch in its own process before torch is used. NVML (gpustat)
    still sees every GPU. The Python API does not do this (it runs inside the user's process)."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ""


# ------------------------------------------------------------------------------------ user code


@contextlib.contextmanager
def user_code(origin: str, quiet_stdout: bool = True) -> Iterator[None]:
    """Around anything that runs the user's model code: what it prints goes to stderr (stdout carries
    only memest's own output: one JSON document under --json), at both levels: Python's ``sys.stdout`` and
    file descriptor 1, which ``os.write(1, ...)``, ``os.system``, subprocesses and C extensions write to.
    ``sys.exit()`` or any other ``BaseException`` (but Ctrl-C) raised by model code becomes an error (exit
    2) naming ``origin`` instead of deciding memest's exit code."""
    redirect = contextlib.redirect_stdout(sys.stderr) if quiet_stdout else contextlib.nullcontext()
    try:
        with stdout_fd_to_stderr() if quiet_stdout else contextlib.nullcontext(), redirect:
            yield
    except SystemExit as exc:
        raise ModelLoadError(
            f"{origin}: the model code called sys.exit({exc.code!r}) while memest ran it; memest decides its "
            "own exit code, so this is an error: remove the exit from the model file's import path, "
            "build_model() and example_inputs()"
        ) from None
    except (Exception, KeyboardInterrupt, GeneratorExit):
        raise
    except BaseException as exc:  # e.g. `class Boom(BaseException)`: past every `except Exception`
        first = (str(exc).strip().splitlines() or [""])[0]
        raise ModelLoadError(
            f"{origin}: the model code raised {type(exc).__name__}({first!r}), a BaseException that is not an "
            "Exception; raise an Exception subclass (or fix the cause)"
        ) from None


@contextlib.contextmanager
def stdout_fd_to_stderr() -> Iterator[None]:
    """File descriptor 1 points at stderr's file inside the block (os.dup / os.dup2), restored after; a
    process without a usable fd 1 or 2 is left as it is."""
    try:
        sys.stdout.flush()
    except (OSError, ValueError):
        pass
    try:
        saved = os.dup(1)
    except OSError:
        yield
        return
    try:
        os.dup2(2, 1)
    except OSError:
        os.close(saved)
        yield
        return
    try:
        yield
    finally:
        try:
            sys.stdout.flush()  # whatever model code left in Python's buffer goes where it was written: stderr
        except (OSError, ValueError):
            pass
        os.dup2(saved, 1)
        os.close(saved)


@contextlib.contextmanager
def ticker(what: str, progress: Progress | None, after: float = 3.0, every: float = 10.0) -> Iterator[None]:
    """Long work says it is alive on stderr: '<what>: 13 s' after ``after`` s, then every ``every`` s."""
    if progress is None:
        yield
        return
    done = threading.Event()
    start = time.perf_counter()

    def tick() -> None:
        wait = after
        while not done.wait(wait):
            progress(f"{what}: {time.perf_counter() - start:.0f} s")
            wait = every

    thread = threading.Thread(target=tick, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


# ------------------------------------------------------------------------------------------ GPUs


@dataclass
class GpuContext:
    """The GPU side of a command, resolved once: what to compare with, which GPU generation's kernels
    to model, and the calibration that applies."""

    flag: str | None  # what the user passed as --gpu / gpu:
    targets: list[Budget]  # what to compare with: the budget, the chosen GPU, or every visible GPU
    compute_capability: tuple[int, int]
    arch_reason: str  # why this generation: 'the named card a100', 'GPU 0 NVIDIA ...', 'default: ...'
    calibration: dict | None = None
    no_gpu_reason: str = ""

    @property
    def calibration_note(self) -> str | None:

        return describe(self.calibration) if self.calibration else None

    @property
    def arch(self) -> str:
        major, minor = self.compute_capability
        return f"sm{major}{minor}"

    @property
    def budget_label(self) -> str | None:
        return self.targets[0].label if self.targets else None

    @property
    def capacity_bytes(self) -> int | None:
        """The budget (planners and check compare with one): the first target's."""
        return self.targets[0].capacity_bytes if self.targets else None

    def fit_rows(self, needed: int, fits: Callable[[int], bool] | None = None,
                 needed_range: tuple[int, int, int] | None = None, floor: int | None = None) -> list:
        """One FitRow per target; ``fits(capacity)`` decides when given (else needed <= capacity);
        ``needed_range`` (low, expected, high) gives each row its three-way verdict; ``floor``: below it
        does not fit, between it and needed tight (device/fit.verdict; None: needed)."""

        low, _, high = needed_range or (needed, needed, needed)
        rows = []
        for t in self.targets:
            ok = fits(t.capacity_bytes) if fits else needed <= t.capacity_bytes
            rows.append(FitRow(t.label, t.capacity_bytes, t.total_bytes, t.used_bytes, needed, ok,
                               t.capacity_bytes - needed, verdict(needed, high, t.capacity_bytes, floor) if ok
                               or floor is not None else Verdict.DOES_NOT_FIT, low, high))
        return rows


@dataclass
class Budget:
    label: str
    capacity_bytes: int
    total_bytes: int | None = None
    used_bytes: int | None = None


def resolve_gpu(gpu: str | None, *, need_budget: bool = False, target: Target | str = Target.CUDA,
                calibration: str | Path | dict | None = None) -> GpuContext:
    """--gpu: a size (11GB = 10^9 B, 11GiB = 2^30 B), a card name (rtx2080ti) or a device index (0);
    None: every visible GPU's free memory (NVML). ``need_budget``: a command that cannot run without a
    budget (max-batch, advise, --fail-if-not-fits) fails here, before any trace. ``calibration``: a
    profile (file or dict, `memest calibrate --out`): its GPU generation is the one modelled, and its
    measurements replace the defaults; without one, a cached calibration of the local GPU applies."""

    flag = gpu.strip() if isinstance(gpu, str) else (str(gpu) if gpu is not None else None)
    if flag == "":
        raise MemestError("--gpu is empty; pass a size such as 11GB, a card name such as rtx2080ti, or a device index")
    resolved = resolve_budget(flag) if flag is not None else None
    named_card = isinstance(resolved, tuple) and not flag[:1].isdigit()
    query = None
    if not named_card:  # a size, a device index or nothing: the local GPUs decide the generation
        query = nvml.query_gpus()
    gpus = list(query.gpus) if query is not None else []
    no_gpu_reason = query.reason if query is not None else ""
    if isinstance(resolved, tuple):
        text, capacity = resolved
        label = text if named_card else f"budget {text}"
        if not named_card and not text.lower().endswith("ib"):  # decimal units: show the binary value beside
            label += f" ({format_bytes(capacity)})"
        targets = [Budget(label, capacity, capacity)]
    else:
        if isinstance(resolved, int):
            gpus = [g for g in gpus if g.index == resolved]
            if not gpus:
                visible = sorted(g.index for g in query.gpus) if query is not None else []
                why = no_gpu_reason or f"visible GPUs: {visible or 'none'}"
                raise MemestError(no_device(resolved, why))
        targets = [Budget(f"GPU {g.index} {g.name} (free)", g.free_bytes, g.total_bytes, g.used_bytes) for g in gpus]
    if need_budget and not targets:
        raise MemestError(
            f"no budget to compare with ({no_gpu_reason or 'no GPU'}); pass --gpu with a size such as 11GB or a "
            "card name such as rtx2080ti"
        )
    if named_card:
        cc, why = compute_capability(flag) or DEFAULT_COMPUTE_CAPABILITY, f"the named card {flag}"
    elif gpus and compute_capability(gpus[0].name):
        cc, why = compute_capability(gpus[0].name), f"GPU {gpus[0].index} {gpus[0].name}"
    else:
        cc = DEFAULT_COMPUTE_CAPABILITY
        why = "default: no GPU named or visible; --gpu CARD (e.g. --gpu a100) models another generation"
    profile = None
    if calibration is not None and Target.parse(target, "--target") != Target.CUDA:
        raise MemestError("--calibration replaces measured CUDA costs (context, libraries, workspace); --target "
                          f"{target} has none of them: drop the calibration, or use --target cuda")
    if calibration is not None:
        profile = load_calibration(calibration)
        if named_card and tuple(cc) != tuple(profile["compute_capability"]):
            raise MemestError(
                f"the calibration profile was measured on {profile['gpu_name']} (sm{''.join(map(str, profile['compute_capability']))}) "
                f"but --gpu {flag} is sm{''.join(map(str, cc))}; pass a profile measured on that card, or a budget size "
                "such as --gpu 11GB with this profile"
            )
        if not named_card:
            cc, why = tuple(profile["compute_capability"]), f"the calibration profile's GPU, {profile['gpu_name']}"
    elif gpus and str(target) == "cuda" and not named_card:
        profile = _calibration(gpus[0].name, query.driver)
    return GpuContext(flag, targets, tuple(cc), why, profile if str(target) == "cuda" else None, no_gpu_reason)


def load_calibration(calibration: str | Path | dict) -> dict:
    """A calibration profile from a file (checked, device/calibration.load_profile) or a dict."""

    if isinstance(calibration, dict):
        return check_profile(calibration, "calibration dict")
    if not isinstance(calibration, (str, Path)):
        raise MemestError(f"calibration: expected a profile file (from `memest calibrate --out`) or its dict, got "
                          f"{calibration!r}")
    return load_profile(calibration)


def _calibration(gpu_name: str, driver: str) -> dict | None:
    import torch


    return lookup(gpu_name, driver, torch.__version__)


# ------------------------------------------------------------------------------------- estimate


@dataclass
class EstimateResult:
    estimate: object  # estimator.Estimate
    gpu: GpuContext
    fits: list  # device.fit.FitRow per compared GPU or budget
    timeline: object = None  # report.timeline.Timeline, when asked for
    plot_path: Path | None = None
    colocate: object = None  # serve.colocate.Colocate: a rollout engine sharing the GPU (--colocate-serve)

    @property
    def report(self):
        return self.estimate.report

    @property
    def verdict_fits(self) -> bool | None:
        """Expected needed <= every budget compared (fits or tight); None without a budget."""
        return all(f.fits for f in self.fits) if self.fits else None

    @property
    def verdict(self) -> str | None:
        """The worst three-way verdict over the budgets compared: fits | tight | does-not-fit."""

        return worst([f.verdict for f in self.fits] + ([self.colocate.verdict] if self.colocate else []))

    def passes(self, strict: bool = False) -> bool | None:
        """For exit codes: fits, or tight unless ``strict``; None without a budget."""

        return passes(self.verdict, strict) if self.fits else None


def check_plot_path(path: str | None) -> Path | None:
    """--plot: a known file type in a folder memest can write to, checked before any trace."""
    if path is None:
        return None
    from memest.report.plot import FORMATS

    out = Path(path)
    if out.suffix.lower() not in FORMATS:
        raise MemestError(f"cannot write a plot to {path!r}: use a file name ending in {', '.join(FORMATS)}")
    folder = out.parent if str(out.parent) else Path(".")
    try:  # a path component over the file system's limit (ENAMETOOLONG) fails here, not after the trace
        longest = _name_max(folder)
        if len(os.fsencode(out.name)) > longest:
            raise MemestError(f"cannot write a plot to {path!r}: the file name is {len(os.fsencode(out.name))} bytes, "
                              f"over this file system's limit of {longest}; choose a shorter name")
        if out.is_dir():
            raise MemestError(f"cannot write a plot to {path!r}: it is a folder; name a file such as step.html")
        if not folder.is_dir():
            raise MemestError(f"cannot write a plot to {path!r}: folder {str(folder)!r} does not exist")
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".memest-", suffix=".check"):
            pass
    except OSError as exc:
        fix = ("a folder name is over the file system's limit; choose shorter names" if exc.errno == errno.ENAMETOOLONG
               else "choose a writable folder")
        raise MemestError(f"cannot write a plot to {path!r}: {exc.strerror or exc} ({fix})") from None
    return out


def _name_max(folder: Path) -> int:
    """The longest file name ``folder``'s file system takes (POSIX NAME_MAX; 255 on ext4, xfs, btrfs, NTFS, APFS)."""
    try:
        return os.pathconf(folder, "PC_NAME_MAX")
    except (AttributeError, OSError, ValueError):  # no pathconf (Windows) or no answer
        return 255


def run_estimate(
    spec_args: dict,
    gpu: str | None = None,
    *,
    fail_if_not_fits: bool = False,
    plot: str | None = None,
    timeline: bool = False,
    progress: Progress | None = None,
    source=None,
    calibration: str | Path | None = None,
    colocate: dict | None = None,
) -> EstimateResult:
    """``spec_args``: RunSpec fields (strings or enums); compute_capability comes from ``gpu`` (or the
    calibration profile's GPU). ``colocate``: a rollout engine on the same GPU (``utilization``,
    ``max_model_len``, ``max_num_seqs``, ``tp``; serve/colocate.py)."""
    from memest.estimator import estimate
    from memest.sources import load_source

    plot_path = check_plot_path(plot)
    ctx = resolve_gpu(gpu, need_budget=False, target=spec_args.get("target", Target.CUDA), calibration=calibration)
    if colocate is not None and ctx.capacity_bytes is None:
        raise MemestError("--colocate-serve needs the GPU it shares: pass --gpu with a card name (h100) or a size")
    if colocate is not None:
        check_colocate(RunSpec(**{**spec_args, "compute_capability": ctx.compute_capability}), colocate)
    if fail_if_not_fits and ctx.capacity_bytes is None:
        raise MemestError(
            f"--fail-if-not-fits needs something to compare with, and there is none ({ctx.no_gpu_reason or 'no GPU'}); "
            "pass --gpu 11GB (a size), a card name or a device index"
        )
    spec = RunSpec(**{**spec_args, "compute_capability": ctx.compute_capability})
    cuda = spec.target == Target.CUDA
    notes = [f"CUDA kernels modelled for {ctx.arch} ({ctx.arch_reason})"] if cuda else []  # after the estimate's own
    if cuda and ctx.calibration_note:
        notes.append(ctx.calibration_note)
    with user_code(spec.model):
        source = source or load_source(spec.model)
        say_warnings(source, progress)
        with ticker(f"tracing {source.name}", progress):
            result = estimate(spec, calibration=ctx.calibration if cuda else None, source=source, notes=notes)
    fits = ctx.fit_rows(result.needed_bytes, result.fits, result.needed_range, result.needed_floor)
    out = EstimateResult(result, ctx, fits)
    if colocate is not None:
        with user_code(spec.model), ticker("colocated rollout engine", progress):
            out.colocate = colocated_engine(spec, ctx, result.needed_range, colocate)
    if timeline or plot_path is not None:
        from memest.report.timeline import category_timeline

        out.timeline = category_timeline(result.trace)
    if plot_path is not None:
        from memest.report.plot import budget_lines, plot_timeline

        lines = budget_lines(result.needed_bytes, [(row.label, row.capacity_bytes) for row in fits])
        try:
            out.plot_path = plot_timeline(out.timeline, result.report, plot_path, lines)
        except OSError as exc:  # a full disk (ENOSPC), a quota, the folder removed meanwhile: the user's to fix
            raise MemestError(f"cannot write a plot to {str(plot_path)!r}: {exc.strerror or exc} (free space or "
                              "choose another folder)") from None
    return out


# ---------------------------------------------------------------------------------------- check


@dataclass
class CheckResult:
    rows: list  # plan.check.CheckRow
    strict: bool = False  # tight counts as not fitting

    @property
    def fits(self) -> bool:
        """Every config passes: fits, or tight unless strict (the exit code)."""
        return all(r.fits for r in self.rows)

    @property
    def verdict(self) -> str | None:

        return worst([r.verdict for r in self.rows])

    @property
    def tight(self) -> list:
        return [r for r in self.rows if r.verdict == Verdict.TIGHT]


def run_check(
    paths: list[str], overrides: dict, gpu: str | None, margin, *, strict_unit: bool = False,
    progress: Progress | None = None, strict: bool = False, calibration: str | Path | None = None,
    timeout: float | None = DEFAULT_TIMEOUT_S, worker: bool = True,
) -> CheckResult:
    """Every config is read, validated, its budget resolved and its model loaded before any is traced;
    errors name the file. ``strict``: a tight verdict counts as not fitting. ``calibration`` (a profile
    file) overrides each config's ``calibration:``. ``worker``: the models are loaded and traced in one worker
    process (memest/worker.py), stopped after ``timeout`` seconds; an exit, signal or crash there is an error
    naming the config and its model file."""
    from memest.plan.precheck import check_before_trace
    from memest.sources import load_source

    if not paths:
        raise MemestError("memest check needs at least one YAML run config (see configs/)")
    margin_value = parse_margin(margin, "--margin") if margin is not None else None
    timeout = check_timeout(timeout)
    configs = []
    for path in paths:
        cfg = load_config(path)
        given = [k for k, v in overrides.items() if v is not None]
        if cfg.serve is not None and given:
            flags = ", ".join(options.spec_options()[k].flags[0] for k in given)
            raise MemestError(f"{path}: a serving config (serve:) takes no training options; {flags} would be ignored")
        try:
            ctx = resolve_gpu(cfg.gpu if gpu is None else gpu, need_budget=True,
                              target=overrides.get("target") or cfg.values.get("target", Target.CUDA),
                              calibration=calibration if calibration is not None else cfg.calibration)
            spec = cfg.spec(**overrides, compute_capability=ctx.compute_capability)
        except MemestError as exc:
            raise _in_config(exc, path, overrides) from None
        configs.append((path, cfg, ctx, spec))

    def traced(at: Callable[[str], None]) -> list:  # user code: in the worker process
        prepared = []
        for path, cfg, ctx, spec in configs:  # every model loaded before any is traced
            at(f"{path}: {spec.model}")
            try:
                with user_code(f"{path}: {spec.model}"):
                    source = load_source(spec.model)
                say_warnings(source, progress)
                with user_code(f"{path}: {spec.model}"):  # knowable now: before any config is traced (issue 22, 28)
                    if cfg.serve is None:
                        check_before_trace(source, spec)
                    else:
                        validate_serve(serve_spec(cfg, ctx))
            except MemestError as exc:
                raise _in_config(exc, path, overrides) from None
            prepared.append((cfg, ctx, spec, source))
        rows = []
        start = time.perf_counter()
        for k, (cfg, ctx, spec, source) in enumerate(prepared, 1):
            at(f"{cfg.path}: {spec.model}")
            if progress:
                progress(f"check {k}/{len(prepared)}: {cfg.name} ({spec.model}) ...")
            try:
                with user_code(f"{cfg.path}: {spec.model}"), ticker(f"check {k}/{len(prepared)} {cfg.name}", progress):
                    if cfg.serve is not None:
                        row = check_serve_config(cfg, ctx, margin_value, strict=strict)
                    else:
                        row = check_config(cfg, spec, source, ctx, margin_value, strict=strict)
            except MemestError as exc:
                raise _in_config(exc, cfg.path, overrides) from None
            rows.append(row)
            if progress:
                progress(f"check {k}/{len(prepared)}: {cfg.name}: {row.verdict.replace('-', ' ')} "
                         f"({time.perf_counter() - start:.1f} s elapsed)")
        return rows

    rows = in_worker(traced, timeout, label=f"{configs[0][0]}: {configs[0][3].model}") if worker else traced(
        lambda label: None)
    return CheckResult(rows, strict)


def _in_config(exc: MemestError, path, overrides: dict) -> MemestError:
    """The error as the config's: its file first, and a flag the user did not pass named as its YAML key
    ("--tp 3: ..." -> "tp: 3: ..."; a check override keeps its flag)."""
    text = options.as_yaml_keys(str(exc), keep=[name for name, value in overrides.items() if value is not None])
    text = text if text.startswith(str(path)) else f"{path}: {text}"
    return type(exc)(text)


def check_timeout(timeout: float | None, default: float | None = DEFAULT_TIMEOUT_S) -> float | None:
    """--timeout: seconds > 0 (None: no limit); ``default``: the command's own default, as its error says it."""
    if timeout is not None and not (timeout > 0 and timeout != float("inf")):
        said = "no limit" if default is None else f"{default:g}"
        raise MemestError(f"--timeout must be a number of seconds above 0 (default: {said}), got {timeout:g}")
    return timeout


# ------------------------------------------------------------------------------------- planners


@dataclass
class PlannerContext:
    runner: object  # plan.runner.Runner
    gpu: GpuContext


def planner(spec_args: dict, gpu: str | None, need_budget: bool, progress: Progress | None,
            calibration: str | Path | None = None) -> PlannerContext:
    from memest.plan.runner import Runner

    ctx = resolve_gpu(gpu, need_budget=need_budget, target=spec_args.get("target", Target.CUDA),
                      calibration=calibration)
    spec = RunSpec(**{**spec_args, "compute_capability": ctx.compute_capability})
    with user_code(spec.model):
        runner = Runner(spec, calibration=ctx.calibration if spec.target == Target.CUDA else None, progress=progress)
    say_warnings(runner.source, progress)
    return PlannerContext(runner, ctx)


def check_seq_limit(source, seqs: list[int], flag: str = "--seq") -> None:
    limit = getattr(source, "max_seq", None)
    too_long = [s for s in seqs if s is not None and limit and s > limit]
    if too_long:
        raise MemestError(
            f"{flag} {max(too_long)}: {source.name} takes at most {limit} positions; sweep lengths up to {limit}"
        )


@dataclass
class WhatifResult:
    sweep: object  # plan.whatif.Sweep
    gpu: GpuContext
    model: str
    target: str
    outputs: str = ""  # the training loop the traces assume (--outputs); '' outside training


def run_whatif(spec_args: dict, batches: list[int] | None, seqs: list[int] | None, gpu: str | None,
               progress: Progress | None = None, calibration: str | Path | None = None) -> WhatifResult:
    from memest.plan.whatif import sweep

    if seqs is None and batches is None:
        raise MemestError("whatif needs sizes to sweep: --seq 256,512,1024 and/or --batch 1,2,4,8")
    args = {**spec_args, "batch": (batches or [spec_args.get("batch") or 1])[0],
            "seq": (seqs or [spec_args.get("seq")])[0]}
    ctx = planner(args, gpu, need_budget=False, progress=progress, calibration=calibration)
    check_seq_limit(ctx.runner.source, seqs or [])
    with user_code(args["model"]):
        result = sweep(ctx.runner, batches, seqs, ctx.gpu.capacity_bytes)
    return WhatifResult(result, ctx.gpu, args["model"], str(ctx.runner.base.target), _loop(ctx.runner.base))


@dataclass
class SearchRun:
    result: object  # plan.search.SearchResult
    gpu: GpuContext
    model: str
    traces: int
    outputs: str = ""  # the training loop the traces assume (--outputs); '' outside training


def _loop(spec: RunSpec) -> str:
    return str(spec.outputs) if spec.training else ""


def run_max_batch(spec_args: dict, gpu: str, seq_search: bool, limit: int,
                  progress: Progress | None = None, calibration: str | Path | None = None) -> SearchRun:
    from memest.plan.search import largest_fitting

    if limit < 1:
        raise MemestError(f"--limit must be at least 1, got {limit}")
    if not seq_search and Preference.parse(spec_args.get("preference") or Preference.NONE, "preference") == Preference.GRPO:
        from types import SimpleNamespace

        from memest.features.grpo import generations_of

        # the searched batch counts completions, a multiple of --generations: the base is one group (battery 30)
        spec_args = {**spec_args, "batch": generations_of(SimpleNamespace(generations=spec_args.get("generations") or 0))}
    ctx = planner(spec_args, gpu, need_budget=True, progress=progress, calibration=calibration)
    runner = ctx.runner
    key = "seq" if seq_search else "batch"
    cap = f"--limit {limit}"
    if seq_search and runner.source.max_seq and runner.source.max_seq < limit:  # the model's positions cap the search
        limit = runner.source.max_seq
        why = f" ({runner.source.max_seq_why})" if runner.source.max_seq_why else ""
        cap = f"the model's {limit} positions{why}"
    if not seq_search:
        check_seq_limit(runner.source, [runner.base.seq])
    start = (runner.base.seq or 512) if seq_search else 1
    with user_code(spec_args["model"]):
        result = largest_fitting(runner, key, ctx.gpu.capacity_bytes, start=min(start, limit), limit=limit, cap=cap)
    return SearchRun(result, ctx.gpu, spec_args["model"], runner.traces, _loop(runner.base))


@dataclass
class AdviseRun:
    advice: object  # plan.advise.Advice
    gpu: GpuContext
    model: str


def run_advise(spec_args: dict, gpu: str, progress: Progress | None = None,
               calibration: str | Path | None = None, gpus: int | None = None) -> AdviseRun:
    """``gpus``: also the best layouts of that many GPUs from plan-parallel's planner (hf: models)."""
    from memest.plan.advise import advise

    if gpus is not None and gpus < 2:
        raise MemestError(f"--gpus lays the model out on several GPUs; give at least 2, got {gpus}")
    ctx = planner(spec_args, gpu, need_budget=True, progress=progress, calibration=calibration)
    check_seq_limit(ctx.runner.source, [ctx.runner.base.seq])
    with user_code(spec_args["model"]):
        advice = advise(ctx.runner, ctx.gpu.capacity_bytes, gpus=gpus, budget_label=ctx.gpu.budget_label,
                        command_options={"gpu": gpu, "calibration": calibration})
    return AdviseRun(advice, ctx.gpu, spec_args["model"])


@dataclass
class ParallelPlanRun:
    plan: object  # plan.parallel.ParallelPlan
    gpu: GpuContext
    calibration: str | None = None  # --calibration, for the layouts' command lines


def run_plan_parallel(spec_args: dict, gpus: int, gpu: str, progress: Progress | None = None,
                      calibration: str | Path | None = None, top: int = 1) -> ParallelPlanRun:
    """`memest plan-parallel`: layouts of ``gpus`` GPUs for one model, each rank's need against ``gpu``;
    ``calibration`` as estimate's (a profile file, whose GPU generation is then modelled); the search stops
    once ``top`` layouts fit (0: every layout traced)."""

    if gpus < 1:
        raise MemestError(f"--gpus must be at least 1, got {gpus}")
    if top < 0:
        raise MemestError(f"--top must be 0 (every layout) or more, got {top}")
    searched = searched_set(spec_args)
    if searched:
        raise MemestError(f"plan-parallel sets {', '.join(searched)} itself for each layout it searches; drop them "
                          "(memest estimate traces one layout)")
    ctx = resolve_gpu(gpu, need_budget=True, target=spec_args.get("target", Target.CUDA), calibration=calibration)
    spec = RunSpec(**{**spec_args, "compute_capability": ctx.compute_capability})
    if not spec.training:
        raise MemestError(f"plan-parallel lays out training steps; drop --mode {spec.mode}")
    if spec.compile and gpus > 1:
        raise MemestError("--compile: plan-parallel's layouts run under FSDP/DDP, where a compiled model is not "
                          "modelled; drop --compile")
    if spec.preference != Preference.NONE and gpus > 1:  # was: every layout 'not traceable', exit 0 (battery 30)
        raise MemestError(f"--preference {spec.preference}: plan-parallel's layouts run on {gpus} ranks, and a "
                          "preference step with --world-size > 1 is traced over plain DDP and FSDP2 only (grpo with "
                          "--rollout transformers), not over the planner's other layouts "
                          "(estimate --world-size N [--shard zero3], docs/limitations.md); drop --preference, or plan "
                          "with --gpus 1")
    with user_code(spec.model), ticker("plan-parallel", progress):
        plan = plan_parallel(spec.model, gpus, ctx.capacity_bytes, ctx.budget_label, spec,
                             calibration=ctx.calibration if spec.target == Target.CUDA else None, progress=progress,
                             top=top or None)
    if ctx.calibration_note and spec.target == Target.CUDA:
        plan.notes.append(ctx.calibration_note)
    return ParallelPlanRun(plan, ctx, None if calibration is None else str(calibration))


# ------------------------------------------------------------------------------- gpus, calibrate


def run_gpus():

    return nvml.query_gpus()


@dataclass
class CalibrationRun:
    entry: dict
    path: Path  # the cache it was saved to
    profile_path: Path | None = None  # --out


def run_calibrate(device: int, out: str | None = None, nccl: bool = True) -> CalibrationRun:
    """Measure on the GPU (calibration.measure, which checks for one through torch and NVML); save to
    the cache for this machine and, with ``out``, to a portable profile file."""

    seen = nvml.query_gpus()  # first: without the GPU, nothing is created (issue 22, item 31)
    if device not in {g.index for g in seen.gpus}:
        found = f"NVML sees {len(seen.gpus)}" if seen.gpus else (seen.reason or "no NVIDIA GPU visible")
        raise MemestError(f"memest calibrate needs an NVIDIA GPU (--device {device}); {found} "
                          "(estimates still work without one)")
    path = cache_file()
    _check_writable(path, "the calibration cache", "set XDG_CACHE_HOME to a writable folder")  # before measuring
    if out is not None:
        if Path(out).is_dir():
            raise MemestError(f"--out {out!r} is a folder; name a file such as profiles/rtx2080ti.json")
        _check_writable(Path(out), "the profile", "choose a writable folder")
    entry = calibration.measure(device, nccl=nccl)
    return CalibrationRun(entry, save(entry, path), write_profile(entry, out) if out is not None else None)


def _check_writable(path: Path, what: str, fix: str) -> None:
    folder = path.parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".memest-", suffix=".check"):
            pass
    except OSError as exc:
        raise MemestError(f"cannot write {what} {str(path)!r}: {exc.strerror or exc}; {fix}") from None



# ------------------------------------------------------------------------------------------ serve


@dataclass
class ServeRun:
    plan: object  # serve.plan.ServePlan
    gpu: GpuContext
    total_source: str
    colocate: object = None  # serve.colocate.Colocate, when a training step shares the GPU


def run_serve(args: dict, gpu: str, progress: Progress | None = None,
              calibration: str | Path | dict | None = None) -> ServeRun:
    """``args``: serve.plan.ServeSpec fields but model's total and generation, which come from ``gpu``, plus
    ``non_torch_memory`` (GiB: a measured non-torch increase, e.g. from the user's own vLLM log). ``calibration``:
    a profile (`memest calibrate --out`) whose measured costs replace the evidence (non-torch, CUDA context)."""
    ctx = resolve_gpu(gpu, need_budget=True, calibration=calibration)
    total, source = serve_total(ctx)
    args = dict(args)
    measured = serve_measured(ctx, int(args.get("tp") or 1), args.pop("non_torch_memory", None))
    spec = ServeSpec(**{k: v for k, v in args.items() if v is not None}, **measured, total_bytes=total,
                     card=ctx.flag, compute_capability=ctx.compute_capability)
    with user_code(spec.model), ticker(f"serve {spec.model}", progress):
        plan = plan_serve(spec)
    return ServeRun(plan, ctx, source)

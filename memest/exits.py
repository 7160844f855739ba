"""The edge between memest and the shell: exit codes and one-line errors, for every command.

0 ok; 1 the answer is "does not fit"; 2 usage, config and model errors and anything unexpected (never 0
or 1 for a run that gave no answer); 130 interrupted. ``--debug`` adds tracebacks, never changes a code.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import sys
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import typer
from typer.core import TyperGroup

from memest.app import check_timeout, hide_cuda
from memest.errors import EXIT_OK, EXIT_USAGE, MemestError
from memest.imports import keep_library_message, library_output_kept
from memest.report.emit import emit, render
from memest.report.text import ascii_fallback_streams
from memest.spec.choices import OutputFormat
from memest.worker import in_worker


class OneLineErrors(TyperGroup):
    """Usage errors as one line on stderr (exit 2), like memest's own errors; a CI log stays readable."""

    def parse_args(self, ctx, args):
        # `--version` is eager (it answers before any command is parsed), so click would drop what follows it
        # silently: `memest --version extra` printed the versions, exit 0 (battery 29, #152)
        lead = args[:next((i for i, a in enumerate(args) if not a.startswith("-")), len(args))]
        if "--version" in lead and len(args) > 1:
            try:
                from typer._click import exceptions as click
            except ImportError:
                from click import exceptions as click
            extra = " ".join(a for a in args if a != "--version")
            raise click.UsageError(f"--version takes no other arguments; got {extra!r}", ctx)
        return super().parse_args(ctx, args)

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):

        ascii_fallback_streams()  # LANG=C / PYTHONIOENCODING=ascii: ASCII instead of a UnicodeEncodeError
        try:  # typer >= 0.2x vendors click as typer._click
            from typer._click import exceptions as click
        except ImportError:
            from click import exceptions as click

        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.UsageError as exc:
            if type(exc).__name__ == "NoArgsIsHelpError":  # `memest` alone: the help, as click prints it
                exc.show()
                code = exc.exit_code
            else:
                command = exc.ctx.command_path if exc.ctx is not None else "memest"
                message = exc.format_message().replace("Value error, ", "")  # typer's pydantic coercion prefix
                typer.echo(f"memest: error: {message} (see {command} --help)", err=True)
                code = EXIT_USAGE
        except typer.Abort:  # typer >= 0.2x defines Abort itself (not in its vendored click)
            typer.echo("memest: interrupted", err=True)
            code = 130
        except OSError as exc:  # e.g. stdout closed by `| head`: not a clean run, never "ok" or "does not fit"
            if exc.errno != errno.EPIPE:
                raise
            code = EXIT_USAGE
        code = code if isinstance(code, int) else EXIT_OK
        if standalone_mode:
            sys.exit(code)
        return code


def output_format(fmt: OutputFormat, json: bool, markdown: bool) -> OutputFormat:
    asked = {f for f, on in ((OutputFormat.JSON, json), (OutputFormat.MARKDOWN, markdown)) if on}
    if fmt != OutputFormat.TABLE:
        asked.add(fmt)
    if len(asked) > 1:
        raise MemestError(f"choose one output format, not {' and '.join(sorted(a.value for a in asked))}")
    return asked.pop() if asked else OutputFormat.TABLE


# libraries whose import- and run-time chatter (bitsandbytes' "Failed to load CPU gemm_4bit_forward ...", peft's and
# transformers' deprecation notes) is not about the user's step: kept off stderr unless --debug (issue 22, item 30)
QUIET_LOGGERS = ("transformers", "peft", "bitsandbytes", "accelerate", "huggingface_hub", "torch", "torchao", "trl")
# their records below ERROR are kept (memest.imports); transformers and torch attach their own stderr handlers,
# so theirs are dropped by level instead
KEPT_LOGGERS = ("peft", "bitsandbytes", "accelerate", "huggingface_hub", "torchao", "trl")
_LIBRARY_PATHS = ("site-packages", "dist-packages")


class _KeepRecords(logging.Handler):
    """A library logger's records: below ERROR kept (``keep_library_message``), ERROR and above to stderr."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = f"{record.name}: {record.levelname}: {record.getMessage()}"
        except Exception:  # a record whose arguments do not format: logging's own report
            self.handleError(record)
            return
        if record.levelno >= logging.ERROR or not keep_library_message(text + "\n"):
            sys.stderr.write(text + "\n")


@contextlib.contextmanager
def library_noise_hidden(debug: bool):
    """Warnings raised inside installed libraries, their loggers' records below ERROR and what they write to
    file descriptor 2 while memest imports them are kept off stderr, unless ``debug`` (then they show as they
    happen); warnings from the user's own code, errors and tracebacks still reach stderr."""
    if debug:
        yield
        return
    levels = {name: logging.getLogger(name).level for name in QUIET_LOGGERS}
    propagate = {name: logging.getLogger(name).propagate for name in KEPT_LOGGERS}
    keeper = _KeepRecords()
    env = os.environ.get("TRANSFORMERS_VERBOSITY")
    os.environ["TRANSFORMERS_VERBOSITY"] = "error"  # read when transformers configures its logger (first import)
    for name in QUIET_LOGGERS:
        if name in KEPT_LOGGERS:
            logging.getLogger(name).addHandler(keeper)
            logging.getLogger(name).propagate = False
        else:
            logging.getLogger(name).setLevel(logging.ERROR)
    with warnings.catch_warnings(record=True) as caught, library_output_kept():
        warnings.simplefilter("always")
        try:
            yield
        finally:
            for name, level in levels.items():
                logging.getLogger(name).setLevel(level)
            for name, flag in propagate.items():
                logging.getLogger(name).removeHandler(keeper)
                logging.getLogger(name).propagate = flag
            if env is None:
                os.environ.pop("TRANSFORMERS_VERBOSITY", None)
            else:
                os.environ["TRANSFORMERS_VERBOSITY"] = env
        shown = set()
        for w in caught:  # the user's own warnings, as Python shows them: once per place and text
            key = (str(w.message), w.category, w.filename, w.lineno)
            text = warnings.formatwarning(w.message, w.category, w.filename, w.lineno)
            if any(part in str(w.filename) for part in _LIBRARY_PATHS):
                keep_library_message(text)
            elif key not in shown:
                shown.add(key)
                sys.stderr.write(text)


@dataclass(frozen=True)
class InWorker:
    """Run a command's work in a worker process (memest/worker.py): ``label`` names what runs (the model file)
    when the process ends, crashes or runs past ``timeout`` seconds (None: no limit); ``default``: the command's
    own --timeout default, which an error about --timeout states."""

    label: str
    timeout: float | None
    default: float | None = None


def run_command(work: Callable[[], tuple], fmt: Callable[[], OutputFormat], debug: bool, hide_gpus: bool = True,
                worker: InWorker | None = None) -> None:
    """Run a command's work -> (View, exit code), print it, exit. Exit codes never depend on --debug:
    0 ok, 1 does not fit, 2 usage / config / model errors and anything unexpected (never 0 or 1).
    CUDA devices are hidden from torch first (only calibrate uses the GPU). ``worker``: the work runs in a
    worker process, which renders the View in the output format and sends back only that text and the exit
    code; this process writes the text (it owns stdout, the exit code and the time limit)."""

    if hide_gpus:
        hide_cuda()
    text = None
    try:
        out_format = fmt()
        with library_noise_hidden(debug):
            if worker is None:
                view, code = work()
            else:
                timeout = check_timeout(worker.timeout, worker.default)
                text, code = in_worker(lambda at: _rendered(work, out_format, debug), timeout, label=worker.label)
    except KeyboardInterrupt:
        typer.echo("memest: interrupted", err=True)
        raise typer.Exit(130) from None
    except MemestError as exc:
        if debug:
            traceback.print_exc()
        typer.echo(f"memest: error: {exc}", err=True)
        raise typer.Exit(exc.exit_code) from None
    except Exception as exc:  # a bug in memest or an unexpected failure: never "ok" or "does not fit"
        if debug:
            traceback.print_exc()
        first = (str(exc).strip().splitlines() or [""])[0]
        typer.echo(f"memest: internal error: {type(exc).__name__}: {first} (rerun with --debug and report it)", err=True)
        raise typer.Exit(EXIT_USAGE) from None
    try:
        if text is None:
            emit(view, out_format, sys.stdout)
        else:
            sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:  # stdout closed early (`| head -1`): the answer stands, the rest of the output is dropped
        drop_stdout()
    except SystemExit:  # rich's on_broken_pipe: stdout already on /dev/null, then SystemExit(1), "does not fit"
        drop_stdout()
    raise typer.Exit(code)


def _rendered(work: Callable[[], tuple], out_format: OutputFormat, debug: bool) -> tuple[str, int]:
    """In the worker: the work, then its View rendered as ``emit`` would write it to this stdout. While the work
    runs, Python's stdout is stderr (only the parent writes stdout); the user's own warnings are shown here, as
    the parent's ``library_noise_hidden`` would (what the child records never reaches the parent's list)."""
    like = sys.stdout
    with library_noise_hidden(debug), contextlib.redirect_stdout(sys.stderr):
        view, code = work()
    return render(view, out_format, like), code


def drop_stdout() -> None:
    """A closed stdout, as Python's note on SIGPIPE recommends
    (https://docs.python.org/3/library/signal.html#note-on-sigpipe): stdout goes to /dev/null so the
    interpreter's final flush cannot fail, and the command keeps its own exit code (0 / 1 / 2)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # no real file descriptor (e.g. a test's captured stream)
        pass
    finally:
        os.close(devnull)

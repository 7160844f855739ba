"""User code run in a worker process: the parent owns stdout, the exit code and the time limit.

``in_worker(work, timeout)`` runs ``work(at)`` in a child process started with multiprocessing's "fork"
method and returns what ``work`` returns, which must be picklable. The CLI (``memest check``, and through
``exits.run_command`` every other command that runs model code) forks after importing torch but before running
any torch operation: the parent then holds one native thread besides its main one (the one ``import torch``
starts; counted in /proc/self/task), and the child imports nothing again. benchmarks/worker.md measures fork
against "forkserver" (a fresh interpreter that would import torch again). ``at(label)`` tells the parent what
the child is running now (a config and its model file), so that a child that ends without an answer
(``os._exit``, a signal, a segfault) or runs past ``timeout`` seconds is an error naming it, exit 2. Forking
after the parent ran an OpenMP parallel region is unsafe: GNU OpenMP's thread pool does not survive ``fork``
and the child hangs at its first parallel region (measured: benchmarks/worker.md). So the child runs its real
operations (a model file's own computing, ``whatif``'s least-squares fit) on one thread and models its
parent's thread count (``modelled_threads``). An exception raised in the child is raised again in the parent: a ``MemestError``
as itself, any other as an exception of the same class name carrying the child's traceback as a note
(``--debug``).
"""

from __future__ import annotations

import io
import multiprocessing
import pickle
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from memest.errors import MemestError

_modelled_threads: int | None = None  # in a worker: the thread count of the process that forked it


def modelled_threads(current: int) -> int:
    """The CPU thread count an estimate models (oneDNN's per-thread scratch, the norms' per-thread buffers, the
    serial/parallel split of data-dependent ops): ``current`` (``torch.get_num_threads()`` here), except in a
    worker, which runs with one thread (``_child``) and models its parent's."""
    return current if _modelled_threads is None else _modelled_threads

START_METHOD = "fork"  # benchmarks/worker.md: the cheapest; the parent has run no torch operation at the fork
DEFAULT_TIMEOUT_S = 1800.0


class WorkerError(MemestError):
    """User code ended the worker process, or ran past the time limit."""


class _Sender:
    """The child's end of the pipe, shared by its threads (memest's progress ticker writes too)."""

    def __init__(self, conn) -> None:
        self.conn, self.lock = conn, threading.Lock()

    def __call__(self, kind: str, value) -> None:
        with self.lock:
            self.conn.send((kind, value))


class _Stderr(io.TextIOBase):
    """The child's ``sys.stderr``: text written at Python's level goes to the parent, which writes it to its
    own ``sys.stderr`` (the same file in a shell; a test's captured stream under typer's CliRunner)."""

    def __init__(self, send: _Sender, like) -> None:
        self.send, self.like = send, like

    def write(self, text: str) -> int:
        if not isinstance(text, str):  # as a text file does: click's echo probes with write(b"") for a binary one
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        if text:
            self.send("stderr", text)
        return len(text)

    def isatty(self) -> bool:
        return self.like.isatty()

    def fileno(self) -> int:
        return self.like.fileno()

    @property
    def encoding(self) -> str:
        return getattr(self.like, "encoding", None) or "utf-8"


def _forget_parents_forkserver() -> None:
    """A forkserver the parent started (multiprocessing's module-level one) is not this child's child: using it
    fails at ``os.waitpid`` (ChildProcessError: No child processes; seen: plan-parallel's forkserver pool in a
    worker forked from a test session that had run gloo ranks). The child starts its own when it needs one."""
    from multiprocessing import forkserver

    server = forkserver._forkserver
    server._forkserver_pid = server._forkserver_address = server._forkserver_alive_fd = None


def _child(work: Callable, conn) -> None:
    global _modelled_threads
    import torch  # already imported by the parent: a dictionary lookup

    # GNU OpenMP's thread pool does not survive fork: after the parent ran a parallel region (a pytest process
    # that ran real steps, an API caller), the child's first parallel region hangs (a real matmul: stopped at
    # 60 s; with one thread 0.8 s, benchmarks/worker.md). The child runs its real operations on one thread and
    # models the parent's count.
    _modelled_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    _forget_parents_forkserver()
    send = _Sender(conn)
    sys.stderr = _Stderr(send, sys.stderr)
    try:
        result = work(lambda label: send("at", label))
        message = ("ok", result)
    except BaseException as exc:  # noqa: BLE001 (everything crosses back; the parent decides)
        message = ("raised", _portable(exc))
    try:
        send(*message)
    except Exception as exc:  # an answer that does not pickle: a bug in memest, never "ok"
        send("raised", ("other", type(exc).__name__, f"the worker's answer did not pickle: {exc}",
                        traceback.format_exc()))
    conn.close()


def _portable(exc: BaseException) -> tuple:
    """The exception as the parent can raise it: pickled when it pickles (memest's errors), else its class
    name, message and traceback."""
    if isinstance(exc, MemestError):
        try:
            return ("pickled", pickle.dumps(exc), str(exc), exc.exit_code)
        except Exception:
            return ("memest", str(exc), exc.exit_code)
    if isinstance(exc, KeyboardInterrupt):
        return ("interrupt",)
    return ("other", type(exc).__name__, str(exc), traceback.format_exc())


def _raise(payload: tuple) -> None:
    kind = payload[0]
    if kind == "pickled":
        try:
            exc = pickle.loads(payload[1])
        except Exception:
            exc = MemestError(payload[2])
            exc.exit_code = payload[3]
        raise exc
    if kind == "memest":
        exc = MemestError(payload[1])
        exc.exit_code = payload[2]
        raise exc
    if kind == "interrupt":
        raise KeyboardInterrupt
    _, name, message, trace = payload
    exc = type(name, (Exception,), {"__module__": __name__})(message)
    exc.add_note(f"in memest's worker process:\n{trace}")
    raise exc


def _ended(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        how = f"was killed by {name}" + (" (a segfault)" if name == "SIGSEGV" else "")
    else:
        how = f"ended the process with exit status {code} (os._exit() or an exit from C code)"
    return how


def in_worker(work: Callable[[Callable[[str], None]], Any], timeout: float | None = DEFAULT_TIMEOUT_S,
              label: str = "memest's worker", method: str = START_METHOD) -> Any:
    """``work(at)`` in a child process; its result. ``label``: what runs until ``at`` names something else."""
    for stream in (sys.stdout, sys.stderr):  # nothing buffered here is written twice by the child
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    context = multiprocessing.get_context(method)
    receive, send = context.Pipe(duplex=False)
    process = context.Process(target=_child, args=(work, send), name="memest-worker")
    start = time.monotonic()
    process.start()
    send.close()  # the child holds the only writing end: its death is EOF here
    try:
        while True:
            left = None if timeout is None else timeout - (time.monotonic() - start)
            if left is not None and left <= 0:
                raise WorkerError(f"{label}: still running after {timeout:g} s (--timeout); memest stopped it. "
                                  "Pass a larger --timeout if it is only slow, or find where the model code waits")
            if not receive.poll(left):
                continue
            try:
                kind, value = receive.recv()
            except EOFError:
                process.join(5)
                raise WorkerError(
                    f"{label}: the model code {_ended(process.exitcode)} while memest ran it, before any answer; "
                    "memest decides its own exit code, so this is an error: remove the exit or find the crash "
                    "(run the model file with python to see it)"
                ) from None
            if kind == "stderr":
                sys.stderr.write(value)
                sys.stderr.flush()
            elif kind == "at":
                label = value
            elif kind == "ok":
                return value
            else:
                _raise(value)
    finally:
        receive.close()
        if process.is_alive():
            process.kill()
        process.join(5)

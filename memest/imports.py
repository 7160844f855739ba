"""Importing the heavy libraries (torch, transformers) without the garbage collector rescanning them, and
without their import-time chatter reaching the terminal unless asked (--debug)."""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import tempfile

# One forkserver serves a process, preloaded by whoever starts it first (multiprocessing's set_forkserver_preload):
# the planner's pool (plan/parallel.py) and the gloo ground truth (validate/distributed_truth.py) both preload this
# list, so either one's forkserver serves the other. transformers imports its modules lazily: ``import transformers``
# alone leaves modeling_utils (and what it pulls in), the generation mixin, masks and processors to the first model
# built in each child; preloaded, a 2-rank llama-tiny TP 2 + SP rank took 9-12 s instead of 37 s (2026-11-28, 2 cores,
# load 6 to 7, the same peak to the byte).
FORKSERVER_PRELOAD = ["memest.estimator", "memest.sources.hf", "transformers", "transformers.modeling_utils",
                      "transformers.modeling_layers", "transformers.generation.utils", "transformers.masking_utils",
                      "transformers.processing_utils"]


@contextlib.contextmanager
def imports_without_gc():
    """Import big libraries with the cyclic garbage collector paused, then freeze what they made.

    torch (and transformers, for hf: models) create ~350k objects that live until the process
    exits. Full collections would rescan them while the imports run (~0.4 s on 2 cores) and
    interpreter exit would collect them once more (~0.8 s). gc.freeze() moves every object alive
    now to a permanent generation that collections skip; objects made later (models, traces) are
    collected as usual, so traces are unaffected."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()


# -- what installed libraries write while memest imports them (issue 22, item 30) ----------------------------
# bitsandbytes logs "Failed to load CPU gemm_4bit_forward from kernels-community ..." when peft imports it on a CPU
# with AVX512-BF16 (bitsandbytes/backends/cpu/ops.py, 0.50.x); C extensions can write to file descriptor 2
# directly. None: nothing is kept (the API, --debug): the output goes where it goes.
_kept: list[str] | None = None


@contextlib.contextmanager
def library_output_kept():
    """Inside, installed libraries' import-time output (``quiet_library_import``) and the messages handed to
    ``keep_library_message`` are kept in the yielded list instead of reaching stderr (the CLI without --debug)."""
    global _kept
    previous, _kept = _kept, []
    try:
        yield _kept
    finally:
        _kept = previous


def keep_library_message(text: str) -> bool:
    """Keep ``text`` (an installed library's warning or log record) when output is being kept; False when
    not, so the caller prints it."""
    if _kept is None:
        return False
    if text.strip():
        _kept.append(text)
    return True


@contextlib.contextmanager
def quiet_library_import():
    """Around importing an installed library (peft, which imports bitsandbytes; transformers): what it
    writes to file descriptor 2 while it imports (C code's fprintf, a logging handler, a print to
    sys.stderr) goes to a temporary file (os.dup / os.dup2) and is kept, when output is being kept. If the
    block raises, the captured text is written to stderr first: nothing is hidden around an error."""
    if _kept is None:
        yield
        return
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):  # no usable fd 2: nothing to capture
        yield
        return
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        ok = False
        try:
            yield
            ok = True
        finally:
            with contextlib.suppress(OSError, ValueError, AttributeError):
                sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            text = captured.read().decode(errors="replace")
            if ok:
                keep_library_message(text)
            elif text:
                sys.stderr.write(text)

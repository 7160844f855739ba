"""Importing the heavy libraries (torch, transformers) without the garbage collector rescanning them."""

from __future__ import annotations

import contextlib
import gc


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

"""One moment for Python's garbage collector after a compile, in the ground truth and in the traces compared with it.

After each frame it compiles, dynamo runs a young-generation collection, ``gc.collect(1)``
(torch/_dynamo/convert_frame.py, ``_compile``'s ``finally``; ``torch._dynamo.config.run_gc_after_compile``, on by
default). The compile leaves a reference cycle holding the compiled call's inputs; transformers' position ids
(``torch.arange(...) + past_seen_tokens``, ``--seq`` int64 elements) are the one of them nothing else keeps alive.
That collection frees the cycle only if no part of it reached the oldest generation in the automatic collections the
compile itself set off, which follows the process's collector counters and how warm its caches are, not the step.
Otherwise the cycle lives until the next full collection. So the same compiled step counts the first call's
position ids in one process and not in another, in the real run and in memest's trace alike: measured
2026-11-28 (torch 2.13.0, llama-tiny blocks compiled, batch 2, seq 64, SGD, --target cpu), 4,026,696 B in a new
process and 4,026,184 B (-512 B) with automatic collection off, trace and real run; the MXFP8 FSDP2 case of
tests/test_fp8_compile.py traced 512 B lower in CI's long-lived test worker than in a new one.

To compare like with like, each gloo rank of the ground truth (distributed_truth) and the test suite's process (its
traces and its in-process real steps, tests/conftest.py) run with that collection made a full one
(:func:`full_collection_after_compile`), which frees the cycle as the compile ends, whatever the process's history.
An estimate (the CLI, the API) and ``measure_cpu_peak`` called outside the suite (scripts/compile_accuracy.py) run
with dynamo's own collection, as the user's training process does: there a cycle can outlive the step, as the first
call's logits of transformers' compiled GPT-2 do (docs/accuracy.md), which memest does not model."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


class _FullCollections:
    """The ``gc`` module as ``torch._dynamo.convert_frame`` sees it: ``collect(generation)`` collects all
    generations; everything else is the module's own."""

    def collect(self, generation: int = 2) -> int:
        return gc.collect()

    def __getattr__(self, name: str):
        return getattr(gc, name)


@contextlib.contextmanager
def full_collection_after_compile() -> Iterator[None]:
    """While entered, dynamo's collection after each compile is a full one (module docstring); restored at exit."""
    import torch._dynamo.convert_frame as convert_frame

    saved = convert_frame.gc
    convert_frame.gc = _FullCollections()
    try:
        yield
    finally:
        convert_frame.gc = saved

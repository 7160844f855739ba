"""`memest serve`: will the engine start with these settings, how many KV tokens and sequences it holds,
and what to change when it will not start. Library code: returns a ServePlan, prints nothing. What is common to
every engine is resolved here; the engine's own arithmetic sits behind serve/engine.py's interface."""

from __future__ import annotations

import time

from memest.device.overheads import context_spread
from memest.errors import MemestError
from memest.serve import evidence
from memest.serve.budget import Part
from memest.serve.engine import ServePlan, ServeSpec, Setup
from memest.serve.engines import engine_for
from memest.serve.kv import model_dtype, model_kv
from memest.serve.model import load_config

__all__ = ["ServePlan", "ServeSpec", "load_config", "plan_serve"]


def plan_serve(spec: ServeSpec, config=None) -> ServePlan:
    start = time.perf_counter()
    config = config if config is not None else load_config(spec.model)
    _check(spec)
    engine = engine_for(spec.engine)
    dtype = model_dtype(config, spec.dtype)
    kv = model_kv(config, spec.tp, spec.kv_dtype, spec.dtype)
    positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    max_len = spec.max_model_len or positions
    if not max_len:
        raise MemestError(f"{spec.model}: the config gives no max_position_embeddings; pass --max-model-len")
    tokens, seqs, batching = evidence.default_batching(spec.total_bytes, spec.card)
    batched = spec.max_num_batched_tokens or tokens
    num_seqs = min(spec.max_num_seqs or seqs, batched)
    plan = engine.plan(Setup(spec, config, kv, dtype, max_len, positions, num_seqs, batched, batching, _context(spec),
                             list(kv.notes)))
    plan.seconds = time.perf_counter() - start
    return plan


def _check(spec: ServeSpec) -> None:
    if spec.utilization is not None and not 0 < spec.utilization <= 1:
        raise MemestError(f"--gpu-memory-utilization must be in (0, 1], got {spec.utilization}")
    if spec.block_size < 1 or spec.tp < 1:
        raise MemestError("--block-size and --tp must be at least 1")
    for name, value in (("--max-model-len", spec.max_model_len), ("--max-num-seqs", spec.max_num_seqs),
                        ("--max-num-batched-tokens", spec.max_num_batched_tokens)):
        if value is not None and value < 1:
            raise MemestError(f"{name} must be at least 1, got {value}")


def _context(spec: ServeSpec) -> Part:
    if spec.context is not None:
        return spec.context
    c = context_spread(spec.compute_capability, "lazy")
    return Part("CUDA context", c.expected, c.low, c.high, c.basis)

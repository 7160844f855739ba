"""`memest serve`: will the engine start with these settings, how many KV tokens and sequences it holds,
and what to change when it will not start. Library code: returns a ServePlan, prints nothing. What is common to
every engine is resolved here; the engine's own arithmetic sits behind serve/engine.py's interface."""

from __future__ import annotations

import re
import time
from dataclasses import replace

from memest.device.overheads import context_spread
from memest.errors import MemestError
from memest.serve import evidence
from memest.serve.budget import Part
from memest.serve.engine import ServePlan, ServeSpec, Setup
from memest.serve.engines import engine_for
from memest.serve.kv import model_dtype, model_kv
from memest.serve.model import load_config, require_decoder
from memest.spec.choices import ServeVerdict

__all__ = ["ServePlan", "ServeSpec", "load_config", "plan_serve", "validate"]


def plan_serve(spec: ServeSpec, config=None, *, recheck: bool = True, profiles: dict | None = None) -> ServePlan:
    """``recheck``: keep only the fixes that, applied, make the verdict 'starts' (each re-planned); ``profiles``:
    traced profile runs to reuse (the re-plans share the first plan's)."""
    start = time.perf_counter()
    config = validate(spec, config)
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
    profiles = {} if profiles is None else profiles
    plan = engine.plan(Setup(spec, config, kv, dtype, max_len, positions, num_seqs, batched, batching, _context(spec),
                             list(kv.notes), profiles))
    if recheck and plan.fixes:
        offered, plan.fixes = plan.fixes, []
        for fix in offered:
            verdict = _fix_verdict(fix, spec, config, profiles)
            if verdict == ServeVerdict.STARTS:
                plan.fixes.append(fix)
            elif verdict == ServeVerdict.MAY_NOT_START and plan.verdict == ServeVerdict.WILL_NOT_START:
                plan.fixes.append(f"{fix}; then it MAY NOT START (it fits only with the expected or low-end costs)")
        if not plan.fixes:
            plan.notes.append(f"no single change memest checks makes it start ({'; '.join(offered)}: each re-planned, "
                              "none starts): a larger GPU, more GPUs or a smaller model")
    plan.seconds = time.perf_counter() - start
    return plan


# a fix's flag -> the ServeSpec field it sets and its type
FIX_FIELDS = {"--max-model-len": ("max_model_len", int), "--gpu-memory-utilization": ("utilization", float),
              "--kv-dtype": ("kv_dtype", str), "--tp": ("tp", int)}
FIX = re.compile(r"^(--[a-z-]+) (\S+)(?: or (higher|lower))?")


def _fix_verdict(fix: str, spec: ServeSpec, config, profiles: dict) -> ServeVerdict:
    """The verdict with a printed fix applied (the plan again). A bound ("X or lower", "X or higher") is tried at
    the best value it allows (X for the utilization's upper bound; 1.0, the whole GPU, for SGLang's lower one). A
    suggestion that is not a setting (measure the non-torch memory) counts as starting: it narrows a range, which no
    re-plan here can stand for. A fix memest itself refuses (a layout vLLM refuses) does not start."""
    m = FIX.match(fix)
    if m is None or m.group(1) not in FIX_FIELDS:
        return ServeVerdict.STARTS
    name, kind = FIX_FIELDS[m.group(1)]
    try:
        value = 1.0 if m.group(3) == "higher" and name == "utilization" else kind(m.group(2))
        return plan_serve(replace(spec, **{name: value}), config, recheck=False, profiles=profiles).verdict
    except (MemestError, ValueError):
        return ServeVerdict.WILL_NOT_START


def validate(spec: ServeSpec, config=None):
    """What the plan refuses before it plans (nothing traced): the settings' ranges, a model that is not a decoder LM,
    a tensor-parallel layout vLLM refuses. The model's config (read from ``spec.model`` when not given)."""
    config = config if config is not None else load_config(spec.model)
    _check(spec)
    require_decoder(config, spec.model)
    check_layout(config, spec.tp)
    return config


def _check(spec: ServeSpec) -> None:
    if spec.utilization is not None and not 0 < spec.utilization <= 1:
        raise MemestError(f"--gpu-memory-utilization must be in (0, 1], got {spec.utilization}")
    for name, value in (("--tp", spec.tp), ("--block-size", spec.block_size)):
        if value < 1:
            raise MemestError(f"{name} must be at least 1, got {value}")
    for name, value in (("--max-model-len", spec.max_model_len), ("--max-num-seqs", spec.max_num_seqs),
                        ("--max-num-batched-tokens", spec.max_num_batched_tokens)):
        if value is not None and value < 1:
            raise MemestError(f"{name} must be at least 1, got {value}")


def check_layout(config, tp: int) -> None:
    """vLLM's tensor-parallel rules (SGLang's linear layers are vLLM's): the attention heads divide by tp
    (vllm/config/model.py ``ModelConfig.verify_with_parallel_config``: "Total number of attention heads (32) must be
    divisible by tensor parallel size (3)"); the KV heads divide by tp, or tp by them when they are replicated
    (vllm/model_executor/layers/linear.py ``QKVParallelLinear.__init__``: ``divide(total_num_kv_heads, tp_size)`` or
    ``divide(tp_size, total_num_kv_heads)``, both asserting divisibility). MLA (one latent per token) has no KV heads."""
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None)
    if heads and heads % tp:
        raise MemestError(f"--tp {tp}: the model has {heads} attention heads, not divisible by {tp}; vLLM refuses it "
                          f"(verify_with_parallel_config); use a --tp that divides {heads}")
    kv = getattr(config, "num_key_value_heads", None) or heads
    if kv and not getattr(config, "kv_lora_rank", None) and (kv % tp if tp <= kv else tp % kv):
        raise MemestError(f"--tp {tp}: the model has {kv} key/value heads; vLLM needs tp to divide them or them to "
                          "divide tp (QKVParallelLinear)")


def _context(spec: ServeSpec) -> Part:
    if spec.context is not None:
        return spec.context
    c = context_spread(spec.compute_capability, "lazy")
    return Part("CUDA context", c.expected, c.low, c.high, c.basis)

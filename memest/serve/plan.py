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
from memest.serve.engine import ServePlan, ServeSpec, Setup, gib
from memest.serve.engines import engine_for
from memest.serve.gpu import larger_cards
from memest.serve.kv import model_dtype, model_kv
from memest.serve.model import load_config, require_decoder
from memest.serve.profile import TRACED
from memest.spec.choices import ServeVerdict

__all__ = ["ServePlan", "ServeSpec", "load_config", "plan_serve", "validate"]


def plan_serve(spec: ServeSpec, config=None, *, recheck: bool = True, profiles: dict | None = None,
               floor: bool = False) -> ServePlan:
    """``recheck``: keep only the fixes that, applied, make the verdict 'starts' (each re-planned), and look for
    the smallest GPU class of memest's catalogue it starts on; ``profiles``: traced profile runs to reuse (default:
    the process's, serve/profile.py TRACED); ``floor``: plan with the profile run's lower bound, untraced (a fix's
    first, cheap re-check)."""
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
    profiles = TRACED if profiles is None else profiles
    plan = engine.plan(Setup(spec, config, kv, dtype, max_len, positions, num_seqs, batched, batching, _context(spec),
                             list(kv.notes), profiles, floor))
    if recheck and plan.verdict != ServeVerdict.STARTS:
        recheck_fixes(plan, config, profiles)
    plan.seconds = time.perf_counter() - start
    return plan


# a fix's flag -> the ServeSpec field it sets and its type
FIX_FIELDS = {"--max-model-len": ("max_model_len", int), "--gpu-memory-utilization": ("utilization", float),
              "--kv-dtype": ("kv_dtype", str), "--tp": ("tp", int)}
FIX = re.compile(r"^(--[a-z-]+) (\S+)(?: or (higher|lower))?")
# --tp fixes: doublings of the given tp up to one 8-GPU node (NVIDIA DGX/HGX H100 and H200 systems hold 8 GPUs:
# nvidia.com/en-us/data-center/dgx-h100/), or twice the given tp where that is already more
MAX_TP = 8


def recheck_fixes(plan: ServePlan, config, profiles: dict) -> None:
    """Keep only the engine's fixes that, applied one at a time, make the verdict 'starts' (each re-planned; a
    '--tp' fix becomes the smallest doubling up to MAX_TP that starts), then the smallest larger GPU class that
    starts with the same settings (``plan.larger_gpu``). When no fix starts, one note says so and what was tried."""
    spec = plan.spec
    offered, plan.fixes, tried = plan.fixes, [], []
    for fix in offered:
        m = FIX.match(fix)
        if m is not None and m.group(1) == "--tp":
            tps = _tp_candidates(spec.tp)
            found = next((t for t in tps if _starts(replace(spec, tp=t), config, profiles)), None)
            if found is not None:
                plan.fixes.append(f"--tp {found} (weights and KV heads split over {found} GPUs)")
            tried.append("--tp " + ", ".join(map(str, tps)))
        elif m is not None and m.group(1) in FIX_FIELDS:
            name, kind = FIX_FIELDS[m.group(1)]
            try:  # a bound ("X or lower", "X or higher") at the best value it allows (1.0: the whole GPU)
                value = 1.0 if m.group(3) == "higher" and name == "utilization" else kind(m.group(2))
            except ValueError:
                continue
            if _starts(replace(spec, **{name: value}), config, profiles):
                plan.fixes.append(fix)
            tried.append(fix.split(" (")[0])
        elif fix.startswith("--non-torch-memory") and plan.non_torch is not None:
            # a measurement, not a setting: kept when a measured value at the low end of the range starts it
            nt = plan.non_torch
            if _starts(replace(spec, non_torch=Part.exact(nt.name, nt.low, "the range's low end")), config, profiles):
                plan.fixes.append(f"{fix} (with a measured {gib(nt.low)} GiB, the range's low end, it starts)")
            tried.append("--non-torch-memory")
    plan.larger_gpu = _larger_gpu(spec, config, profiles)
    if not plan.fixes:
        found = (f"; it starts on a larger GPU: --gpu {plan.larger_gpu}" if plan.larger_gpu else
                 ": a GPU larger than memest's catalogue holds, more GPUs or a smaller model")
        plan.notes.append(f"no single change memest checks makes it start ({'; '.join(tried) or 'no setting to try'}: "
                          f"each re-planned, none starts){found}")


def _tp_candidates(tp: int) -> list[int]:
    out, t = [], tp * 2
    while t <= max(MAX_TP, tp * 2):
        out.append(t)
        t *= 2
    return out


def _starts(spec: ServeSpec, config, profiles: dict) -> bool:
    """Whether ``spec`` starts: first planned with the profile run's untraced lower bound (no trace when even that
    does not start), then, only if it does, with the traced run (traced once per inputs: ``profiles``). A setting
    memest refuses (a layout vLLM refuses) does not start."""
    try:
        if plan_serve(spec, config, recheck=False, profiles=profiles, floor=True).verdict != ServeVerdict.STARTS:
            return False
        return plan_serve(spec, config, recheck=False, profiles=profiles).verdict == ServeVerdict.STARTS
    except (MemestError, ValueError):
        return False


def _larger_gpu(spec: ServeSpec, config, profiles: dict) -> str | None:
    """The smallest GPU class of memest's catalogue (device/catalogue.py; the engine's logged total where
    serve/evidence.py TOTALS has one) above this one's total on which these settings start: its compute capability
    and vLLM's batching defaults for it, the evidence's ranges (a measured context or non-torch term belongs to the
    user's own GPU)."""
    for name, total, cc in larger_cards(spec.total_bytes):
        other = replace(spec, total_bytes=total, card=name, compute_capability=cc, non_torch=None, context=None)
        if _starts(other, config, profiles):
            return f"{name} ({gib(total)} GiB)"
    return None


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

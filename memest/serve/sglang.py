"""SGLang: rest = free after loading - free before loading x (1 - mem_fraction_static); tokens = rest // cell
(python/sglang/srt/model_executor/model_runner.py ``profile_max_num_token``); activations, CUDA graphs and
everything else live in the (1 - mem_fraction_static) share, not subtracted one by one. The verdict: will not
start when the weights leave the token pool empty."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from memest.serve.budget import Part
from memest.serve.engine import Gate, ServeEngine, ServePlan, Setup, Sizes, gib
from memest.serve.kv import ModelKV, sglang_cell_bytes
from memest.serve.model import build_meta
from memest.serve.weights import weights_per_rank
from memest.spec.choices import ServeVerdict

# ------------------------------------------------------------------------------------------ arithmetic


@dataclass
class SglangBudget:
    total_bytes: int
    mem_fraction_static: float
    mem_fraction_source: str
    free_before_load: int  # after the CUDA context and distributed init
    weights_bytes: int
    rest: Part  # the KV bytes: free after load - free before load x (1 - fraction)
    cell_bytes: int
    tokens: int
    tokens_low: int
    tokens_high: int
    sequences: int  # whole max_model_len sequences (token pool / max_model_len; page size 1)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {k: (v.to_dict() if isinstance(v, Part) else v) for k, v in self.__dict__.items()}


def sglang_default_fraction(total: int, tp: int) -> tuple[float, str]:
    """SGLang's default mem_fraction_static for a GPU of ``total`` bytes: (gpu_mem - reserved) / gpu_mem
    with reserved by memory class (python/sglang/srt/server_args.py ``ServerArgs.__post_init__``,
    2025 releases: < 35 GiB: 2.8 + tp/10 GiB; < 90 GiB (H100, A100): 9.5 + tp/2; < 160 GiB (H20, H200):
    12 + tp/2; else 32 GiB); older releases used 0.88 / 0.87 / 0.85 / 0.81 / 0.79 by TP size."""
    mib = total / 2**20
    if mib < 35 * 1024:
        reserved = (2.8 + tp / 10) * 1024
    elif mib < 90 * 1024:
        reserved = (9.5 + tp / 2) * 1024
    elif mib < 160 * 1024:
        reserved = (12 + tp / 2) * 1024
    else:
        reserved = 32 * 1024
    return round((mib - reserved) / mib, 3), (f"SGLang default for a {mib / 1024:.0f} GiB GPU at tp {tp}: "
                                              f"(gpu_mem - {reserved / 1024:g} GiB) / gpu_mem (server_args.py)")


def sglang_budget(total: int, fraction: float, fraction_source: str, context: Part, weights: int, kv: ModelKV,
                  max_model_len: int) -> SglangBudget:
    """``profile_max_num_token``: total_gpu_memory there is the free memory after distributed init
    (the CUDA context is gone from it); available_gpu_memory the free memory after loading the weights."""
    cell = sglang_cell_bytes(kv)

    def tokens(ctx: int) -> tuple[int, int]:
        before = total - ctx
        rest = (before - weights) - before * (1 - fraction)
        return int(rest), max(int(rest // cell), 0)

    rest, n = tokens(context.bytes)
    rest_low, n_low = tokens(context.high)
    rest_high, n_high = tokens(context.low)
    part = Part("KV cache", rest, rest_low, rest_high, "free after load - free before load x (1 - mem_fraction_static)"
                " (model_runner.py profile_max_num_token)")
    return SglangBudget(total, fraction, fraction_source, total - context.bytes, weights, part, cell, n, n_low, n_high,
                        n // max_model_len if max_model_len else 0)


# -------------------------------------------------------------------------------------------- engine


class SglangEngine(ServeEngine):
    def __init__(self, setup: Setup, budget: SglangBudget):
        self.setup, self.budget = setup, budget

    @classmethod
    def plan(cls, setup: Setup) -> ServePlan:
        spec, config, max_len = setup.spec, setup.config, setup.max_model_len
        weights = weights_per_rank(build_meta(config), config, spec.tp, setup.dtype)
        if spec.utilization is not None:
            fraction, src = spec.utilization, "--gpu-memory-utilization (as SGLang's --mem-fraction-static)"
        else:
            fraction, src = sglang_default_fraction(spec.total_bytes, spec.tp)
        context = setup.context
        budget = sglang_budget(spec.total_bytes, fraction, src, context, weights.bytes, setup.kv, max_len)
        notes = setup.notes + ["SGLang: activations, CUDA graphs and other buffers live in the (1 - "
                               "mem_fraction_static) share; they are not traced or subtracted one by one "
                               "(model_runner.py profile_max_num_token)"]
        if spec.non_torch is not None:
            notes.append("SGLang subtracts no non-torch term (it lives in the (1 - mem_fraction_static) share): the "
                         "measured non-torch value is not used")
        plan = ServePlan(spec, setup.model_name, max_len, setup.max_positions, fraction, src, 0, 0, "", setup.kv,
                         weights, None, cls(setup, budget), context=context, notes=notes)
        limit = max(setup.max_positions or 0, max_len)  # as vLLM's path: no longer than the model's positions
        plan.longest_context = min(budget.tokens, limit)
        plan.longest_context_low, plan.longest_context_high = min(budget.tokens_low, limit), min(budget.tokens_high, limit)
        _verdict(plan, budget, weights.bytes)
        return plan

    @property
    def kv_cache(self) -> Part:
        return self.budget.rest

    def sizes(self) -> tuple[Sizes, Sizes, Sizes]:
        g, max_len = self.budget, self.setup.max_model_len
        return (Sizes(None, g.tokens_low, g.tokens_low / max_len, g.tokens_low // max_len),
                Sizes(None, g.tokens, g.tokens / max_len, g.sequences),
                Sizes(None, g.tokens_high, g.tokens_high / max_len, g.tokens_high // max_len))

    def steps(self) -> list[Part]:
        g, ctx = self.budget, self.setup.context
        static = g.free_before_load * g.mem_fraction_static  # not rounded: the table shows the product as it is
        return [Part("- CUDA context", ctx.bytes, ctx.low, ctx.high,
                     "before load: free memory after the context (overheads.CONTEXTS)"),
                Part(f"x mem_fraction_static {g.mem_fraction_static:g}", static, static, static, g.mem_fraction_source),
                Part.exact("- weights", g.weights_bytes, "serve/weights.py")]

    def capacity_lines(self) -> list[str]:
        g = self.budget
        return [f"token pool: {g.tokens:,} tokens ({g.tokens_low:,}-{g.tokens_high:,}); "
                f"{g.sequences} full {self.setup.max_model_len:,}-token sequences at once"]

    def gate(self, sequences: int) -> Gate:
        g = self.budget
        needed = g.weights_bytes + sequences * self.setup.max_model_len * g.cell_bytes
        return Gate(needed, needed, needed, int(g.free_before_load * g.mem_fraction_static),
                    f"x mem_fraction_static {g.mem_fraction_static:g}")


def _verdict(plan: ServePlan, budget: SglangBudget, weights: int) -> None:
    """will-not-start: the weights leave no token pool; may-not-start: only with the CUDA context at the high end
    of its range; a pool shorter than max_model_len starts (SGLang caps requests at it) and says so."""
    fraction, context = budget.mem_fraction_static, plan.context
    if budget.tokens <= 0:
        plan.verdict = ServeVerdict.WILL_NOT_START
        plan.reasons.append(f"no room for the KV pool: the weights ({gib(weights)} GiB) exceed "
                            f"mem_fraction_static x free memory ({gib(budget.free_before_load * fraction)} GiB); "
                            "SGLang raises 'Not enough memory. Please try to increase --mem-fraction-static'")
        smallest = math.ceil(weights / budget.free_before_load * 10000) / 10000  # rest >= 0: f >= w / free
        plan.fixes += [f"--gpu-memory-utilization {smallest:.4f} or higher (mem_fraction_static: the KV pool is empty "
                       "below it)", f"--tp {plan.spec.tp * 2}"]
    elif budget.tokens_low <= 0:
        plan.verdict = ServeVerdict.MAY_NOT_START
        plan.reasons.append(f"with the CUDA context at the high end of its range ({gib(context.high)} GiB) the KV pool "
                            "is empty: SGLang raises 'Not enough memory. Please try to increase --mem-fraction-static'")
        plan.fixes.append(f"--tp {plan.spec.tp * 2}")
    elif budget.tokens_low < plan.max_model_len:
        plan.notes.append(f"the token pool ({budget.tokens:,}; {budget.tokens_low:,} with the CUDA context at the high "
                          f"end of its range) can be shorter than max_model_len {plan.max_model_len}: SGLang starts, "
                          "and caps requests at the pool")

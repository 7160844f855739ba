"""A training step and a rollout engine on one GPU, as trl's GRPO trainer runs them with
``vllm_mode="colocate"`` (trl/trainer/grpo_trainer.py ``GRPOTrainer.__init__``): one process builds
``vllm.LLM(gpu_memory_utilization=vllm_gpu_memory_utilization, max_model_len=max_prompt_length +
max_completion_length, max_num_seqs=per_device_train_batch_size x tp x steps_per_generation,
max_num_batched_tokens=4096)`` beside the model it trains.

The engine keeps total x utilization for itself (its weights, activations and a KV cache that fills the rest
of that share: gpu_worker.py), for the whole run unless sleep mode is on; the training step gets what is left.
It fits when the step's needed memory (memest's estimate, which counts the process's CUDA context and
libraries once: the engine shares the process) plus the engine's share is within the GPU's total.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from memest.device.fit import verdict
from memest.errors import MemestError
from memest.serve.gpu import serve_measured, serve_total
from memest.serve.plan import ServePlan, ServeSpec, plan_serve
from memest.spec import RunSpec
from memest.spec.choices import Preference, Rollout, ServeVerdict, Verdict

# trl's GRPOConfig defaults (trl/trainer/grpo_config.py): vllm_gpu_memory_utilization 0.3,
# max_prompt_length 512, max_completion_length 256; the colocated LLM's max_num_batched_tokens=4096
TRL_UTILIZATION = 0.3
TRL_MAX_MODEL_LEN = 512 + 256
TRL_BATCHED_TOKENS = 4096


@dataclass
class Colocate:
    utilization: float
    total_bytes: int
    training_bytes: int  # the step's needed memory, expected
    training_bytes_low: int
    training_bytes_high: int | None  # None: unbounded (cuDNN benchmark search)
    engine_bytes: int  # total x utilization
    headroom_bytes: int  # total - training - engine (expected)
    verdict: Verdict
    largest_utilization: float  # the largest share (two decimals) that still leaves the step its high need
    engine_starts: bool  # the engine surely starts: one max_model_len sequence fits at the low end of its KV range
    smallest_utilization: float  # the smallest share at which the engine starts (two decimals)
    max_model_len: int
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def colocate(needed_range: tuple[int, int, int | None], total: int, utilization: float,
             engine_plan: ServePlan) -> Colocate:
    """``needed_range``: the training step's (low, expected, high) needed bytes; ``engine_plan``: the
    serve plan of the rollout engine at ``utilization`` (serve/plan.py)."""
    low, expected, high = needed_range
    engine = int(total * utilization)
    outcome = verdict(expected + engine, None if high is None else high + engine, total) \
        if expected + engine <= total else Verdict.DOES_NOT_FIT
    room = total - (high if high is not None else expected)
    largest = max(math.floor(room / total * 100) / 100, 0.0)
    smallest = math.ceil(engine_plan.engine.gate(1).needed / total * 100) / 100
    starts = engine_plan.starts
    notes = [f"rollout engine: vLLM at gpu_memory_utilization {utilization:g}, max_model_len {engine_plan.max_model_len},"
             f" max_num_seqs {engine_plan.max_num_seqs}, max_num_batched_tokens {engine_plan.max_num_batched_tokens} "
             "(trl GRPOTrainer colocate)", f"engine KV cache: {engine_plan.tokens:,} tokens at this share"]
    if engine_plan.verdict == ServeVerdict.WILL_NOT_START:
        outcome = Verdict.DOES_NOT_FIT
        notes += [f"the engine does not start at {utilization:g}: {r}" for r in engine_plan.reasons]
    elif engine_plan.verdict == ServeVerdict.MAY_NOT_START:
        outcome = Verdict.TIGHT if outcome is Verdict.FITS else outcome
        notes += [f"the engine may not start at {utilization:g}: {r}" for r in engine_plan.reasons]
    if smallest > largest:
        notes.append(f"no share works: the engine needs at least {smallest:.2f}, the training step leaves at most "
                     f"{largest:.2f}")
    notes.append("with vllm_enable_sleep_mode the engine releases its KV cache (and, at level 1, offloads its "
                 "weights) during the training step; this figure assumes it stays resident (trl's default)")
    return Colocate(utilization, total, expected, low, high, engine, total - expected - engine, outcome, largest,
                    starts, smallest, engine_plan.max_model_len, notes)


def check_colocate(spec: RunSpec, block: dict) -> None:
    """The colocated engine's settings, checked before the training step is traced: an hf: model, a share in
    (0, 1) (0 is a value, not "the default"), whole numbers of at least 1."""
    if not spec.model.startswith("hf:"):
        raise MemestError("--colocate-serve sizes a vLLM engine from an hf: config; the model must be hf:NAME")
    if spec.preference == Preference.GRPO and spec.rollout != Rollout.VLLM:
        raise MemestError("--colocate-serve with --preference grpo is trl's use_vllm=True: add --rollout vllm "
                          "(without it the policy generates with transformers, no engine)")
    util = block.get("utilization")
    if util is not None and not 0 < float(util) < 1:
        raise MemestError(f"--colocate-serve / colocate.utilization must be in (0, 1), got {float(util):g}")
    for key in ("max_model_len", "max_num_seqs", "tp"):
        if block.get(key) is not None and block[key] < 1:
            raise MemestError(f"colocate.{key} must be at least 1, got {block[key]}")


def colocated_engine(spec: RunSpec, ctx, needed_range, block: dict) -> Colocate:
    """The training step of ``spec`` plus a vLLM engine at ``block['utilization']`` on the GPU of ``ctx`` (the app
    layer's GpuContext); ``block``: utilization, max_model_len, max_num_seqs, tp, non_torch_memory."""
    check_colocate(spec, block)
    total, _ = serve_total(ctx)

    def given(key: str, default):  # None: the default; 0 is a value (refused by check_colocate or plan_serve)
        return default if block.get(key) is None else block[key]

    util = float(given("utilization", TRL_UTILIZATION))
    tp = int(given("tp", 1))
    max_model_len = TRL_MAX_MODEL_LEN
    max_num_seqs = spec.batch * tp
    if spec.preference == Preference.GRPO:
        from memest.features import grpo  # torch and trl: only for a GRPO step

        # trl: max_num_seqs = per_device_train_batch_size x tp x steps_per_generation (gradient_accumulation_steps,
        # or generation_batch_size / per_device_train_batch_size)
        max_num_seqs *= grpo.steps_per_generation_of(spec)
        # trl's vllm_max_model_length: "at least the maximum prompt length plus max_completion_length" (its help)
        max_model_len = (spec.seq or 0) + grpo.completion_len_of(spec)
    engine = ServeSpec(spec.model, total, ctx.flag, max_model_len=int(given("max_model_len", max_model_len)),
                       utilization=util, tp=tp, max_num_seqs=int(given("max_num_seqs", max_num_seqs)),
                       max_num_batched_tokens=TRL_BATCHED_TOKENS, compute_capability=ctx.compute_capability,
                       **serve_measured(ctx, tp, block.get("non_torch_memory")))
    return colocate(needed_range, total, util, plan_serve(engine, recheck=False))  # no fixes shown

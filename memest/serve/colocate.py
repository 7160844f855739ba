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

from memest.spec.choices import Verdict

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


def colocate(needed_range: tuple[int, int, int | None], total: int, utilization: float, engine_plan) -> Colocate:
    """``needed_range``: the training step's (low, expected, high) needed bytes; ``engine_plan``: the
    serve plan of the rollout engine at ``utilization`` (serve/plan.py)."""
    from memest.device.fit import verdict

    low, expected, high = needed_range
    engine = int(total * utilization)
    outcome = verdict(expected + engine, None if high is None else high + engine, total) \
        if expected + engine <= total else Verdict.DOES_NOT_FIT
    b = engine_plan.vllm
    room = total - (high if high is not None else expected)
    largest = max(math.floor(room / total * 100) / 100, 0.0)
    smallest = math.ceil((b.non_kv_bytes + b.layout.request_bytes) / total * 100) / 100
    starts = engine_plan.starts
    notes = [f"rollout engine: vLLM at gpu_memory_utilization {utilization:g}, max_model_len {engine_plan.max_model_len},"
             f" max_num_seqs {engine_plan.max_num_seqs}, max_num_batched_tokens {engine_plan.max_num_batched_tokens} "
             "(trl GRPOTrainer colocate)", f"engine KV cache: {b.layout.tokens:,} tokens at this share"]
    if engine_plan.verdict == "will-not-start":
        outcome = Verdict.DOES_NOT_FIT
        notes += [f"the engine does not start at {utilization:g}: {r}" for r in engine_plan.reasons]
    elif engine_plan.verdict == "may-not-start":
        outcome = Verdict.TIGHT if outcome is Verdict.FITS else outcome
        notes += [f"the engine may not start at {utilization:g}: {r}" for r in engine_plan.reasons]
    if smallest > largest:
        notes.append(f"no share works: the engine needs at least {smallest:.2f}, the training step leaves at most "
                     f"{largest:.2f}")
    notes.append("with vllm_enable_sleep_mode the engine releases its KV cache (and, at level 1, offloads its "
                 "weights) during the training step; this figure assumes it stays resident (trl's default)")
    return Colocate(utilization, total, expected, low, high, engine, total - expected - engine, outcome, largest,
                    starts, smallest, engine_plan.max_model_len, notes)

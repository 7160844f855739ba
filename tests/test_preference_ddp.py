"""--preference dpo, kto, orpo, cpo, simpo and grpo at --world-size > 1 over plain DDP (--shard none), each gloo rank's
traced peak against the same step run for real on 2 gloo ranks (memest/validate/distributed_truth.py).

trl 1.16.0 (trl/trainer/dpo_trainer.py, DPOTrainer.__init__) prepares the policy with ``accelerator.prepare`` (DDP)
and the reference with ``accelerator.prepare_model(ref_model, evaluation_mode=True)``, which accelerate 1.15.0
(accelerate/accelerator.py, ``prepare_model``: ``if not evaluation_mode: ... DistributedDataParallel``) leaves
unwrapped: a full frozen copy on every rank. memest wraps the step module (policy + reference) in DDP; DDP's reducer
buckets only the parameters that require grad, so the frozen reference adds no bucket and no all-reduce: the same
bytes as trl's DDP(policy). KTOTrainer (trl/trainer/kto_trainer.py, KTOTrainer.__init__) prepares its reference the
same way; its loss all-gathers the KL term over the ranks (``accelerator.gather_for_metrics(kl)``), which memest's
KTOStep runs as accelerate does (features/preference_kto.py, gather_for_metrics: a real gloo all_gather in the
truth run). ORPOTrainer and CPOTrainer (trl/experimental/orpo, trl/experimental/cpo; cpo and simpo) have no reference:
HF Trainer's accelerator.prepare wraps the policy alone in DDP. GRPOTrainer (trl/trainer/grpo_trainer.py,
GRPOTrainer.__init__) prepares its reference with prepare_model(evaluation_mode=True) too, generates on the policy
unwrapped (unwrap_model_for_generation), and gathers over the ranks (num_items_in_batch, the rewards whose advantages
it slices, the metrics of _compute_loss): memest's stand-in accelerator runs those as accelerate does
(features/grpo.py). FSDP2 (--shard zero3 / zero2), where trl shards the reference too (prepare_fsdp):
tests/test_preference_fsdp.py and, for GRPO, tests/test_grpo_fsdp.py; --shard zero1 stays refused."""

import pytest

from memest.errors import MemestError
from memest.features import grpo
from memest.features.registry import features_for, trace_step
from memest.sources import load_source
from memest.spec import RunSpec
from memest.trace import step as core
from memest.validate.distributed_truth import measure_distributed_peaks

from .conftest import lowest_of_runs, lowest_phase_peaks_of_runs, model_ref

pytest.importorskip("peft")
pytest.importorskip("trl.trainer.dpo_trainer")

LORA = "r=8,alpha=16,targets=q_proj,v_proj"
GRPO = {"preference": "grpo", "seq": 8, "generations": 2, "completion_len": 3}  # 1 prompt x 2 completions per rank
CASES = [
    # (extra RunSpec fields, Python floats autograd saves that the trace does not allocate)
    ({"preference": "dpo", "reference": "copy"}, 0),  # trl's ref_model: a second frozen copy on every rank, not wrapped
    ({"preference": "dpo", "reference": "precomputed"}, 0),  # no reference forward
    # the base with the adapter off; peft's LoRA forward multiplies by a Python float, which eager autograd saves as an
    # 8-byte wrapped-number tensor, one per adapted layer (2 layers x q, v): tests/test_preference.py's SAVED_SCALAR
    ({"preference": "dpo", "lora": LORA, "reference": "adapter"}, 4),
    ({"preference": "kto", "reference": "copy"}, 0),  # + the KL batch and the all-gathered KL term
    ({"preference": "kto", "lora": LORA, "reference": "adapter"}, 4),
    ({"preference": "orpo"}, 0),  # no reference: the policy alone, the whole logits
    ({"preference": "cpo"}, 0),
    ({"preference": "simpo"}, 0),
    # GRPO (trl GRPOTrainer): generation on the unwrapped policy, the reference log-probs, trl's _compute_loss with its
    # gathers over the ranks; beta != 0 with a frozen copy, and with the adapter-disabled base
    ({**GRPO, "reference": "copy"}, 0),
    ({**GRPO, "lora": LORA, "reference": "adapter"}, 4),
]
SAVED_SCALAR = 8


def _spec(extra: dict) -> RunSpec:
    return RunSpec(**{"model": model_ref("hf:llama-tiny"), "batch": 2, "seq": 16, "target": "cpu", "optim": "adamw",
                      "world_size": 2, **extra})


def test_every_gloo_rank_of_the_ddp_preference_step_matches_the_trace():
    specs = [_spec(extra) for extra, _ in CASES]
    measured = measure_distributed_peaks(specs)
    for spec, (extra, scalars), ranks in zip(specs, CASES, measured, strict=True):
        traced = trace_step(load_source(spec.model), spec).peak()[0]
        assert len(ranks) == 2
        # a rank read above the trace measures again (conftest.lowest_of_runs: gloo's worker thread freeing a
        # collective's buffer late only lifts a measured peak; CI, 2026-11-28, the other worker busy: ORPO rank 0 read
        # 5,064,064 B once, 64 B over; 12 runs of it here read 5,064,000 B on both ranks)
        ranks = lowest_of_runs(spec, ranks, traced=lambda r, t=traced, s=scalars: t + s * SAVED_SCALAR)
        for rank in ranks:
            real = rank["peak_bytes"] - scalars * SAVED_SCALAR
            assert traced == real, f"{extra} rank {rank['rank']}: traced {traced} B, measured {rank['peak_bytes']} B"


@pytest.mark.parametrize("extra, copies", [
    ({"preference": "dpo", "reference": "copy"}, 2),
    ({"preference": "kto", "reference": "copy"}, 2),
    ({**GRPO, "reference": "copy"}, 2),
    ({"preference": "orpo"}, 1),  # no reference: the trace's parameters are the policy's
], ids=["dpo", "kto", "grpo", "orpo"])
def test_ddp_adds_the_gradient_buckets_of_the_policy_only(extra, copies):
    """The 2-rank step holds the single-process step plus DDP's gradient bucket, the size of the policy's trainable
    parameters (float32 here) and not of the policy and its frozen reference copy (the trace's parameters: both)."""
    spec = _spec(extra)
    one = RunSpec(**{**spec.to_dict(), "world_size": 1})
    two = trace_step(load_source(spec.model), spec)
    single = trace_step(load_source(one.model), one)
    assert two.peak()[0] - single.peak()[0] == two.param_bytes // copies


@pytest.mark.parametrize("fields, match", [
    ({"preference": "dpo", "world_size": 2, "shard": "zero1"}, "not traced yet"),
    ({"preference": "kto", "world_size": 2, "shard": "zero1"}, "not traced yet"),
    ({"preference": "dpo", "world_size": 2, "tp": 2}, "not traced yet"),
    ({"preference": "grpo", "world_size": 2, "generations": 2, "completion_len": 4, "shard": "zero1"}, "not traced yet"),
    ({"preference": "grpo", "world_size": 2, "generations": 2, "completion_len": 4, "rollout": "vllm"},
     "--rollout transformers"),
    # --generation-batch is traced over ranks (tests/test_grpo_ranks_generation_batch.py): trl's global rule refuses 4
    ({"preference": "grpo", "world_size": 2, "generations": 2, "completion_len": 4, "generation_batch": 4},
     "divisible by the global batch size \\(8\\)"),
])
def test_what_is_not_proven_at_world_size_above_one_stays_refused(fields, match):
    with pytest.raises(MemestError, match=match):
        RunSpec(model="hf:gpt2", batch=4, **fields)


def test_each_grpo_phase_of_every_ddp_rank_matches_the_trace():
    """GRPO over DDP, phase by phase (the gloo truth's per-phase peaks from features/grpo.py's record_function marks):
    generation and the reference log-probs to the byte, the training step less peft's saved floats."""
    cases = [case for case in CASES if case[0].get("preference") == "grpo"]
    specs = [_spec(extra) for extra, _ in cases]
    measured = measure_distributed_peaks(specs)
    for spec, (extra, scalars), ranks in zip(specs, cases, measured, strict=True):
        features = features_for(spec)
        trace = core.trace_step(load_source(spec.model), spec, features=features)
        step = next(f for f in features if isinstance(f, grpo.GRPOFeature)).step_module
        traced = grpo.phase_peaks(trace, step.phase_starts, spec.iterations)
        limit = {**traced, "training step": traced["training step"] + scalars * SAVED_SCALAR}
        ranks = lowest_phase_peaks_of_runs(  # a reading lifted by the rank's history (conftest docstring)
            spec, ranks, lambda r, limit=limit: any(v > limit[k] for k, v in r["phase_peaks"].items() if k in limit))
        for rank in ranks:
            real = rank["phase_peaks"]
            assert set(real) == set(traced) == set(grpo.PHASES), (extra, traced, real)
            assert traced["generation"] == real["generation"], (extra, rank["rank"], traced, real)
            assert traced["reference log-probs"] == real["reference log-probs"], (extra, rank["rank"], traced, real)
            assert traced["training step"] == real["training step"] - scalars * SAVED_SCALAR, (extra, traced, real)

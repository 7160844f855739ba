"""--preference dpo, kto, orpo, cpo and simpo at --world-size 2 over FSDP2 (--shard zero3, zero2): each gloo rank's
traced peak against the same step run for real on 2 gloo ranks (memest/validate/distributed_truth.py).

Both sides wrap through memest/parallel/trl_fsdp.py, which runs accelerate 1.15.0's own ``fsdp2_prepare_model``
(accelerate/utils/fsdp_utils.py: the policy's decoder layers, its untied embedding, the [final norm, LM head] group
with reshard_after_forward=False, the root) and trl 1.16.0's own ``prepare_fsdp`` (trl/models/utils.py lines
292-342: for fsdp_version 2 ONE ``fully_shard`` on the whole reference copy, reshard_after_forward from the plugin,
no auto-wrap) with a real ``FullyShardedDataParallelPlugin``; trl's DPOTrainer.__init__ calls it for its ref_model
(trl/trainer/dpo_trainer.py line 988), KTOTrainer.__init__ likewise (kto_trainer.py line 996). With a peft policy
trl keeps no ref_model (dpo_trainer.py line 909): the reference is the sharded policy with its adapter disabled.
ORPO/CPO/SimPO have no reference. --reference precomputed: trl shards a reference to precompute, then drops it
(line 1033): the step holds none. GRPO over FSDP2, each rank and each phase: tests/test_grpo_fsdp.py.
"""

import pytest

from memest.errors import MemestError
from memest.features.registry import trace_step
from memest.sources import load_source
from memest.spec import RunSpec
from memest.validate.distributed_truth import measure_distributed_peaks

from .conftest import lowest_of_runs, model_ref

# traced and real steps on ATen's CPU kernels alike (conftest.aten_cpu_kernels): the bf16 steps compare to the byte on
# CPUs where oneDNN would run their matmuls (AVX-512/AMX), as on the others
pytestmark = pytest.mark.usefixtures("aten_cpu_kernels")

pytest.importorskip("peft")
pytest.importorskip("accelerate")
pytest.importorskip("trl.trainer.dpo_trainer")

LORA = "r=8,alpha=16,targets=q_proj,v_proj"
# peft's LoRA forward multiplies by a Python float, which eager autograd saves as an 8-byte wrapped-number tensor,
# one per adapted layer (2 layers x q, v): tests/test_preference.py's SAVED_SCALAR
PEFT_SCALARS = 4 * 8
# simpo at zero3 peaks inside gloo's reduce-scatter of the policy's [norm, lm_head] group: ProcessGroupGloo runs
# _reduce_scatter_base_ as an all_reduce of a clone of its input (the trace's gloo scratch rule,
# parallel/distributed.py _gloo_buffers), and FSDP2 asks for ReduceOp.AVG (torch/distributed/fsdp/_fully_shard/
# _fsdp_collectives.py _get_gradient_divide_factors: fp32), which gloo finishes with the clone's div_ by the world
# size, a Python int: an 8-byte wrapped-number tensor and its 4-byte float32 cast (measured: aten::div_ under
# gloo:all_reduce, +8 then +4, freed before the clone), alive on top of the clone; the trace does not allocate them
GLOO_AVG_SCALARS = 8 + 4
# (extra RunSpec fields, bytes the real step holds at its peak that the trace does not allocate, by the causes above)
CASES = [
    ({"preference": "dpo", "reference": "copy"}, 0),  # trl's ref_model, one FSDP unit of its own
    ({"preference": "dpo", "reference": "precomputed"}, 0),
    ({"preference": "dpo", "lora": LORA, "reference": "adapter"}, PEFT_SCALARS),
    ({"preference": "kto", "reference": "copy"}, 0),
    ({"preference": "kto", "lora": LORA, "reference": "adapter"}, PEFT_SCALARS),
    ({"preference": "orpo"}, 0),
    ({"preference": "cpo"}, 0),
    ({"preference": "simpo"}, GLOO_AVG_SCALARS),
    # transformers' gradient checkpointing on the policy's layers (trl's gradient_checkpointing=True) under FSDP2
    ({"preference": "dpo", "reference": "copy", "checkpointing": "blocks"}, 0),
]


def _spec(extra: dict, shard: str = "zero3") -> RunSpec:
    return RunSpec(**{"model": model_ref("hf:llama-tiny"), "batch": 2, "seq": 16, "target": "cpu", "optim": "adamw",
                      "world_size": 2, "shard": shard, **extra})


def _check(specs, scalars):
    measured = measure_distributed_peaks(specs)
    for spec, saved, ranks in zip(specs, scalars, measured, strict=True):
        traced = trace_step(load_source(spec.model), spec).peak()[0]
        assert len(ranks) == 2
        # a rank above the trace: measured again (conftest.lowest_of_runs; dpo adapter zero2 read rank 0 +256,000 B,
        # its embedding's all-gather output freed late by gloo's worker, in one loaded clean-clone CI run, 2026-11-29)
        ranks = lowest_of_runs(spec, ranks, traced=lambda rank, traced=traced, saved=saved: traced + saved)
        for rank in ranks:
            real = rank["peak_bytes"] - saved
            assert traced == real, (f"{spec.preference} {spec.reference} {spec.shard} rank {rank['rank']}: traced "
                                    f"{traced} B, measured {rank['peak_bytes']} B")


def test_every_gloo_rank_of_the_zero3_preference_step_matches_the_trace():
    _check([_spec(extra) for extra, _ in CASES], [saved for _, saved in CASES])


# simpo's zero2 peak is not inside a reduce-scatter: nothing of gloo's on top
ZERO2 = [case if case[0] != {"preference": "simpo"} else (case[0], 0) for case in CASES]


def test_every_gloo_rank_of_the_zero2_preference_step_matches_the_trace():
    """zero2 (reshard_after_forward=False): trl's prepare_fsdp passes it to the reference too, whose whole
    parameters then stay gathered after its first forward (it never runs a backward to reshard them)."""
    _check([_spec(extra, "zero2") for extra, _ in ZERO2], [saved for _, saved in ZERO2])


PRECISIONS = [  # --precision bf16: bf16 weights, accelerate's mixed_precision "no"; bf16-mixed: fp32 weights, the
    # plugin's MixedPrecisionPolicy (param, reduce and output dtype bfloat16) on the policy and the reference, and no
    # autocast (accelerate's FSDP2 prepare adds none: features/preference_feature.py PreferenceFeature.autocast)
    ({"preference": "dpo", "reference": "copy", "precision": "bf16"}, 0),
    ({"preference": "dpo", "reference": "copy", "precision": "bf16-mixed"}, 0),
    ({"preference": "dpo", "lora": LORA, "reference": "adapter", "precision": "bf16-mixed"}, PEFT_SCALARS),
    ({"preference": "orpo", "precision": "bf16-mixed"}, 0),  # its peak moves with autocast (2,325,500 B with it)
]


def test_every_gloo_rank_matches_in_bf16_and_bf16_mixed():
    _check([_spec(extra) for extra, _ in PRECISIONS], [saved for _, saved in PRECISIONS])


def test_the_reference_copy_is_one_fsdp_unit_and_the_policy_one_per_layer():
    """trl's prepare_fsdp for FSDP2 shards the reference whole (one unit: its forward gathers every reference
    parameter at once); accelerate shards the policy per decoder layer, its embedding, and the [norm, head] group."""
    trace = trace_step(load_source(_spec({}).model), _spec({"preference": "dpo", "reference": "copy"}))
    assert trace.shard_units == ["policy", "policy.model.embed_tokens", "policy.model.layers.0",
                                 "policy.model.layers.1", "policy.model.norm", "policy.lm_head", "reference"]


def _most_gathered_at_once(trace, prefix: str) -> int:
    """The most bytes of FSDP's unsharded (all-gathered) parameters of the modules under ``prefix`` alive at once."""
    gathered = {sid for sid, rec in enumerate(trace.storages)
                if rec.module.startswith(prefix) and "FSDP all-gather copy-out" in rec.op}
    live = most = 0
    for sid, delta in trace.events:
        if sid in gathered:
            live += delta
            most = max(most, live)
    return most


def test_the_whole_reference_is_gathered_at_once_and_the_policy_a_layer_at_a_time():
    """trl's prepare_fsdp shards the reference as one unit: its forward holds every reference parameter unsharded at
    once (the reference's full bytes: twice this rank's shard at 2 ranks, float32); the policy's decoder layers are
    gathered one or two at a time (the next one prefetched), never all together."""
    spec = _spec({"preference": "dpo", "reference": "copy"})
    trace = trace_step(load_source(spec.model), spec)
    step = trace_step(load_source(spec.model), RunSpec(**{**spec.to_dict(), "world_size": 1, "shard": "none"}))
    full_reference = step.param_bytes // 2  # the single-process step's parameters: the policy and its equal copy
    assert _most_gathered_at_once(trace, "reference") == full_reference
    assert _most_gathered_at_once(trace, "policy.model.layers") < full_reference


@pytest.mark.parametrize("fields, match", [
    ({"preference": "dpo", "shard": "zero1"}, "not traced yet"),  # DDP + ZeroRedundancyOptimizer: not measured
    ({"preference": "dpo", "shard": "zero3", "tp": 2}, "not traced yet"),
    ({"preference": "dpo", "shard": "zero3", "precision": "fp16-mixed"}, "not traced yet"),  # GradScaler, not measured
    # GRPO over FSDP2 is traced (tests/test_grpo_fsdp.py; a generation batch over ranks:
    # tests/test_grpo_ranks_generation_batch.py) but for fp16-mixed, vLLM rollouts and a generation batch that trl
    # refuses (not a multiple of --batch x --world-size)
    ({"preference": "grpo", "generations": 2, "completion_len": 4, "shard": "zero3", "precision": "fp16-mixed"},
     "not traced yet"),
    ({"preference": "grpo", "generations": 2, "completion_len": 4, "shard": "zero3", "rollout": "vllm"},
     "--rollout transformers"),
    ({"preference": "grpo", "generations": 2, "completion_len": 4, "shard": "zero2", "generation_batch": 6},
     "divisible by the global batch size"),
])
def test_what_is_not_proven_over_fsdp_stays_refused(fields, match):
    with pytest.raises(MemestError, match=match):
        RunSpec(model="hf:gpt2", batch=4, world_size=2, **fields)

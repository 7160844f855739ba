"""--preference grpo --generation-batch over 2 gloo ranks (plain DDP and FSDP2 zero3): trl's generation_batch_size is
global (trl/trainer/grpo_config.py lines 1101-1109: a multiple of per_device_train_batch_size x num_processes;
steps_per_generation = generation_batch_size / (per_device x num_processes)). Each rank's dataloader batch is
per_device x steps_per_generation (grpo_trainer.py line 1275): it generates for that many completions, gathers every
rank's rewards, keeps its process_slice of the advantages (line 2813) and splits its buffer into steps_per_generation
slices (split_tensor_dict, line 1544). Here --batch 2 x --world-size 2 with --generation-batch 8: steps_per_generation
2, each rank generating 4 completions (2 prompts x 2) once per 2 micro-steps. Harness: tests/test_preference_ddp.py
(DDP, each phase to the byte) and tests/test_grpo_fsdp.py (FSDP2, its one explained difference: the kept attention
mask at zero3's generation peak)."""

import pytest

from memest.features import grpo
from memest.features.registry import features_for
from memest.sources import load_source
from memest.spec import RunSpec
from memest.trace import step as core
from memest.validate.distributed_truth import measure_distributed_peaks

from . import test_grpo_fsdp, test_preference_ddp
from .conftest import lowest_phase_peaks_of_runs

pytest.importorskip("peft")
pytest.importorskip("accelerate")
pytest.importorskip("trl.trainer.grpo_trainer")

BATCHED = {**test_preference_ddp.GRPO, "reference": "copy", "generation_batch": 8}


def test_steps_per_generation_divides_by_the_global_batch():
    spec = test_preference_ddp._spec(BATCHED)
    one = RunSpec(**{**spec.to_dict(), "world_size": 1, "generation_batch": 4, "iterations": 1})
    assert grpo.steps_per_generation_of(spec) == 2 == grpo.steps_per_generation_of(one)
    assert spec.iterations == 3  # one generation every 2 optimizer steps (K 1): the trace runs 2 + 1


def test_each_grpo_phase_of_every_ddp_rank_with_a_global_generation_batch_matches_the_trace():
    spec = test_preference_ddp._spec(BATCHED)
    (ranks,) = measure_distributed_peaks([spec])
    features = features_for(spec)
    trace = core.trace_step(load_source(spec.model), spec, features=features)
    step = next(f for f in features if isinstance(f, grpo.GRPOFeature)).step_module
    traced = grpo.phase_peaks(trace, step.phase_starts, spec.iterations)
    assert len(ranks) == 2
    ranks = lowest_phase_peaks_of_runs(  # a reading lifted by the rank's history (conftest docstring)
        spec, ranks, lambda r: r["peak_bytes"] > trace.peak()[0]
        or any(v > traced.get(k, v) for k, v in r["phase_peaks"].items()))
    for rank in ranks:
        real = rank["phase_peaks"]
        assert trace.peak()[0] == rank["peak_bytes"], (rank["rank"], trace.peak()[0], rank)
        # K 1 % S 2 != 0: trl's old log-probs of the whole generation batch run too (a phase of their own)
        assert set(real) == set(traced) == {*grpo.PHASES, grpo.OLD_LOGPS}, (traced, real)
        for phase in traced:
            assert traced[phase] == real[phase], (phase, rank["rank"], traced, real)


def test_every_gloo_rank_and_phase_of_grpo_over_fsdp2_zero3_with_a_global_generation_batch_matches_the_trace():
    test_grpo_fsdp._check([({**test_grpo_fsdp.GRPO, "reference": "copy", "generation_batch": 8}, 0)], "zero3")

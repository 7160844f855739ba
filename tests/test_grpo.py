"""--preference grpo against real CPU steps of trl's GRPOTrainer (trl 1.16.0) without vLLM.

The step (features/grpo.py) runs trl's and transformers' own code: ``generate`` with a DynamicCache,
``_get_per_token_logps_and_entropies`` for the reference, ``_compute_loss`` on a stand-in trainer holding
GRPOConfig's defaults. The ground truth runs that step for real under the profiler; each phase's peak
(generation, reference log-probs, training step: the last iteration, optimizer state held) is compared with
the traced one (validate/cpu_truth.measure_cpu_phase_peaks)."""

from __future__ import annotations

import pytest

from memest.errors import MemestError
from memest.features import grpo
from memest.features.registry import features_for
from memest.sources import load_source
from memest.spec import RunSpec
from memest.spec.run import TRL_NUM_GENERATIONS
from memest.trace import step as core
from memest.validate.cpu_truth import measure_cpu_peak, measure_cpu_phase_peaks

from .conftest import model_ref

pytest.importorskip("peft")
pytest.importorskip("trl.trainer.grpo_trainer")

QV = "r=8,alpha=16,targets=q_proj,v_proj"
# peft's LoRA forward multiplies by a Python float (self.scaling[adapter]): eager autograd saves it as an 8-byte
# wrapped-number tensor the fake trace does not allocate, one per adapted layer (tests/test_preference.py's
# SAVED_SCALAR: memest's plain step misses the same bytes); the training step's backward holds them
SAVED_SCALAR = 8

CASES = [
    # (extra RunSpec fields, Python floats saved for backward in the training step)
    ({"reference": "copy"}, 0),  # beta != 0 with a second frozen copy: all three phases
    ({"lora": QV, "reference": "adapter"}, 4),  # beta != 0, the adapter-disabled base; 2 layers x q, v
]


def assert_phases_match(trace, traced: dict, real: dict, scalars: int) -> None:
    """Each phase's traced peak equals the real one (the training step less ``scalars`` saved Python floats), and
    the step's peak is the highest phase's."""
    assert set(traced) == set(real) == set(grpo.PHASES)
    assert traced["generation"] == real["generation"], (traced, real)
    assert traced["reference log-probs"] == real["reference log-probs"], (traced, real)
    assert traced["training step"] == real["training step"] - scalars * SAVED_SCALAR, (traced, real)
    assert trace.peak()[0] == max(traced.values())



def _traced(spec):
    source = load_source(spec.model)
    features = features_for(spec)
    trace = core.trace_step(source, spec, features=features)
    step = next(f for f in features if isinstance(f, grpo.GRPOFeature)).step_module
    return source, trace, grpo.phase_peaks(trace, step.phase_starts)


@pytest.mark.parametrize("extra, scalars", CASES, ids=["copy", "lora-adapter"])
def test_each_phase_peak_matches_trl_s_real_step(extra, scalars):
    spec = RunSpec(model=model_ref("hf:llama-tiny"), batch=4, seq=8, target="cpu", optim="adamw",
                   preference="grpo", generations=2, completion_len=4, **extra)
    source, trace, traced = _traced(spec)
    real = measure_cpu_phase_peaks(source, spec, "memest.grpo.")
    assert_phases_match(trace, traced, real, scalars)
    assert any("phase peaks" in note for note in trace.notes)


def test_default_beta_has_no_reference_and_the_whole_step_matches():
    """trl 1.16's beta 0.0: no reference model, no reference phase; the whole step's peak is real's."""
    spec = RunSpec(model=model_ref("hf:llama-tiny"), batch=2, seq=8, target="cpu", optim="adamw",
                   preference="grpo", generations=2, completion_len=3)
    source, trace, traced = _traced(spec)
    assert set(traced) == {"generation", "training step"}
    assert trace.peak()[0] == measure_cpu_peak(source, spec)["peak_bytes"]


def test_generation_holds_the_kv_cache_of_every_completion():
    """Doubling the completions per step doubles the generation phase's KV cache: the phase grows with them."""
    base = dict(model=model_ref("hf:llama-tiny"), seq=8, target="cpu", preference="grpo", generations=2,
                completion_len=4)
    _, _, two = _traced(RunSpec(batch=2, **base))
    _, _, four = _traced(RunSpec(batch=4, **base))
    assert four["generation"] > two["generation"]


def test_spec_defaults_follow_trl():
    defaults = grpo.config_defaults()
    assert TRL_NUM_GENERATIONS == defaults.num_generations
    assert defaults.beta == 0.0  # the reason --reference auto means no reference
    spec = RunSpec(model="hf:gpt2", batch=8, preference="grpo")
    assert grpo.generations_of(spec) == defaults.num_generations
    assert grpo.completion_len_of(spec) == defaults.max_completion_length


@pytest.mark.parametrize("fields, match", [
    ({"preference": "grpo", "batch": 3, "generations": 2}, "multiple of --generations"),
    ({"preference": "grpo", "batch": 2, "generations": 1}, "at least 2"),
    ({"generations": 4}, "add --preference grpo"),
    ({"completion_len": 4}, "add --preference grpo"),
    ({"preference": "grpo", "batch": 8, "reference": "precomputed"}, "DPO's"),
    ({"preference": "grpo", "batch": 8, "checkpointing": "every:2"}, "blocks or blocks-reentrant"),
])
def test_bad_grpo_options_are_one_line_errors(fields, match):
    with pytest.raises(MemestError, match=match):
        RunSpec(model="hf:gpt2", **fields)


def test_advise_offers_grpo_remedies_with_their_cost():
    """advise's GRPO savers (plan/advise.py): fewer generations per prompt (half the completions, the same prompts)
    and shorter completions, each re-traced: each lowers the traced need and says what it costs the training."""
    from memest.plan import advise
    from memest.plan.runner import Runner

    base = RunSpec(model=model_ref("hf:llama-tiny"), batch=8, seq=8, target="cpu", preference="grpo", generations=4,
                   completion_len=4)
    runner = Runner(base)
    found = {name: changes for name, changes, _ in advise.candidates(runner)}
    assert not any("precomputed" in name for name in found)
    fewer = found["fewer generations per prompt (2), the same prompts per step (trl num_generations)"]
    shorter = found["shorter completions (2 tokens, trl max_completion_length)"]
    assert fewer == {"generations": 2, "batch": 4} and shorter == {"completion_len": 2}
    needed = runner.run().needed_bytes
    for changes, words in ((fewer, "group baseline"), (shorter, "truncated")):
        result = runner.run(**changes)
        assert result.needed_bytes < needed, changes
        assert words in advise._time_cost("", changes, result, base)


def test_vllm_rollout_phases_match_the_real_step():
    """--rollout vllm (trl use_vllm=True): no generate on the policy; the policy's no-grad log-probs for vLLM's
    importance sampling, the reference's, then the training step, each phase's peak equal to the real run's."""
    spec = RunSpec(model=model_ref("hf:llama-tiny"), batch=4, seq=8, target="cpu", optim="adamw", preference="grpo",
                   generations=2, completion_len=4, rollout="vllm", reference="copy")
    source, trace, traced = _traced(spec)
    real = measure_cpu_phase_peaks(source, spec, "memest.grpo.")
    assert set(traced) == {grpo.OLD_LOGPS, "reference log-probs", "training step"}
    assert traced == real


def test_colocated_engine_is_sized_from_the_grpo_step():
    """--colocate-serve with --preference grpo --rollout vllm: trl's LLM(max_model_len = prompt + completion,
    max_num_seqs = per_device_train_batch_size x tp x steps_per_generation); refused without --rollout vllm."""
    import json

    from typer.testing import CliRunner

    from memest.cli import app

    args = [model_ref("hf:llama-tiny"), "--preference", "grpo", "--generations", "2", "--completion-len", "4",
            "--batch", "4", "--seq", "8", "--gpu", "24GB", "--colocate-serve", "0.3"]
    refused = CliRunner().invoke(app, ["estimate", *args])
    assert refused.exit_code != 0 and "--rollout vllm" in refused.output
    result = CliRunner().invoke(app, ["estimate", *args, "--rollout", "vllm", "--json"])
    assert result.exit_code in (0, 1), result.output
    colocate = json.loads(result.stdout)["colocate"]
    assert colocate["max_model_len"] == 8 + 4
    assert any("max_num_seqs 4" in note for note in colocate["notes"])

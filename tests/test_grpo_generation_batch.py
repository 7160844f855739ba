"""--generation-batch (trl 1.16.0 GRPOConfig's generation_batch_size, apart from --grad-accum): each phase's traced peak
against the same GRPO step run for real on CPU (memest/validate/cpu_truth.py), as tests/test_grpo.py does.

trl/trainer/grpo_config.py (``__post_init__``): steps_per_generation S = generation_batch_size /
(per_device_train_batch_size x num_processes); trl/trainer/grpo_trainer.py (``_prepare_inputs``): generate when
``self._step % (S x num_iterations) == 0``, split the generation batch into S buffered slices, take slice
``self._step % S``; ``_generate_and_score_completions``: when ``gradient_accumulation_steps % S != 0`` the policy's
no-grad old log-probs of the whole generation batch (in chunks of ``per_device_train_batch_size``)."""

import pytest

from memest.errors import MemestError
from memest.features import grpo
from memest.features.registry import features_for
from memest.sources import load_source
from memest.spec import RunSpec
from memest.trace import step as core
from memest.validate.cpu_truth import measure_cpu_peak, measure_cpu_phase_peaks

from .conftest import model_ref

pytest.importorskip("trl.trainer.grpo_trainer")

BASE = dict(batch=2, seq=8, target="cpu", optim="adamw", preference="grpo", generations=2, completion_len=3,
            reference="copy")


def _traced(spec):
    source = load_source(spec.model)
    features = features_for(spec)
    trace = core.trace_step(source, spec, features=features)
    step = next(f for f in features if isinstance(f, grpo.GRPOFeature)).step_module
    return source, trace, grpo.phase_peaks(trace, step.phase_starts, spec.iterations), step


CASES = [
    # (--grad-accum, --generation-batch, the phases of the last step that generates)
    (1, 4, {"generation", grpo.OLD_LOGPS, "reference log-probs", "training step"}),  # S 2: every 2nd optimizer step
    (2, 2, {"generation", "reference log-probs", "training step"}),  # S 1: a generation per micro-step
]


@pytest.mark.parametrize("accum, generation_batch, phases", CASES, ids=["S2-K1", "S1-K2"])
def test_each_phase_and_the_step_match_trl_s_real_step(accum, generation_batch, phases):
    spec = RunSpec(model=model_ref("hf:llama-tiny"), grad_accum=accum, generation_batch=generation_batch, **BASE)
    source, trace, traced, _ = _traced(spec)
    real = measure_cpu_phase_peaks(source, spec, "memest.grpo.")
    assert set(traced) == set(real) == phases
    assert traced == real
    assert trace.peak()[0] == measure_cpu_peak(source, spec)["peak_bytes"]


def test_a_generation_batch_of_two_optimizer_steps_generates_every_other_step():
    """S = 2 x K: the trace runs 3 steps (one generation after an optimizer step); the second step trains on the
    buffered slice without generating; the generation and its old log-probs cover 2 x --batch completions."""
    spec = RunSpec(model=model_ref("hf:llama-tiny"), generation_batch=4, **BASE)
    assert spec.iterations == 3
    _, trace, traced, step = _traced(spec)
    names = [name for name, _ in step.phase_starts]
    assert names == ["generation", grpo.OLD_LOGPS, "reference log-probs", "training step", "training step"] * 1 + \
        ["generation", grpo.OLD_LOGPS, "reference log-probs", "training step"]
    assert len(step.buffered) == 2 and step.buffered[0]["completion_ids"].shape[0] == BASE["batch"]
    assert any("--generation-batch 4 (trl generation_batch_size)" in note and "old log-probs" in note
               for note in trace.notes)
    _, _, default, _ = _traced(RunSpec(model=model_ref("hf:llama-tiny"), **BASE))
    assert traced["generation"] > default["generation"]


def test_trl_s_default_is_the_grad_accum_generation_batch():
    """--generation-batch --batch x --grad-accum is trl's default (steps_per_generation = gradient_accumulation_steps):
    the same trace as without it."""
    spec = dict(model=model_ref("hf:llama-tiny"), grad_accum=2, **BASE)
    _, given, _, _ = _traced(RunSpec(generation_batch=4, **spec))
    _, default, _, _ = _traced(RunSpec(**spec))
    assert given.peak() == default.peak()


@pytest.mark.parametrize("fields, match", [
    ({"preference": "grpo", "batch": 4, "generations": 2, "generation_batch": 6}, "multiple of --batch 4"),
    ({"preference": "grpo", "batch": 2, "generations": 2, "grad_accum": 2, "generation_batch": 6},
     "not a multiple of --grad-accum 2"),
    ({"preference": "grpo", "batch": 2, "generations": 2, "generation_batch": -2}, "multiple of --batch"),
    ({"preference": "dpo", "batch": 2, "generation_batch": 4}, "add --preference grpo"),
])
def test_bad_generation_batches_are_one_line_errors(fields, match):
    with pytest.raises(MemestError, match=match):
        RunSpec(model="hf:gpt2", **fields)


def test_max_batch_refuses_a_fixed_generation_batch():
    """max-batch searches --batch; a fixed --generation-batch must be a multiple of each batch probed: one line."""
    from memest.plan.runner import Runner
    from memest.plan.search import largest_fitting

    base = RunSpec(model=model_ref("hf:llama-tiny"), generation_batch=4, **BASE)
    with pytest.raises(MemestError, match="drop it to search --batch"):
        largest_fitting(Runner(base), "batch", capacity=1 << 30)

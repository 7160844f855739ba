"""--preference orpo | cpo | simpo | kto against real CPU steps that run trl 1.16.0's own trainers' step code.

As tests/test_preference.py does for DPO, the ground truth replaces memest's step forward (its transcription) with
trl's own method called on a stand-in trainer holding the attributes it reads (each config's defaults, one process):
ORPOTrainer.get_batch_loss_metrics and CPOTrainer.get_batch_loss_metrics (trl.experimental; loss_type "sigmoid",
cpo_alpha 1.0 for CPO; loss_type "simpo", cpo_alpha 0.0 for SimPO), KTOTrainer._compute_loss (its KL forward,
reference handling and metrics included). Only the Python floats eager autograd saves for backward differ: see
tests/test_preference.py's SAVED_SCALAR (peft's LoRA scaling, GPT-2's GELU constants), the same bytes memest's plain
step misses.

bf16 on CPU is not in the list: two CPU-only allocations of real runs are not traced there, both measured with
torch.profiler on llama-tiny, batch 2, seq 32 (the real step's live blocks at its peak): (1) the CPU bf16 matmul of
the LM head allocates a float32 buffer of its output's size plus 128 B (512,128 B, ``aten::mm``) while it runs:
--preference simpo --precision bf16 measures 2,875,032 B, traced 2,613,552 B; (2) the metrics trl logs call
``logits.detach().mean()`` on the bf16 chosen and rejected logits, and CPU's mean upcasts a float32 copy of its
input (256,000 B, ``aten::_to_copy``) while the logits and the saved log-softmax outputs are alive: --preference cpo
--precision bf16 measures 2,990,570 B, traced 2,872,856 B. A GPU reduces bf16 in float32 registers without such a
copy; the matmul buffer is a CPU kernel's. Float32 steps (every case below) and DPO's bf16 case are exact."""

from __future__ import annotations

import types
from collections import defaultdict

import pytest
import torch

from memest.errors import MemestError
from memest.features import preference, preference_kto, preference_logits
from memest.features.preference_feature import peak_part
from memest.features.registry import trace_step
from memest.sources import load_source
from memest.spec import RunSpec
from memest.trace.events import Phase, Trace
from memest.validate.cpu_truth import measure_cpu_peak

from .conftest import model_ref
from .test_preference import QV, SAVED_SCALAR

# traced and real steps on ATen's CPU kernels alike (conftest.aten_cpu_kernels): the bf16 steps compare to the byte on
# CPUs where oneDNN would run their matmuls (AVX-512/AMX), as on the others
pytestmark = pytest.mark.usefixtures("aten_cpu_kernels")

pytest.importorskip("peft")
kto_trainer = pytest.importorskip("trl.trainer.kto_trainer")
orpo_trainer = pytest.importorskip("trl.experimental.orpo.orpo_trainer")
cpo_trainer = pytest.importorskip("trl.experimental.cpo.cpo_trainer")

CASES = [
    # (model, method, extra RunSpec fields, Python floats saved for backward by the policy's forward)
    ("hf:llama-tiny", "orpo", {}, 0),
    ("hf:llama-tiny", "orpo", {"lora": QV}, 4),
    ("hf:llama-tiny", "cpo", {}, 0),
    ("hf:llama-tiny", "simpo", {}, 0),
    ("hf:llama-tiny", "cpo", {"lora": QV, "checkpointing": "blocks"}, 4),
    ("hf:llama-tiny", "kto", {"reference": "copy"}, 0),
    ("hf:llama-tiny", "kto", {"lora": QV}, 4),
    ("hf:llama-tiny", "kto", {"reference": "precomputed"}, 0),
    ("hf:gpt2-tiny", "orpo", {}, 6),
    ("hf:gpt2-tiny", "simpo", {"lora": "r=8,targets=c_attn"}, 6 + 2),
    ("hf:gpt2-tiny", "kto", {"reference": "copy"}, 6),
]


def _id(case):
    name, method, extra, _ = case
    return "-".join([name[3:], method] + [f"{k}={v}" for k, v in extra.items()])


def _accelerator():
    return types.SimpleNamespace(device=torch.device("cpu"), unwrap_model=lambda m: m,
                                 gather_for_metrics=lambda t: t, gather=lambda t: t)


def _trl_logits_forward(self, **batch):
    """trl's own ORPOTrainer / CPOTrainer.get_batch_loss_metrics on the policy (metrics and .item() reads included)."""
    cls = orpo_trainer.ORPOTrainer if self.method == "orpo" else cpo_trainer.CPOTrainer
    trainer = cls.__new__(cls)
    trainer.__dict__.update(
        is_encoder_decoder=False, padding_value=0, pad_token_id=0, aux_loss_enabled=False, beta=0.1,
        label_smoothing=0.0, alpha=0.0, loss_type="simpo" if self.method == "simpo" else "sigmoid",
        cpo_alpha=0.0 if self.method == "simpo" else 1.0, simpo_gamma=0.5,
    )
    trainer.__dict__["accelerator"] = _accelerator()
    loss, _ = cls.get_batch_loss_metrics(trainer, self.policy, batch, train_eval="train")
    return preference_logits.PreferenceOutput(loss=loss)


def _trl_kto_forward(self, **batch):
    """trl's own KTOTrainer._compute_loss (KTOConfig's defaults: loss_type kto, beta 0.1, weights 1.0)."""
    trainer = types.SimpleNamespace(
        model=self.policy, ref_model=self.reference, accelerator=_accelerator(), calculate_KL=True,
        precompute_ref_logps=self.precomputed, loss_type="kto", beta=preference_kto.BETA, desirable_weight=1.0,
        undesirable_weight=1.0, aux_loss_enabled=False, args=types.SimpleNamespace(gradient_checkpointing_kwargs=None),
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)}, _total_train_tokens=0, _tp_size=1,
    )
    trainer._compute_kl_logps = types.MethodType(kto_trainer.KTOTrainer._compute_kl_logps, trainer)
    loss = kto_trainer.KTOTrainer._compute_loss(trainer, self.policy, batch, return_outputs=False)
    return preference_logits.PreferenceOutput(loss=loss)


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_preference_step_matches_trl_s_own_step_on_cpu(case, monkeypatch):
    name, method, extra, scalars = case
    ref = model_ref(name)
    spec = RunSpec(model=ref, batch=2, seq=32, target="cpu", optim="adamw", preference=method, **extra)
    source = load_source(ref)
    estimated = trace_step(source, spec).peak()[0]
    monkeypatch.setattr(preference_logits.LogitsPreferenceStep, "forward", _trl_logits_forward)
    monkeypatch.setattr(preference_kto.KTOStep, "forward", _trl_kto_forward)
    real = measure_cpu_peak(source, spec)["peak_bytes"]
    assert estimated == real - scalars * SAVED_SCALAR, f"{_id(case)}: estimated {estimated} B, measured {real} B"


def test_the_batches_are_trl_s_collated_ones():
    """memest's batches have the keys, dtypes and shapes of trl's own collators for the same examples:
    DPODataCollatorWithPadding over tokenize_row's fields (ORPO, CPO, SimPO; a 1-token prompt) and
    DataCollatorForUnpairedPreference with KL completions and precomputed log-probs (KTO)."""
    from trl.experimental.utils import DPODataCollatorWithPadding

    pairs = [{"chosen_input_ids": [5] * 32, "chosen_attention_mask": [1] * 32, "chosen_labels": [-100] + [6] * 31,
              "rejected_input_ids": [5] * 32, "rejected_attention_mask": [1] * 32,
              "rejected_labels": [-100] + [7] * 31, "prompt_input_ids": [5], "prompt_attention_mask": [1]}] * 3
    ids = torch.zeros(3, 32, dtype=torch.long)
    theirs = DPODataCollatorWithPadding(pad_token_id=0)(pairs)
    ours = preference_logits.logits_batch(ids)
    assert list(ours) == list(theirs)
    for key, value in theirs.items():
        assert (ours[key].dtype, ours[key].shape) == (value.dtype, value.shape), key
    examples = [{"prompt_ids": [5], "completion_ids": [6] * 31, "KL_completion_ids": [7] * 31, "label": i < 2,
                 "ref_logps": -1.5, "ref_KL_logps": -2.5} for i in range(3)]
    theirs = kto_trainer.DataCollatorForUnpairedPreference(pad_token_id=0)(examples)
    spec = RunSpec(model="hf:gpt2", batch=3, seq=32, preference="kto", reference="precomputed")
    ours = preference_kto.kto_batch(ids, spec)
    assert set(ours) == set(theirs)
    for key, value in theirs.items():
        assert (ours[key].dtype, ours[key].shape) == (value.dtype, value.shape), key
    assert ours["label"].tolist() == theirs["label"].tolist()  # the first half desirable, as memest's indices


@pytest.mark.parametrize("fields, match", [
    ({"preference": "orpo", "reference": "copy"}, "no reference model"),
    ({"preference": "simpo", "reference": "precomputed"}, "no reference model"),
    ({"preference": "cpo", "lora": QV, "reference": "adapter"}, "no reference model"),
    ({"preference": "kto", "batch": 1}, "--batch 2 or more"),
    ({"preference": "kto", "reference": "adapter"}, "add --lora"),
    ({"preference": "orpo", "mode": "inference"}, "training step"),
])
def test_bad_method_options_are_one_line_errors(fields, match):
    with pytest.raises(MemestError, match=match):
        RunSpec(model="hf:gpt2", **{"batch": 2, **fields})


@pytest.mark.parametrize("method", ["orpo", "kto"])
def test_the_report_names_the_part_of_the_step_that_peaks(method):
    """The note names the traced peak's phase (at this scale backward, for ORPO and KTO alike: the policy's
    gradients; the real steps above peak there too, at the same byte)."""
    ref = model_ref("hf:llama-tiny")
    spec = RunSpec(model=ref, batch=2, seq=32, target="cpu", preference=method)
    trace = trace_step(load_source(ref), spec)
    notes = [n for n in trace.notes if n.startswith("--preference: the peak falls in")]
    iteration, phase = trace.phase_at(trace.peak()[1])
    assert notes == [f"--preference: the peak falls in step {iteration}, {phase.value}: the policy's backward (the "
                     "reference and the no_grad forwards save nothing)"], trace.notes


def test_a_forward_peak_is_named_by_the_part_of_trl_s_step_it_falls_in():
    """Inside the step's forward (all of trl's compute_loss) the part that began last before the peak is named."""
    trace = Trace(events=[(0, 10), (1, 50), (1, -50), (2, 30), (2, -30), (0, -10)],
                  phase_marks=[(0, 1, Phase.FORWARD), (5, 1, Phase.BACKWARD)])
    marks = [(0, "the KL batch through the policy (no_grad)"), (1, "the policy forward on the examples"),
             (3, "the reference's KL and example forwards (no_grad)")]
    assert peak_part(trace, marks) == "--preference: the peak falls in step 1, forward: the policy forward on the examples"
    trace.events = [(0, 10), (1, 50), (1, -50), (2, 70), (2, -70), (0, -10)]
    assert peak_part(trace, marks).endswith("forward: the reference's KL and example forwards (no_grad)")


def test_advise_offers_the_reference_remedies_for_kto_only_where_a_reference_exists():
    """KTO gets precomputed reference log-probs (KTOTrainer's own precompute) and LoRA-as-reference; ORPO, which has
    no reference, gets neither."""
    from memest.plan.advise import candidates
    from memest.plan.runner import Runner

    ref = model_ref("hf:llama-tiny")
    kto = {name: c for name, c, _ in candidates(Runner(RunSpec(model=ref, batch=2, preference="kto")))}
    orpo = {name: c for name, c, _ in candidates(Runner(RunSpec(model=ref, batch=2, preference="orpo")))}
    pre = "precomputed reference log-probs (trl precompute_ref_log_probs=True)"
    assert pre in kto and pre not in orpo
    assert not any("reference" in name for name in orpo)
    assert "LoRA r=16 with its adapter-disabled base as the reference (trl + peft)" in kto
    assert not any(c.get("batch", 2) < 2 for c in kto.values())  # KTOTrainer refuses a micro-batch of 1
    assert any(c.get("batch") == 1 for c in orpo.values())
    assert preference.reference_of(RunSpec(model=ref, batch=2, preference="kto")).value == "copy"


def test_max_batch_for_kto_searches_from_two():
    """trl's KTOTrainer refuses a batch of 1, so max-batch never probes one (a stand-in runner: fits up to 5)."""
    from memest.plan.search import largest_fitting

    probed = []

    class Runner:
        base = RunSpec(model="hf:gpt2", batch=2, preference="kto")

        def run(self, batch):
            probed.append(batch)
            return types.SimpleNamespace(needed_bytes=batch, fits=lambda capacity, b=batch: b <= 5)

    assert largest_fitting(Runner(), "batch", capacity=5).value == 5
    assert min(probed) == 2
    probed.clear()
    Runner.run = lambda self, batch: probed.append(batch) or types.SimpleNamespace(needed_bytes=batch,
                                                                                     fits=lambda capacity: False)
    assert largest_fitting(Runner(), "batch", capacity=1, start=8).value == 0 and min(probed) == 2

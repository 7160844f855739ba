"""--preference dpo against real CPU steps that run trl's own DPOTrainer._compute_loss (trl 1.16.0).

The ground truth replaces the step module's forward (memest's transcription of _compute_loss) with trl's own
method, called on a stand-in trainer holding the attributes it reads (DPOConfig's defaults), so the measured
step is trl's code: its fused LM head, its reference handling (ref_model, use_adapter, precomputed log-probs),
its sigmoid loss and the metrics it logs."""

from __future__ import annotations

import types
from collections import defaultdict

import pytest
import torch

from memest.errors import MemestError
from memest.features import preference
from memest.features.registry import trace_step
from memest.sources import load_source
from memest.spec import RunSpec
from memest.trace.events import Category
from memest.validate.cpu_truth import measure_cpu_peak

from .conftest import model_ref

# traced and real steps on ATen's CPU kernels alike (conftest.aten_cpu_kernels): the bf16 steps compare to the byte on
# CPUs where oneDNN would run their matmuls (AVX-512/AMX), as on the others
pytestmark = pytest.mark.usefixtures("aten_cpu_kernels")

pytest.importorskip("peft")
dpo_trainer = pytest.importorskip("trl.trainer.dpo_trainer")

QV = "r=8,alpha=16,targets=q_proj,v_proj"
# A tensor multiplied by a Python float in a forward that autograd records: eager autograd saves the float for
# MulBackward0 as an 8-byte float64 wrapped-number tensor, which the fake-tensor trace does not allocate. Found with
# the profiler's stacks (with_stack=True) on the real step: peft's LoRA forward (``* self.scaling[adapter]``,
# peft/tuners/lora/layer.py), one per adapted layer, and transformers' NewGELUActivation (activations.py: 0.5 *,
# 0.044715 *, sqrt(2/pi) *), three per GPT-2 layer. memest's plain step (no --preference) misses the same bytes
# (measured: -32 B for llama-tiny --lora q,v; -48 B for gpt2-tiny): nothing here is the preference step's own.
SAVED_SCALAR = 8

CASES = [
    # (model, extra RunSpec fields, Python floats saved for backward by the policy's forward: see SAVED_SCALAR)
    ("hf:llama-tiny", {"reference": "copy"}, 0),
    ("hf:llama-tiny", {"lora": QV}, 4),  # auto: adapter; 2 layers x q, v adapted
    ("hf:llama-tiny", {"reference": "precomputed"}, 0),
    ("hf:llama-tiny", {"lora": QV, "reference": "precomputed"}, 4),
    ("hf:llama-tiny", {"reference": "copy", "precision": "bf16"}, 0),
    # QLoRA (trl#5200's recipe): memest's 4-bit stand-in on both sides, as tests/test_finetune.py; 2 x 7 adapted
    ("hf:llama-tiny", {"lora": "r=8,targets=all-linear", "quant": "nf4", "precision": "bf16"}, 14),
    ("hf:llama-tiny", {"reference": "copy", "checkpointing": "blocks"}, 0),
    ("hf:llama-tiny", {"lora": QV, "grad_accum": 2}, 4),
    ("hf:gpt2-tiny", {"reference": "copy"}, 6),  # transformers' GPT-2: Conv1D, tied head; 2 layers x 3 GELU floats
    ("hf:gpt2-tiny", {"lora": "r=8,targets=c_attn"}, 6 + 2),
    ("hf:gpt2-tiny", {"reference": "precomputed"}, 6),
]


def _id(case):
    name, extra, _ = case
    return "-".join([name[3:]] + [f"{k}={v}" for k, v in extra.items()])


def _trl_forward(self, **inputs):
    """trl's own DPOTrainer._compute_loss on the step's policy and reference (a stand-in trainer: DPOConfig's
    defaults, one process)."""
    accelerator = types.SimpleNamespace(
        device=torch.device("cpu"), unwrap_model=lambda m: m, gather_for_metrics=lambda t: t, gather=lambda t: t
    )
    trainer = types.SimpleNamespace(
        model=self.policy, ref_model=self.reference, accelerator=accelerator, precompute_ref_logps=self.precomputed,
        ld_alpha=None, f_divergence_type="reverse_kl", loss_types=["sigmoid"], loss_weights=[1.0],
        beta=preference.BETA, label_smoothing=0.0, use_weighting=False, aux_loss_enabled=False,
        args=types.SimpleNamespace(gradient_checkpointing_kwargs=None), _metrics=defaultdict(lambda: defaultdict(list)),
        _total_train_tokens=0, _tp_size=1,
    )
    if not self.adapter and self.reference is None:
        assert self.precomputed
    loss = dpo_trainer.DPOTrainer._compute_loss(trainer, self.policy, inputs, return_outputs=False)
    return preference.PreferenceOutput(loss=loss)


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_dpo_step_matches_trl_s_own_step_on_cpu(case, monkeypatch):
    name, extra, scalars = case
    ref = model_ref(name)
    spec = RunSpec(model=ref, batch=2, seq=32, target="cpu", optim="adamw", preference="dpo", **extra)
    source = load_source(ref)
    estimated = trace_step(source, spec).peak()[0]
    monkeypatch.setattr(preference.DPOStep, "forward", _trl_forward)
    real = measure_cpu_peak(source, spec)["peak_bytes"]
    assert estimated == real - scalars * SAVED_SCALAR, f"{_id(case)}: estimated {estimated} B, measured {real} B"


def test_the_reference_copy_is_frozen_and_counted_once_more():
    ref = model_ref("hf:llama-tiny")
    base = dict(model=ref, batch=2, seq=32, target="cpu", preference="dpo")
    copy = trace_step(load_source(ref), RunSpec(**base, reference="copy"))
    pre = trace_step(load_source(ref), RunSpec(**base, reference="precomputed"))
    assert copy.param_count == 2 * pre.param_count
    assert copy.trainable_count == pre.trainable_count == pre.param_count


def test_the_batch_is_trl_s_collated_pairs():
    """memest's batch has the keys, dtypes and shapes of trl's DataCollatorForPreference for the same pairs."""
    collator = dpo_trainer.DataCollatorForPreference(pad_token_id=0)
    examples = [
        {"prompt_ids": [5] * 10, "chosen_ids": [6] * 22, "rejected_ids": [7] * 22,
         "ref_chosen_logps": -1.5, "ref_rejected_logps": -2.5}
        for _ in range(3)
    ]
    theirs = collator(examples)
    spec = RunSpec(model="hf:gpt2", batch=3, seq=32, preference="dpo", reference="precomputed")
    ours = preference.preference_batch({"input_ids": torch.zeros(3, 32, dtype=torch.long)}, spec)
    assert set(ours) == set(theirs)
    for key, value in theirs.items():
        assert (ours[key].dtype, ours[key].shape) == (value.dtype, value.shape), key


@pytest.mark.parametrize("fields, match", [
    ({"reference": "copy"}, "add --preference dpo"),
    ({"preference": "dpo", "reference": "adapter"}, "add --lora"),
    ({"preference": "dpo", "reference": "copy", "lora": QV}, "reference adapter"),
    ({"preference": "dpo", "mode": "inference"}, "training step"),
    ({"preference": "dpo", "loss_head": "chunked"}, "not traced yet"),
])
def test_bad_preference_options_are_one_line_errors(fields, match):
    with pytest.raises(MemestError, match=match):
        RunSpec(model="hf:gpt2", **fields)


def test_advise_offers_the_recipe_remedies_with_their_cost():
    """advise re-traces precomputed reference log-probs and LoRA with the adapter-disabled base as reference; the
    first saves exactly the reference copy's parameters and buffers, less the batch's two float32 log-prob vectors."""
    import json

    from typer.testing import CliRunner

    from memest.cli import app

    ref = model_ref("hf:llama-tiny")
    args = [ref, "--preference", "dpo", "--batch", "2", "--seq", "32", "--target", "cpu"]
    result = CliRunner().invoke(app, ["advise", *args, "--gpu", "20MB", "--json"])
    assert result.exit_code in (0, 1), result.output
    remedies = {r["name"]: r for r in json.loads(result.stdout)["remedies"]}
    pre = remedies["precomputed reference log-probs (trl precompute_ref_log_probs=True)"]
    adapter = remedies["LoRA r=16 with its adapter-disabled base as the reference (trl + peft)"]
    assert "--reference precomputed" in pre["command"] and "precompute_ref_logps" in pre["time_cost"]
    assert "--reference adapter" in adapter["command"] and adapter["lowers_need"]
    base = json.loads(result.stdout)["base_needed_bytes"]
    copy = trace_step(load_source(ref), RunSpec(model=ref, batch=2, seq=32, target="cpu", preference="dpo"))
    held = (Category.PARAMETERS, Category.BUFFERS)
    reference_bytes = sum(r.nbytes for r in copy.storages if r.module.startswith("reference") and r.category in held)
    logps_inputs = 2 * 2 * 4  # ref_chosen_logps + ref_rejected_logps, batch 2, float32
    assert reference_bytes > 0 and base - pre["needed_bytes"] == reference_bytes - logps_inputs, (base, pre)

"""--preference kto: the training step of trl's KTOTrainer (unpaired examples, a KL batch, a frozen reference).

Source: trl 1.16.0 (huggingface/trl), trl/trainer/kto_trainer.py (KTOTrainer.__init__, ``_compute_kl_logps``,
``_compute_loss``; DataCollatorForUnpairedPreference); KTOConfig's defaults (loss_type "kto", beta 0.1, desirable and
undesirable weights 1.0). KTO left trl.experimental for the stable API; it runs trl's fused LM head like DPO:

- the batch: ``--batch`` unpaired examples (``input_ids``, ``attention_mask``, ``completion_mask``, int64) and, since
  loss_type "kto" estimates the KL term (``calculate_KL``), the same number of mismatched sequences (``KL_input_ids``,
  ``KL_attention_mask``, ``KL_completion_mask``: each prompt with its neighbour's completion, the same length here)
  and a bool ``label`` per example (memest: the first half desirable); with ``precompute_ref_log_probs`` two float32
  vectors ``ref_logps`` / ``ref_KL_logps``.
- ``_compute_kl_logps``: the KL batch through the POLICY inside ``torch.no_grad()`` (trl wraps it so: no graph,
  nothing saved), log-probs by the fused head (``add_fused_lm_head`` outputs log_probs, entropy, mean_logits on
  the policy, log_probs on a reference copy).
- the policy forward on the examples, with grad.
- the reference under ``no_grad`` (and trl's ``disable_gradient_checkpointing``): its KL forward, then its forward on
  the examples: a frozen copy (``ref_model``), the peft base with the adapter disabled (``use_adapter``), or no
  forward at all with precomputed log-probs.
- the loss: ``kl = gather_for_metrics((KL_logps - ref_KL_logps).mean().detach()).mean().clamp(min=0)`` (over
  --world-size ranks a real all-gather of the scalar, one float per rank: features/preference.py's
  ``gather_for_metrics``); chosen ``1 - sigmoid(beta * (logratio - kl))``, rejected ``1 - sigmoid(beta * (kl -
  logratio))``, concatenated, ``nanmean``.

Not traced: the metrics (``.item()`` reads of a few ``(B, seq)`` masks and scalars, which need values), and on
``--target cuda`` trl's Triton fold kernels (the torch fallback is traced, as for --preference dpo). ``chosen_idx`` /
``rejected_idx`` come from ``torch.nonzero(label)`` in trl (values); memest makes the same two int64 index vectors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from memest.errors import MemestError
from memest.features.preference import (
    ReferenceStep,
    add_fused_lm_head,
    frozen_copy,
    gather_for_metrics,
    reference_of,
    reference_phrase,
)
from memest.features.preference_logits import PreferenceOutput
from memest.spec.choices import Reference, Target

TRL_SOURCE = "trl 1.16.0, trl/trainer/kto_trainer.py (KTOTrainer._compute_kl_logps, _compute_loss)"
BETA = 0.1  # KTOConfig.beta default
POLICY_OUTPUTS = ("log_probs", "entropy", "mean_logits")  # KTOTrainer.__init__'s add_fused_lm_head on the policy
_NON_MODEL_KEYS = {"completion_mask", "KL_input_ids", "KL_attention_mask", "KL_completion_mask", "label", "ref_logps",
                   "ref_KL_logps"}
_KL_NON_MODEL_KEYS = {"input_ids", "attention_mask", "completion_mask", "KL_completion_mask", "label", "ref_logps",
                      "ref_KL_logps"}


def kl_logps(model, batch) -> torch.Tensor:
    """KTOTrainer._compute_kl_logps: the mismatched batch through ``model`` under no_grad, summed log-probs."""
    kwargs = {k: v for k, v in batch.items() if k not in _KL_NON_MODEL_KEYS}
    kwargs["input_ids"] = kwargs.pop("KL_input_ids")
    kwargs["attention_mask"] = kwargs.pop("KL_attention_mask")
    kwargs["use_cache"] = False
    labels = batch["KL_input_ids"].masked_fill(batch["KL_completion_mask"] == 0, -100)
    with torch.no_grad():
        per_token_logps = model(**kwargs, labels=labels, fused_lm_head=True).log_probs
    return per_token_logps[:, -(labels.size(1) - 1):].sum(-1)


class KTOStep(ReferenceStep):
    """The policy and its frozen reference as one module whose forward is KTOTrainer._compute_loss (less metrics)."""

    gloo = False  # wrap(): whether accelerate's gather of the KL term goes over gloo (--target cpu)

    def forward(self, **batch) -> PreferenceOutput:
        n = batch["label"].size(0)
        chosen_idx = torch.arange(n // 2 + n % 2)  # torch.nonzero(label).view(-1): the desirable half
        rejected_idx = torch.arange(n // 2 + n % 2, n)
        self.mark("the KL batch through the policy (no_grad)")
        KL_logps = kl_logps(self.policy, batch)
        self.mark("the policy forward on the examples")
        model_kwargs = {k: v for k, v in batch.items() if k not in _NON_MODEL_KEYS}
        model_kwargs["use_cache"] = False
        completion_labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
        outputs = self.policy(**model_kwargs, labels=completion_labels, fused_lm_head=True)
        seq_len = batch["input_ids"].size(1) - 1
        completion_logps = outputs.log_probs[:, -seq_len:].sum(-1)
        chosen_logps = completion_logps.index_select(0, chosen_idx)
        rejected_logps = completion_logps.index_select(0, rejected_idx)
        if self.precomputed:
            ref_chosen_logps = batch["ref_logps"].index_select(0, chosen_idx)
            ref_rejected_logps = batch["ref_logps"].index_select(0, rejected_idx)
            ref_KL_logps = batch["ref_KL_logps"]
        else:
            self.mark("the reference's KL and example forwards (no_grad)")
            with torch.no_grad():  # trl: also disable_gradient_checkpointing (no recompute without grad anyway)
                if self.adapter:
                    with self.policy.disable_adapter():  # trl's use_adapter(model, adapter_name=None)
                        ref_KL_logps = kl_logps(self.policy, batch)
                        ref_outputs = self.policy(**model_kwargs, labels=completion_labels, fused_lm_head=True)
                else:
                    ref_KL_logps = kl_logps(self.reference, batch)
                    ref_outputs = self.reference(**model_kwargs, labels=completion_labels, fused_lm_head=True)
            ref_completion_logps = ref_outputs.log_probs[:, -seq_len:].sum(-1)
            ref_chosen_logps = ref_completion_logps.index_select(0, chosen_idx)
            ref_rejected_logps = ref_completion_logps.index_select(0, rejected_idx)
        self.mark("the loss")
        kl = (KL_logps - ref_KL_logps).mean().detach()
        kl = gather_for_metrics(kl, self.gloo).mean().clamp(min=0)
        chosen_losses = 1 - F.sigmoid(BETA * ((chosen_logps - ref_chosen_logps) - kl))
        rejected_losses = 1 - F.sigmoid(BETA * (kl - (rejected_logps - ref_rejected_logps)))
        losses = torch.cat((1.0 * chosen_losses, 1.0 * rejected_losses), 0)  # desirable/undesirable_weight
        return PreferenceOutput(loss=losses.nanmean())


def kto_batch(ids: torch.Tensor, spec) -> dict:
    """DataCollatorForUnpairedPreference's batch for ``--batch`` examples and their KL sequences."""
    if ids.size(0) < 2:
        raise MemestError("--preference kto needs --batch 2 or more (trl's KL term)")
    batch = {}
    for prefix in ("", "KL_"):
        batch[f"{prefix}input_ids"] = ids.clone()
        batch[f"{prefix}attention_mask"] = torch.ones_like(ids)
        batch[f"{prefix}completion_mask"] = torch.ones_like(ids)
    if reference_of(spec) == Reference.PRECOMPUTED:
        batch["ref_logps"] = torch.zeros(ids.size(0), dtype=torch.float32)
        batch["ref_KL_logps"] = torch.zeros(ids.size(0), dtype=torch.float32)
    n = ids.size(0)
    batch["label"] = torch.arange(n) < (n // 2 + n % 2)  # torch.tensor([bools]): the first half desirable
    return batch


def wrap(policy: nn.Module, spec) -> KTOStep:
    """KTOTrainer.__init__'s models: trl's fused head on the policy (its peft base) and on a reference copy."""
    kind = reference_of(spec)
    reference = frozen_copy(policy) if kind == Reference.COPY else None
    add_fused_lm_head(policy.get_base_model() if hasattr(policy, "get_base_model") else policy, outputs=POLICY_OUTPUTS)
    step = KTOStep(policy, reference, adapter=kind == Reference.ADAPTER, precomputed=kind == Reference.PRECOMPUTED)
    step.gloo = spec.target == Target.CPU  # accelerate's gather: gloo on CPU, NCCL on CUDA
    return step


def describe(spec) -> str:
    """One line for the report: the step and the reference traced."""
    ref = reference_phrase(spec)
    return (f"--preference kto: trl KTOTrainer's step ({TRL_SOURCE}): {spec.batch} unpaired examples + {spec.batch} "
            f"mismatched KL sequences; the KL batch through the policy under no_grad, the examples with grad, "
            f"per-token log-probs by trl's fused LM head, reference: {ref} (its KL and example forwards under "
            f"no_grad), KTO loss (beta {BETA})")

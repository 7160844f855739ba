"""--preference orpo | cpo | simpo: the training step of trl's ORPOTrainer and CPOTrainer, full logits, no reference.

Sources: trl 1.16.0 (huggingface/trl), trl/experimental/orpo/orpo_trainer.py (ORPOTrainer.concatenated_forward,
odds_ratio_loss, get_batch_loss_metrics) and trl/experimental/cpo/cpo_trainer.py (CPOTrainer.concatenated_forward,
cpo_loss, get_batch_loss_metrics); trl/experimental/utils.py (DPODataCollatorWithPadding); trl/trainer/utils.py
(selective_log_softmax). Both trainers moved to ``trl.experimental`` and still run the older step:

- the batch: ``tokenize_row`` + ``DPODataCollatorWithPadding``: ``chosen_`` and ``rejected_`` ``input_ids``,
  ``attention_mask``, ``labels`` (the prompt's positions -100), then ``prompt_input_ids`` / ``prompt_attention_mask``,
  all int64. memest's pairs are ``--seq`` tokens each, the first one the prompt (a 1-token prompt, e.g. the BOS).
- ``concatenated_inputs`` concatenates chosen and rejected into three new ``(2B, seq)`` int64 tensors; ONE policy
  forward returns the whole ``(2B, seq, vocab)`` logits (no fused head: the logits are materialised).
- the NLL term on the chosen half: ``logits[..., :-1, :].contiguous()`` (a copy of the chosen logits) into
  ``nn.CrossEntropyLoss`` (ORPO always; CPO when ``cpo_alpha`` != 0, 1.0 by default).
- ``get_batch_logps`` on all the logits through ``selective_log_softmax`` (float32: a ``gather`` and a per-row
  ``logsumexp`` loop; bf16: a per-row ``log_softmax`` loop), summed or length-averaged (``average_log_prob``:
  ORPO and SimPO) over the completion tokens.
- the loss: ORPO ``policy_nll_loss - beta * logsigmoid(log_odds).mean()`` (``log1mexp`` of both log-probs,
  beta 0.1); CPO ``-logsigmoid(beta * (chosen - rejected)).mean() + cpo_alpha * nll`` (beta 0.1, cpo_alpha 1.0,
  CPOConfig's defaults); SimPO: CPOTrainer with ``loss_type="simpo"`` and ``cpo_alpha=0.0`` (trl's CPO docs: "SimPO
  ... set loss_type='simpo' and cpo_alpha=0.0"; with cpo_alpha > 0 it is CPO-SimPO, traced by --preference cpo's
  NLL term plus SimPO's normalisation: not offered), ``simpo_gamma`` 0.5.

No reference model: the trainers take none (``ref_model`` is not an argument). Not traced: the metrics
``get_batch_loss_metrics`` logs (``.item()`` reads of B-element tensors and of the logits' mean, which need values;
in float32 no tensor larger than ``(B,)`` is made, but CPU's ``mean`` of bf16 logits upcasts a float32 copy of them:
docs/limitations.md), and on ``--target cuda`` trl's Triton ``selective_log_softmax`` kernel (the
trace runs the torch fallback trl runs without Triton).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from memest.errors import MemestError
from memest.spec.choices import Preference

TRL_SOURCE = {
    Preference.ORPO: "trl 1.16.0, trl/experimental/orpo/orpo_trainer.py (ORPOTrainer.concatenated_forward, odds_ratio_loss)",
    Preference.CPO: "trl 1.16.0, trl/experimental/cpo/cpo_trainer.py (CPOTrainer.concatenated_forward, cpo_loss)",
    Preference.SIMPO: "trl 1.16.0, trl/experimental/cpo/cpo_trainer.py (CPOTrainer, loss_type='simpo', cpo_alpha=0.0)",
}
BETA = 0.1  # ORPOConfig.beta and CPOConfig.beta defaults
CPO_ALPHA = {Preference.ORPO: 1.0, Preference.CPO: 1.0, Preference.SIMPO: 0.0}  # ORPO: the NLL term always
SIMPO_GAMMA = 0.5  # CPOConfig.simpo_gamma default
PROMPT_TOKENS = 1  # memest's pairs: one prompt token (the BOS), the rest the completion


class PreferenceOutput(dict):
    """What the step's forward returns: the loss (HF Trainer's training_step calls backward on it)."""

    @property
    def loss(self) -> torch.Tensor:
        return self["loss"]


class MarkedStep(nn.Module):
    """A preference step module that marks where each part of trl's step begins in the trace's events (the report
    names the part the peak falls in: PreferenceFeature.finish)."""

    def __init__(self):
        super().__init__()
        self.marks: list[tuple[int, str]] = []
        self.clock = None  # set while traced: the number of events so far

    def mark(self, part: str) -> None:
        if self.clock is not None:
            self.marks.append((self.clock(), part))


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """trl's log1mexp (orpo_trainer.py): log(1 - exp(x)), branched at -ln 2."""
    t = -0.6931471805599453
    return torch.where(x < t, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def selective_log_softmax(logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """trl/trainer/utils.py selective_log_softmax, its torch path (temperature 1, no row mask)."""
    index = index.unsqueeze(-1)
    if logits.dtype in (torch.float32, torch.float64):
        selected_logits = torch.gather(logits, dim=-1, index=index)
        logsumexp_values = torch.stack([torch.logsumexp(lg, dim=-1) for lg in logits])
        per_token_logps = selected_logits - logsumexp_values.unsqueeze(-1)
    else:
        rows = []
        for row_logits, row_labels in zip(logits, index, strict=True):
            row_logps = F.log_softmax(row_logits, dim=-1)
            rows.append(row_logps.gather(dim=-1, index=row_labels))
        per_token_logps = torch.stack(rows)
    return per_token_logps.squeeze(-1)


def get_batch_logps(logits: torch.Tensor, labels: torch.Tensor, average_log_prob: bool,
                    in_place: bool = False) -> torch.Tensor:
    """ORPOTrainer/CPOTrainer.get_batch_logps for a decoder-only model."""
    labels = labels[:, 1:].clone()
    logits = logits[:, :-1, :]
    loss_mask = labels != -100
    if in_place:  # CPO: labels[labels == -100] = 0 (index_put_ through a bool mask: masked_fill_'s bytes)
        labels.masked_fill_(labels == -100, 0)
    else:  # ORPO
        labels = torch.where(labels == -100, 0, labels)
    per_token_logps = selective_log_softmax(logits, labels)
    if average_log_prob:
        return (per_token_logps * loss_mask).sum(-1) / loss_mask.sum(-1)
    return (per_token_logps * loss_mask).sum(-1)


def cross_entropy_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """concatenated_forward's cross_entropy_loss: shift, flatten, nn.CrossEntropyLoss."""
    logits = logits[..., :-1, :].contiguous()
    labels = labels[..., 1:].contiguous()
    logits = logits.view(-1, logits.shape[-1])
    labels = labels.view(-1)
    return nn.CrossEntropyLoss()(logits, labels)


def concatenated_inputs(batch: dict) -> dict:
    """concatenated_inputs for a decoder-only model whose chosen and rejected rows have one length (no padding)."""
    out = {}
    for k in batch:
        if k.startswith("chosen") and isinstance(batch[k], torch.Tensor):
            out[k.replace("chosen", "concatenated")] = batch[k]  # pad_to_length returns it when long enough
    for k in batch:
        if k.startswith("rejected") and isinstance(batch[k], torch.Tensor):
            key = k.replace("rejected", "concatenated")
            out[key] = torch.cat((out[key], batch[k]), dim=0)
    return out


class LogitsPreferenceStep(MarkedStep):
    """The policy alone, whose forward is ORPOTrainer's / CPOTrainer's get_batch_loss_metrics less the metrics."""

    def __init__(self, policy: nn.Module, method: Preference):
        super().__init__()
        self.policy = policy
        self.method = method

    def forward(self, **batch) -> PreferenceOutput:
        self.mark("the policy forward on chosen + rejected (the whole logits)")
        concatenated = concatenated_inputs(batch)
        len_chosen = batch["chosen_labels"].shape[0]
        outputs = self.policy(concatenated["concatenated_input_ids"],
                              attention_mask=concatenated["concatenated_attention_mask"], use_cache=False)
        all_logits = outputs.logits
        self.mark("the chosen NLL and the log-probs over the logits (selective_log_softmax)")
        if self.method == Preference.ORPO:
            labels = concatenated["concatenated_input_ids"].clone()
            labels = torch.where(concatenated["concatenated_attention_mask"] == 1, labels, -100)
            nll_loss = cross_entropy_loss(all_logits[:len_chosen], labels[:len_chosen])
            all_logps = get_batch_logps(all_logits, concatenated["concatenated_labels"], average_log_prob=True)
        else:
            labels = concatenated["concatenated_labels"].clone()
            if CPO_ALPHA[self.method] == 0:
                nll_loss = torch.tensor(0.0)
            else:
                nll_loss = cross_entropy_loss(all_logits[:len_chosen], labels[:len_chosen])
            all_logps = get_batch_logps(all_logits, concatenated["concatenated_labels"],
                                        average_log_prob=self.method == Preference.SIMPO, in_place=True)
        chosen_logps, rejected_logps = all_logps[:len_chosen], all_logps[len_chosen:]
        self.mark("the loss")
        if self.method == Preference.ORPO:  # odds_ratio_loss
            chosen_logps, rejected_logps = chosen_logps.float(), rejected_logps.float()
            log_odds = (chosen_logps - rejected_logps) - (log1mexp(chosen_logps) - log1mexp(rejected_logps))
            losses = BETA * F.logsigmoid(log_odds)
            loss = nll_loss - losses.mean()
        else:  # cpo_loss, alpha 0 (no AlphaPO), label_smoothing 0
            logits = chosen_logps - rejected_logps
            if self.method == Preference.SIMPO:
                logits = logits - SIMPO_GAMMA / BETA
            losses = -F.logsigmoid(BETA * logits) * (1 - 0.0) - F.logsigmoid(-BETA * logits) * 0.0
            loss = losses.mean() + CPO_ALPHA[self.method] * nll_loss
        return PreferenceOutput(loss=loss)


def logits_batch(ids: torch.Tensor) -> dict:
    """tokenize_row + DPODataCollatorWithPadding for ``B`` pairs of ``seq`` tokens (a 1-token prompt)."""
    if ids.size(1) <= PROMPT_TOKENS:
        raise MemestError(f"--preference orpo/cpo/simpo needs --seq above {PROMPT_TOKENS} (a prompt and a completion)")
    batch = {}
    for side in ("chosen", "rejected"):
        batch[f"{side}_input_ids"] = ids.clone()
        batch[f"{side}_attention_mask"] = torch.ones_like(ids)
        batch[f"{side}_labels"] = ids.clone()
        batch[f"{side}_labels"][:, :PROMPT_TOKENS] = -100  # tokenize_row: the prompt's positions ignored
    batch["prompt_input_ids"] = ids[:, :PROMPT_TOKENS].clone()
    batch["prompt_attention_mask"] = torch.ones_like(batch["prompt_input_ids"])
    return batch


def describe(spec) -> str:
    """One line for the report."""
    loss = {
        Preference.ORPO: f"chosen NLL + odds-ratio term (beta {BETA}, length-averaged log-probs)",
        Preference.CPO: f"sigmoid loss on summed log-probs (beta {BETA}) + chosen NLL (cpo_alpha {CPO_ALPHA[Preference.CPO]})",
        Preference.SIMPO: f"SimPO sigmoid loss on length-averaged log-probs (beta {BETA}, gamma {SIMPO_GAMMA}), no NLL",
    }[spec.preference]
    return (f"--preference {spec.preference}: {TRL_SOURCE[spec.preference]}: {spec.batch} chosen + {spec.batch} "
            f"rejected sequences in one batch, the whole (2B, seq, vocab) logits materialised, no reference model, "
            f"{loss}")

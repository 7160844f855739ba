"""--preference dpo: the training step of trl's DPOTrainer, traced with trl's own LM head.

Source: trl 1.16.0 (huggingface/trl, trl/trainer/dpo_trainer.py; trl/trainer/utils.py ``add_fused_lm_head``;
trl/kernels/chunked_logprob.py ``ChunkedLogProbFunction``). What the step holds, as trl runs it:

- the batch: ``DataCollatorForPreference`` puts the chosen and the rejected sequences of ``--batch`` pairs in one
  2x batch (``input_ids``, ``attention_mask``, ``completion_mask``, int64, chosen first); with
  ``precompute_ref_log_probs`` two float32 vectors ``ref_chosen_logps`` / ``ref_rejected_logps`` ride along.
  memest's batch has every position a completion token (the prompt's share matters only to the Triton path's
  compacted rows, see below).
- the policy forward: ``model(**kwargs, labels=labels, fused_lm_head=True)``; ``add_fused_lm_head`` (applied by
  DPOTrainer.__init__ to the policy, or its peft base, with outputs log_probs, entropy, mean_logits, is_top1, and
  to the reference) runs the backbone, then projects the hidden states through the LM head in vocabulary tiles
  of 32,768 (``_CHUNKED_LOGPROB_CHUNK_SIZE``) and 4,096 tokens, folding each tile into online-logsumexp
  statistics: the ``(2B, seq, vocab)`` logits never exist; backward recomputes each tile. memest calls trl's
  own ``add_fused_lm_head`` (so trl must be installed).
- the reference forward under ``torch.no_grad()``: a second frozen copy (``ref_model``), or with a peft model the
  same model inside ``use_adapter(model, None)`` (``model.disable_adapter()``), or none with
  ``precompute_ref_log_probs=True`` (DPOTrainer.__init__: ``self.ref_model = None``).
- the loss: ``_compute_loss``'s sigmoid loss (``loss_type="sigmoid"``, ``f_divergence_type="reverse_kl"``,
  ``ld_alpha=None``, ``beta=0.1``, DPOConfig's defaults), transcribed below line by line.

Not traced: the metrics ``_compute_loss`` logs after the loss (a few ``(2B, seq)`` float32 temporaries, freed before
backward, and ``.item()`` reads, which need values), and on ``--target cuda`` trl's Triton fold kernels:
the trace runs trl's torch fallback (``_forward_tile`` / ``_backward_tile``, what trl runs on devices without
Triton), whose per-tile float32 temporaries the Triton kernels do not allocate (an over-estimate there).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F

from memest.errors import MemestError
from memest.features.preference_logits import MarkedStep, PreferenceOutput
from memest.spec.choices import Reference

TRL_SOURCE = "trl 1.16.0, trl/trainer/dpo_trainer.py (DPOTrainer._compute_loss) and trl/trainer/utils.py (add_fused_lm_head)"
BETA = 0.1  # trl DPOConfig.beta default
# DPOTrainer.__init__: the policy's fused head computes these fields (use_weighting off: no log_sum_sq_probs)
POLICY_OUTPUTS = ("log_probs", "entropy", "mean_logits", "is_top1")
# the vision-language inputs DataCollatorForVisionPreference hands on (trl 1.16.0, dpo_trainer.py:211-395, Qwen2-VL's
# processor): each row-stacked, so the chosen + rejected batch holds them twice
VISION_KEYS = ("pixel_values", "image_grid_thw", "mm_token_type_ids")
_NON_MODEL_KEYS = {"completion_mask", "ref_chosen_logps", "ref_rejected_logps"}  # _compute_loss's _non_model_keys


def reference_of(spec) -> Reference:
    """The reference --reference auto resolves to: adapter with --lora, else copy (trl DPOTrainer.__init__)."""
    if spec.reference != Reference.AUTO:
        return spec.reference
    return Reference.ADAPTER if spec.lora else Reference.COPY


def add_fused_lm_head(model, outputs=("log_probs",), **head) -> None:
    """trl's own ``add_fused_lm_head`` on ``model``, or a MemestError saying how to install trl. ``head``: its other
    arguments (GRPOTrainer passes ``temperature`` and ``cast_lm_head_to_fp32``; DPO and KTO leave trl's defaults)."""
    try:
        from trl.trainer.utils import add_fused_lm_head as trl_add
    except ImportError as exc:
        raise MemestError(f"--preference dpo traces trl's own fused LM head; install trl (pip install 'memest[trl]'): "
                          f"{exc}") from exc
    trl_add(model, outputs=outputs, **head)


def world_size() -> int:
    """The ranks of the process group this step runs in (1 without one): trl's ``accelerator.num_processes``."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    """This process's rank (0 without a process group): trl's ``accelerator.process_index``."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def gather_for_metrics(t: torch.Tensor, gloo: bool) -> torch.Tensor:
    """``accelerator.gather_for_metrics(t)`` as accelerate 1.15.0 runs it (accelerate/utils/operations.py,
    ``_gpu_gather_one``; accelerator.py ``gather_for_metrics``, which drops nothing mid-epoch): ``t`` itself on one
    process; over ranks a 0-d tensor becomes ``t.clone()[None]``, then on gloo ``world`` ``empty_like`` outputs,
    ``all_gather`` into them and ``torch.cat`` (gloo's all_gather works in a flat buffer of its own,
    parallel/distributed.py's gloo rule); on any other backend (NCCL) one ``empty`` of ``world`` x numel and
    ``all_gather_into_tensor``."""
    world = world_size()
    if world == 1:
        return t
    if t.ndim == 0:
        t = t.clone()[None]
    if not t.is_contiguous():
        t = t.contiguous()
    if gloo:
        outputs = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(outputs, t)
        return torch.cat(outputs, dim=0)
    out = torch.empty(world * t.numel(), dtype=t.dtype, device=t.device)
    dist.all_gather_into_tensor(out, t)
    return out.view(-1, *t.size()[1:])


def reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """``accelerator.reduce(t, reduction="sum")`` as accelerate 1.15.0 runs it (accelerate/utils/operations.py,
    ``_reduce_across_processes``): a clone, on one process too, all-reduced in place over ranks."""
    out = t.clone()
    if world_size() > 1:
        dist.all_reduce(out, dist.ReduceOp.SUM)
    return out


class ReferenceStep(MarkedStep):
    """A policy and its frozen reference (a copy, the policy's own base with the adapter off, or none when the
    reference log-probs are precomputed) as one module; trl's DPO, KTO and GRPO steps are its forwards."""

    def __init__(self, policy: torch.nn.Module, reference: torch.nn.Module | None, adapter: bool,
                 precomputed: bool = False):
        super().__init__()
        self.policy = policy
        self.reference = reference
        self.adapter = adapter
        self.precomputed = precomputed

    def train(self, mode: bool = True) -> ReferenceStep:
        """The policy in ``mode``; the reference stays in eval mode (trl prepares it with evaluation_mode=True)."""
        super().train(mode)
        if self.reference is not None:
            self.reference.eval()
        return self


def frozen_copy(policy: torch.nn.Module, **head) -> torch.nn.Module:
    """trl's ``ref_model``: create_model_from_path(the policy's id, dtype=the policy's dtype), the same weights
    again, frozen and in eval mode, with trl's fused log-prob head (``head``: add_fused_lm_head's other arguments)."""
    import copy

    reference = copy.deepcopy(policy)
    reference.requires_grad_(False)
    reference.eval()
    add_fused_lm_head(reference, **head)
    return reference


class DPOStep(ReferenceStep):
    """The policy and its frozen reference as one module whose forward is DPOTrainer._compute_loss."""

    def forward(self, **inputs) -> PreferenceOutput:
        # DPOTrainer._compute_loss (trl 1.16.0), sigmoid loss, reverse KL, ld_alpha None, no MoE aux loss
        model_kwargs = {k: v for k, v in inputs.items() if k not in _NON_MODEL_KEYS}
        model_kwargs["use_cache"] = False
        completion_mask = inputs["completion_mask"]
        shift_completion_mask = completion_mask[..., 1:]
        labels = inputs["input_ids"].masked_fill(completion_mask == 0, -100)
        self.mark("the policy forward on chosen + rejected (fused log-prob head)")
        outputs = self.policy(**model_kwargs, labels=labels, fused_lm_head=True)
        seq_len = shift_completion_mask.size(1)
        per_token_logps = outputs.log_probs[:, -seq_len:]
        logps = per_token_logps.sum(dim=1)
        chosen_logps, rejected_logps = logps.chunk(2, dim=0)
        if self.precomputed:
            ref_chosen_logps, ref_rejected_logps = inputs["ref_chosen_logps"], inputs["ref_rejected_logps"]
        else:
            self.mark("the reference forward (no_grad)")
            with torch.no_grad():
                if self.adapter:
                    with self.policy.disable_adapter():  # trl's use_adapter(model, adapter_name=None)
                        ref_outputs = self.policy(**model_kwargs, labels=labels, fused_lm_head=True)
                else:
                    ref_outputs = self.reference(**model_kwargs, labels=labels, fused_lm_head=True)
            ref_per_token_logps = ref_outputs.log_probs[:, -seq_len:]
            ref_logps = ref_per_token_logps.sum(dim=1)
            ref_chosen_logps, ref_rejected_logps = ref_logps.chunk(2, dim=0)
        self.mark("the loss")
        chosen_logratios = chosen_logps - ref_chosen_logps
        rejected_logratios = rejected_logps - ref_rejected_logps
        delta_score = chosen_logratios - rejected_logratios
        loss = 0.0
        per_sequence_loss = -F.logsigmoid(BETA * delta_score)
        loss += per_sequence_loss.mean() * 1.0  # loss_weights default [1.0]
        return PreferenceOutput(loss=loss)


def preference_batch(inputs, spec) -> dict:
    """DataCollatorForPreference's batch for ``spec.batch`` pairs from the source's ``(batch, seq)`` input_ids."""
    ids = inputs.get("input_ids") if isinstance(inputs, dict) else None
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        raise MemestError("--preference dpo needs a causal LM's input_ids (hf: models): the source's inputs have none")
    vision = [key for key in VISION_KEYS if key in inputs]
    # chosen rows, then rejected rows; a vision-language model's inputs come with both (trace/step.py _inputs)
    input_ids = ids if vision else torch.cat([ids, ids])
    batch = {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids, dtype=torch.long),
        "completion_mask": torch.ones_like(input_ids, dtype=torch.long),
    }
    for key in vision:
        # DataCollatorForVisionPreference (trl 1.16.0, dpo_trainer.py:306, :321): the images repeated for chosen and
        # rejected and processed with the 2B prompts: pixel_values' patch rows and image_grid_thw's rows for both;
        # mm_token_type_ids (dpo_trainer.py:364) the prompt's, zeros on the completion
        batch[key] = inputs[key]
    if reference_of(spec) == Reference.PRECOMPUTED:
        # torch.tensor([example["ref_chosen_logps"] ...]): Python floats -> float32
        batch["ref_chosen_logps"] = torch.zeros(ids.size(0), dtype=torch.float32)
        batch["ref_rejected_logps"] = torch.zeros(ids.size(0), dtype=torch.float32)
    return batch


def wrap(policy: torch.nn.Module, spec) -> DPOStep:
    """DPOTrainer.__init__'s models: trl's fused head on the policy (its peft base) and on a reference copy."""
    kind = reference_of(spec)
    peft = hasattr(policy, "get_base_model")
    base = policy.get_base_model() if peft else policy
    head = getattr(base, "get_output_embeddings", None)
    if not hasattr(base, "config") or not callable(head) or head() is None:
        # trl's add_fused_lm_head reads model.config and the LM head: a plain nn.Module has neither
        raise MemestError(f"--preference dpo traces a causal LM with an LM head (hf: models); {spec.model} builds a "
                          f"{type(base).__name__}: drop --preference")
    reference = frozen_copy(policy) if kind == Reference.COPY else None
    add_fused_lm_head(policy.get_base_model() if peft else policy, outputs=POLICY_OUTPUTS)
    return DPOStep(policy, reference, adapter=kind == Reference.ADAPTER, precomputed=kind == Reference.PRECOMPUTED)


def reference_note(step: DPOStep) -> str:
    """The reference copy's parameter count and bytes (its own storages: a tied head counted once)."""
    if step.reference is None:
        return ""
    storages = {p.untyped_storage()._cdata: p.untyped_storage().nbytes() for p in step.reference.parameters()}
    count = sum(p.numel() for p in step.reference.parameters())
    return f"; the reference copy holds {count:,} frozen parameters, {sum(storages.values()):,} B (no gradients, no state)"


def reference_phrase(spec) -> str:
    """What the reference of ``spec`` is, in the report's words (DPO and KTO alike)."""
    return {
        Reference.COPY: "a second frozen copy of the policy (ref_model)",
        Reference.ADAPTER: "the policy's base with the LoRA adapter disabled",
        Reference.PRECOMPUTED: "precomputed log-probs (precompute_ref_log_probs=True, no reference forward)",
    }[reference_of(spec)]


def describe(spec) -> str:
    """One line for the report: the step and the reference traced."""
    ref = reference_phrase(spec)
    return (f"--preference {spec.preference}: trl DPOTrainer's step ({TRL_SOURCE}): {spec.batch} chosen + "
            f"{spec.batch} rejected sequences in one batch, per-token log-probs by trl's fused LM head, reference: "
            f"{ref}, sigmoid loss (beta {BETA})")


@contextlib.contextmanager
def no_padding():
    """transformers' check of the batch's attention mask answered as on the real all-ones mask: no padding, so the
    causal mask is skipped (masking_utils._ignore_causal_mask_sdpa reads the mask's values, which fake tensors lack;
    sources/hf_masks.py answers the same check for inputs without a mask)."""
    try:
        from transformers import masking_utils as mu
    except ImportError:
        yield
        return
    current = getattr(mu, "_ignore_causal_mask_sdpa", None)
    if current is None:  # another transformers layout: leave it alone
        yield
        return

    def ignore_causal_mask(padding_mask, q_length, kv_length, q_offset, kv_offset, local_attention_size=None):
        return current(None, q_length, kv_length, q_offset, kv_offset, local_attention_size)

    mu._ignore_causal_mask_sdpa = ignore_causal_mask
    try:
        yield
    finally:
        mu._ignore_causal_mask_sdpa = current

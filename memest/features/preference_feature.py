"""--preference: the StepFeature that turns the model into trl's step module and the inputs into its batch.

dpo: features/preference.py; kto: features/preference_kto.py; orpo, cpo, simpo: features/preference_logits.py.
"""

from __future__ import annotations

import contextlib

import torch

from memest.errors import MemestError
from memest.features import preference_kto, preference_logits
from memest.features.base import StepFeature
from memest.features.preference import (
    VISION_KEYS,
    describe,
    no_padding,
    preference_batch,
    reference_note,
    reference_of,
    wrap,
)
from memest.features.preference_logits import MarkedStep
from memest.spec.choices import Preference, Reference
from memest.spec.parallel_dims import FSDP_SHARDS
from memest.trace.events import Phase


class PreferenceFeature(StepFeature):
    """--preference: the model becomes trl's step module (policy, and the reference where the method has one); the
    inputs become the trainer's collated batch. dpo in preference.py, kto in preference_kto.py, orpo/cpo/simpo in
    preference_logits.py."""

    name = "preference"

    def __init__(self, spec):
        if spec.preference == Preference.NONE:
            raise MemestError("--preference none traces no preference step")

    def build(self, built, spec) -> None:
        method = spec.preference
        if method == Preference.DPO:
            built.model = wrap(built.model, spec)
            built.notes.append(describe(spec) + reference_note(built.model))
        elif method == Preference.KTO:
            built.model = preference_kto.wrap(built.model, spec)
            built.notes.append(preference_kto.describe(spec) + reference_note(built.model))
        else:
            built.model = preference_logits.LogitsPreferenceStep(built.model, method)
            built.notes.append(preference_logits.describe(spec))

    def inputs(self, inputs, spec):
        ids = inputs.get("input_ids") if isinstance(inputs, dict) else None
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
            raise MemestError(f"--preference {spec.preference} needs a causal LM's input_ids (hf: models): the "
                              "source's inputs have none")
        refuse_images(inputs, spec)
        if spec.preference == Preference.DPO:
            return preference_batch(inputs, spec)
        if spec.preference == Preference.KTO:
            return preference_kto.kto_batch(ids, spec)
        return preference_logits.logits_batch(ids)

    def autocast(self, spec, device_type: str) -> contextlib.AbstractContextManager | None:
        """--precision bf16-mixed over FSDP2 (parallel/trl_fsdp.py): no autocast. accelerate 1.15.0's
        ``Accelerator._prepare_fsdp2`` (accelerate/accelerator.py) never hands the model to ``prepare_model``, whose
        ``native_amp`` branch is what wraps the forward in autocast, and HF Trainer's ``autocast_smart_context_manager``
        is a nullcontext (transformers 5.24, trainer.py: "We rely on accelerate for autocast"): the step computes in
        the dtype the plugin's MixedPrecisionPolicy gathers the parameters in (bfloat16)."""
        if spec.mixed and spec.world_size > 1 and spec.shard in FSDP_SHARDS:
            return contextlib.nullcontext()
        return None

    def contexts(self, step) -> list[contextlib.AbstractContextManager]:
        for module in step.model.modules():
            if isinstance(module, MarkedStep):
                module.clock = lambda trace=step.trace: len(trace.events)
                self.marks = module.marks
        return [no_padding()]

    def finish(self, step) -> list[str]:
        return [peak_part(step.trace, getattr(self, "marks", []))]


IMAGE_KEYS = ("pixel", "image", "video")  # a vision-language model's inputs: pixel_values, image_grid_thw, image_sizes


def refuse_images(inputs: dict, spec) -> None:
    """--preference dpo traces a vision-language model's images as trl's DataCollatorForVisionPreference batches
    them (features/preference.py VISION_KEYS); every other method, videos, and precomputed reference log-probs
    (which trl refuses for vision data) are refused: their batches would drop the image inputs and the vision tower
    never run (was: exit 0 with the tower left out, battery 30)."""
    kept = sorted(k for k in inputs if any(word in k for word in IMAGE_KEYS))
    if not kept:
        return
    if spec.preference == Preference.DPO:
        if reference_of(spec) == Reference.PRECOMPUTED:
            # trl 1.16.0 dpo_trainer.py:764: "precompute_ref_log_probs=True is not supported for vision datasets"
            raise MemestError("--preference dpo --reference precomputed on a vision-language model: trl's DPOTrainer "
                              "refuses precompute_ref_log_probs for vision datasets; use --reference copy or adapter")
        other = [k for k in kept if k not in VISION_KEYS]
        if not other and "image_grid_thw" in inputs:  # Qwen2(.5)-VL's images (tests/test_preference_vlm.py)
            return
        kept = other or kept  # LLaVA(-NeXT): pixel_values without a grid, not measured
    raise MemestError(f"--preference {spec.preference} on a vision-language model is not traced yet: trl's batch "
                      f"would carry {', '.join(kept)}, which memest's preference batch does not (docs/limitations.md)")


def peak_part(trace, marks: list[tuple[int, str]]) -> str:
    """Which part of trl's step the traced peak falls in: the phase, and within the step's forward (which runs the
    whole of trl's compute_loss) the part that began last before the peak."""
    index = trace.peak()[1]
    iteration, phase = trace.phase_at(index)
    where = f"step {iteration}, {phase.value}"
    if phase in (Phase.FORWARD, Phase.LOSS):
        parts = [part for at, part in marks if at <= index]
        if parts:
            where += f": {parts[-1]}"
    elif phase == Phase.BACKWARD:
        where += ": the policy's backward (the reference and the no_grad forwards save nothing)"
    return f"--preference: the peak falls in {where}"

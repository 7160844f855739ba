"""--preference dpo on a vision-language model (tiny Qwen2-VL, random weights, tests/configs/qwen2-vl-tiny.json)
against real CPU steps that run trl 1.16.0's own DPOTrainer._compute_loss, as tests/test_preference.py does for
causal LMs: the step module's forward is replaced by trl's method on a stand-in trainer.

trl's batch for a VLM (DataCollatorForVisionPreference, trl/trainer/dpo_trainer.py:211-395): the images repeated for
chosen and rejected (``images * 2``) and processed with the prompts repeated (``prompts * 2``), so pixel_values holds
the patch rows of 2 x batch x images images and image_grid_thw 2 x batch x images rows, chosen's first, in one
batch with the 2 x batch input_ids; _compute_loss passes every key but completion_mask and the ref log-probs to the
policy and to the reference forward alike (dpo_trainer.py:1289-1290): both run the vision tower on all images.
precompute_ref_log_probs is refused by trl for vision data (dpo_trainer.py:764) and by memest.

Residual: -8 B per QuickGELU in Qwen2-VL's vision MLP of the policy when the peak falls in the forward or backward
of a trained tower (tests/test_vlm_images.py's docstring: ``1.702 * input`` saves a wrapped 0-d float64 scalar the trace does not see),
plus tests/test_preference.py's SAVED_SCALAR for peft's LoRA scaling."""

from __future__ import annotations

import pytest

from memest.errors import MemestError
from memest.features import preference
from memest.features.registry import trace_step
from memest.sources import load_source
from memest.spec import RunSpec
from memest.validate.cpu_truth import measure_cpu_peak

from .conftest import model_ref
from .test_preference import QV, SAVED_SCALAR, _trl_forward

pytest.importorskip("peft")
pytest.importorskip("trl.trainer.dpo_trainer")

QWEN = "hf:qwen2-vl-tiny"
CASES = [
    # (extra RunSpec fields, wrapped float scalars the policy's forward saves: see the module docstring)
    # 2 vision blocks x one QuickGELU each; with --lora also 2 text layers x q, v adapted (peft's scaling)
    ({"reference": "copy", "images": 1, "image_size": "56x56"}, 2),
    ({"reference": "copy", "images": 2, "image_size": "56x84"}, 2),
    # auto: adapter; the vision tower is frozen with the base, so its QuickGELU records nothing for backward
    ({"lora": QV, "images": 1, "image_size": "56x56"}, 4),
]


def _id(case):
    return "-".join(f"{k}={v}" for k, v in case[0].items())


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_dpo_on_qwen2_vl_matches_trl_s_own_step_on_cpu(case, monkeypatch):
    extra, scalars = case
    ref = model_ref(QWEN)
    spec = RunSpec(model=ref, batch=2, seq=16, target="cpu", optim="adamw", preference="dpo", **extra)
    source = load_source(ref)
    trace = trace_step(source, spec)
    estimated = trace.peak()[0]
    monkeypatch.setattr(preference.DPOStep, "forward", _trl_forward)
    real = measure_cpu_peak(source, spec)["peak_bytes"]
    assert estimated == real - scalars * SAVED_SCALAR, f"{_id(case)}: estimated {estimated} B, measured {real} B ({estimated - real:+d} B)"


def test_the_batch_holds_chosen_and_rejected_images():
    """The traced batch: 2 x batch rows of input_ids and 2 x batch x images rows of image_grid_thw, as trl's."""
    ref = model_ref(QWEN)
    spec = RunSpec(model=ref, batch=3, seq=16, target="cpu", preference="dpo", images=2, image_size="56x56")
    from memest.features.registry import build

    batch = build(load_source(ref), spec).inputs
    assert batch["input_ids"].shape[0] == 6 and batch["image_grid_thw"].shape[0] == 12
    assert batch["pixel_values"].shape[0] == 12 * 4 * 4  # 56x56: a 4 x 4 patch grid (14 px patches) per image


def test_precomputed_reference_on_a_vlm_is_refused_as_trl_does():
    ref = model_ref(QWEN)
    with pytest.raises(MemestError, match="precompute_ref_log_probs"):
        trace_step(load_source(ref), RunSpec(model=ref, batch=1, seq=16, target="cpu", preference="dpo",
                                             reference="precomputed", images=1, image_size="56x56"))


@pytest.mark.parametrize("name, extra, named", [
    ("hf:llava-tiny", {"seq": 200}, "pixel_values"),  # LLaVA: pixel_values without a grid, not measured
    ("hf:llava-next-tiny", {"seq": 200}, "image_sizes"),
    (QWEN, {"seq": 16, "video_frames": 2, "image_size": "56x56"}, "video"),
    (QWEN, {"seq": 16, "world_size": 2, "images": 1, "image_size": "56x56"}, "--images"),
])
def test_the_unmeasured_vision_batches_stay_refused(name, extra, named):
    ref = model_ref(name)
    with pytest.raises(MemestError, match=named):
        RunSpec(model=ref, batch=1, target="cpu", preference="dpo", **extra)
        trace_step(load_source(ref), RunSpec(model=ref, batch=1, target="cpu", preference="dpo", **extra))

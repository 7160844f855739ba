"""Vision-language images, second part (tests/test_hf_images.py has the first): Qwen2.5-VL traced (its window
attention's ``unique_consecutive`` and the other reads of image_grid_thw followed with the real values,
sources/hf_values.py), each step against the same step run for real on CPU (validate/cpu_truth.py,
torch.profiler memory events); the Qwen2-VL residuals per tensor; the report's images line and JSON key.

The residuals left, each found by comparing the trace's live storages at its peak with the profiler's live
blocks at the real peak (what is live in one and not the other):
- -12 B when the peak is in AdamW's step (small images: the optimizer state outweighs the activations): a
  Python number operand (``denom = ... / bias_correction2_sqrt``) wrapped by torch's argument parser as a 0-d
  float64 tensor (8 B, allocated outside any aten op, so under "Optimizer.step#AdamW.step") and its float32
  copy (4 B, ``empty_strided`` in ``_to_copy``), live during the ``div`` at the peak: the plain AdamW step's
  own residual (tests/test_optim_in_backward.py), not the images' (Qwen2.5-VL at 60x90, 1 image, fp32: -12 B,
  measured once; Qwen2-VL's fp32 cases in tests/test_hf_images.py).
- -8 B per QuickGELU in Qwen2-VL's vision MLP when the peak is in the forward or loss: ``1.702 * input``
  (transformers/activations.py QuickGELUActivation) wraps 1.702 as a 0-d float64 tensor that ``mul`` saves
  for backward; the trace does not see wrapped-number scalars.
"""

import dataclasses

import pytest
import torch
from torch import nn

from memest.features.registry import trace_step
from memest.sources import load_source
from memest.spec import RunSpec
from memest.targets.cpu import cpu_kernels
from memest.validate.op_truth import measure_ops

from .conftest import model_ref, real_cpu_peak

QWEN25 = "hf:qwen2.5-vl-tiny"  # transformers' Qwen2_5_VLConfig defaults, shrunk (tests/configs/qwen2.5-vl-tiny.json)


def _gap(ref: str, **kw) -> tuple[int, int]:
    spec = RunSpec(model=model_ref(ref), seq=16, optim="adamw", target="cpu", **kw)
    source = load_source(spec.model)
    return trace_step(source, spec).peak()[0], real_cpu_peak(source, spec)


@pytest.mark.parametrize("kw", [
    # 140x250 -> smart_resize 140x252 -> a 10 x 18 patch grid: 5 x 9 merged patches in 4 x 4 windows (padded)
    dict(batch=1, images=1, image_size="140x250", precision="fp32"),
    dict(batch=1, images=2, image_size="140x250", precision="bf16-mixed", freeze="model.visual.*"),
], ids=["fp32", "bf16-mixed-tower-frozen"])
def test_qwen2_5_vl_images_estimate_equals_real_cpu_peak(kw):
    estimated, real = _gap(QWEN25, **kw)
    assert estimated == real, f"estimated {estimated} B, measured {real} B ({estimated - real:+d} B)"


def test_qwen2_5_vl_windows_are_the_processors():
    """The window index the real model computes from image_grid_thw, and the grid memest built."""
    source = load_source(model_ref(QWEN25))
    model = source.build_model()
    inputs = source.image_inputs(1, 16, 1, (140, 250))
    assert inputs["image_grid_thw"].tolist() == [[1, 10, 18]]
    assert (inputs["input_ids"] == model.config.image_token_id).sum() == 5 * 9
    from transformers.vision_utils import get_vision_window_index

    _, cu = get_vision_window_index(inputs["image_grid_thw"], 2, 112, 14)
    # 5 x 9 merged patches padded to 8 x 12: windows of 4x4, 4x4, 4x1, 1x4, 1x4, 1x1 merged patches (4 patches each)
    assert cu.tolist() == [0, 64, 128, 144, 160, 176, 180]
    with torch.no_grad():
        assert torch.isfinite(model(**inputs).loss)


def test_qwen2_vl_bf16_mixed_misses_only_the_saved_scalars():
    """Was -1,936 B (tests/test_hf_images.py allows 4 KiB): the vision LayerNorms' mean and rstd under CPU
    autocast (bf16 input, fp32 weights) are float32 in the real kernel, bf16 in the fake one (1,920 B, now a
    rule, targets/cpu/aten_norms.py); the 16 B left are the two QuickGELU scalars (module docstring)."""
    estimated, real = _gap("hf:qwen2-vl-tiny", batch=2, images=2, image_size="60x90", precision="bf16-mixed")
    assert estimated - real == -16


def test_mixed_layer_norm_statistics_match_real_allocations():
    """layer_norm_cpu with a bf16 input and fp32 weight and bias keeps float32 mean and rstd
    (param_scalar_type, ATen mixed_type.h), call by call against the profiler."""
    x = torch.randn(4, 96, 48, dtype=torch.bfloat16, requires_grad=True)
    ln = nn.LayerNorm(48)

    def step():
        ln(x).backward(torch.ones(4, 96, 48, dtype=torch.bfloat16))

    scratch, outputs, _ = cpu_kernels()
    calls = measure_ops(step, scratch, outputs)
    assert [c.op for c in calls] == ["native_layer_norm.default", "native_layer_norm_backward.default"]
    for c in calls:
        assert c.exact, f"{c.op}: real peak {c.real_peak} kept {c.real_kept}, model {c.model_peak} / {c.model_kept}"


def test_report_says_what_the_images_cost():
    """The images row and JSON key: the processor's tokens, the batch's image tokens and the vision tower's part
    of the peak, summed from the trace's own storages (tower frozen: no gradients, none of the optimizer)."""
    from memest.estimator import estimate
    from memest.report.summary import summary_rows

    spec = RunSpec(model=model_ref(QWEN25), batch=1, seq=16, optim="adamw", target="cpu", images=2,
                   image_size="140x250", freeze="model.visual.*")
    report = estimate(spec).report
    im = report.to_dict()["images"]
    assert (im["size"], im["resized"], im["tokens_per_image"], im["image_tokens"]) == ("140x250", "140x252", 45, 90)
    assert im["tower"] == ["model.visual"] and im["tower_state"] == "frozen" and im["tower_gradient_bytes"] == 0
    visual = next(row for row in report.layers if row.name == "model.visual")
    assert im["tower_params"] == visual.params and im["tower_param_bytes"] == visual.param_bytes
    assert im["tower_bytes_at_peak"] == visual.bytes_at_peak  # the per-layer table's figure for the same module
    # frozen at the model's input: nothing in it needs a gradient, so its modules save nothing for backward
    assert im["tower_activation_bytes_at_peak"] == 0 and im["tower_share_of_activations"] == 0
    assert im["tower_share_of_peak"] == im["tower_bytes_at_peak"] / report.peak_allocated_bytes
    rows = [row.text for row in summary_rows(report) if row.label in ("images", "")]
    assert rows[0].startswith("2 x 140x250 per example -> 140x252, 45 tokens each; 90 image tokens in the batch")
    assert "vision tower model.visual" in rows[1] and "frozen" in rows[1]
    trained = estimate(dataclasses.replace(spec, freeze="")).report.images
    assert trained["tower_state"] == "trained" and trained["tower_gradient_bytes"] == im["tower_param_bytes"]
    assert 0 < trained["tower_activation_bytes_at_peak"] and 0 < trained["tower_share_of_activations"] <= 1
    plain = estimate(RunSpec(model=model_ref("hf:llama-tiny"), batch=1, seq=16, target="cpu"))
    assert plain.report.to_dict()["images"] is None  # without --images


LLAVA_NEXT = "hf:llava-next-tiny"  # llava-tiny's towers, LlavaNextConfig's default pinpoints scaled 336 px -> 32 px


@pytest.mark.parametrize("hw,tiles", [((50, 90), 5), ((90, 50), 5), ((32, 32), 3), ((200, 60), 4)])
def test_llava_next_tiles_are_the_image_processors(hw, tiles):
    """The anyres tiles per image against transformers' own LlavaNextImageProcessor on a real image of that size,
    and the image tokens against the real model's own image features (pack_image_features: unpadded + newlines)."""
    import numpy as np
    from transformers import LlavaNextImageProcessor

    source = load_source(model_ref(LLAVA_NEXT))
    model = source.build_model()
    config = model.config
    processor = LlavaNextImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32},
                                        image_grid_pinpoints=config.image_grid_pinpoints)
    real = processor(images=[np.zeros((*hw, 3), dtype=np.uint8)], return_tensors="pt")
    inputs = source.image_inputs(1, 8, 1, hw)
    assert inputs["pixel_values"].shape == real["pixel_values"].shape == (1, tiles, 3, 32, 32)
    assert inputs["image_sizes"].tolist() == real["image_sizes"].tolist()
    with torch.no_grad():
        features = model.model.get_image_features(inputs["pixel_values"], inputs["image_sizes"]).pooler_output
    tokens = (inputs["input_ids"] == config.image_token_id).sum().item()
    assert tokens == sum(len(f) for f in features)


@pytest.mark.parametrize("kw,gap", [
    (dict(batch=1, images=1, image_size="50x90", precision="fp32"), -24),
    (dict(batch=2, images=2, image_size="200x60", precision="bf16-mixed", freeze="model.vision_tower.*"), 0),
], ids=["fp32", "bf16-mixed-tower-frozen"])
def test_llava_next_images_estimate_matches_real_cpu_peak(kw, gap):
    """fp32: -24 B, the three 1.702 scalars CLIP's QuickGELU saves (8 B each, the module docstring's; the plain
    LLaVA step's 24 B in tests/test_hf_images.py are the same three, found by the same comparison); the tower
    frozen saves none of them: to the byte."""
    estimated, real = _gap(LLAVA_NEXT, **kw)
    assert estimated - real == gap, f"estimated {estimated} B, measured {real} B ({estimated - real:+d} B)"


def test_llava_next_tower_is_partly_trained_as_the_real_step():
    """Unfrozen, LLaVA's tower is still partly trained: with vision_feature_layer -2 its last encoder layer and
    post_layernorm are unused, and the real backward leaves their .grad None; the report's gradient bytes are
    the rest, counted from the real model's own gradients after a real step."""
    from memest.estimator import estimate

    spec = RunSpec(model=model_ref(LLAVA_NEXT), batch=1, seq=8, target="cpu", images=1, image_size="50x90")
    im = estimate(spec).report.images
    source = load_source(spec.model)
    model = source.build_model()
    model(**source.image_inputs(1, 8, 1, (50, 90))).loss.backward()
    tower = [model.model.vision_tower, model.model.multi_modal_projector]
    grads = sum(p.grad.nbytes for m in tower for p in m.parameters() if p.grad is not None)
    assert im["tower_state"] == "partly trained" and 0 < grads < im["tower_param_bytes"]
    assert im["tower_gradient_bytes"] == grads

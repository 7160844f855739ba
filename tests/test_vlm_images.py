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
  own residual (tests/test_optim_in_backward.py), not the images'.
- -8 B per QuickGELU in Qwen2-VL's vision MLP when the peak is in the forward or loss: ``1.702 * input``
  (transformers/activations.py QuickGELUActivation) wraps 1.702 as a 0-d float64 tensor that ``mul`` saves
  for backward; the trace does not see wrapped-number scalars.
"""

import pytest
import torch
from torch import nn

from memest.features.registry import trace_step
from memest.sources import load_source
from memest.spec import RunSpec
from memest.targets.cpu import cpu_kernels
from memest.validate.cpu_truth import measure_cpu_peak
from memest.validate.op_truth import measure_ops

from .conftest import model_ref

QWEN25 = "hf:qwen2.5-vl-tiny"  # transformers' Qwen2_5_VLConfig defaults, shrunk (tests/configs/qwen2.5-vl-tiny.json)


def _gap(ref: str, **kw) -> tuple[int, int]:
    spec = RunSpec(model=model_ref(ref), seq=16, optim="adamw", target="cpu", **kw)
    source = load_source(spec.model)
    return trace_step(source, spec).peak()[0], measure_cpu_peak(source, spec)["peak_bytes"]


@pytest.mark.parametrize("kw", [
    # 140x250 -> smart_resize 140x252 -> a 10 x 18 patch grid: 5 x 9 merged patches in 4 x 4 windows (padded)
    dict(batch=1, images=1, image_size="140x250", precision="fp32"),
    dict(batch=1, images=2, image_size="140x250", precision="bf16-mixed", freeze="model.visual.*"),
], ids=["fp32", "bf16-mixed-tower-frozen"])
def test_qwen2_5_vl_images_estimate_equals_real_cpu_peak(kw):
    estimated, real = _gap(QWEN25, **kw)
    assert estimated == real, f"estimated {estimated} B, measured {real} B ({estimated - real:+d} B)"


def test_qwen2_5_vl_peak_in_adamw_misses_its_scalars():
    """A small image: the peak is AdamW's step, which the trace reads 12 B low (see the module docstring)."""
    estimated, real = _gap(QWEN25, batch=1, images=1, image_size="60x90", precision="fp32")
    assert estimated - real == -12


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

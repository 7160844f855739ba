"""--images N --image-size HxW on vision-language hf: models (sources/hf_inputs.py image_inputs): the image
tokens as the processor makes them, traced on fake tensors against the same step run for real on CPU
(memest/validate/cpu_truth.py, torch.profiler memory events), and the refusal on a model without images."""

import pytest
import torch

from memest.errors import MemestError, TraceError
from memest.features.registry import trace_step
from memest.sources import load_source
from memest.spec import RunSpec
from memest.validate.cpu_truth import measure_cpu_peak

from .conftest import model_ref, real_cpu_peak


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
@pytest.mark.parametrize("freeze", ["", "model.vision_tower.*"])
def test_llava_images_estimate_equals_real_cpu_peak(precision, freeze):
    ref = model_ref("hf:llava-tiny")
    spec = RunSpec(model=ref, batch=2, seq=16, optim="adamw", precision=precision, target="cpu",
                   images=3, image_size="480x640", freeze=freeze)
    source = load_source(ref)
    estimated, _ = trace_step(source, spec).peak()
    real = real_cpu_peak(source, spec)
    # the step without --images (one image, 64 tokens) misses by the same bytes: what the images add is exact
    plain = RunSpec(model=ref, batch=2, seq=64, optim="adamw", precision=precision, target="cpu", freeze=freeze)
    plain_gap = trace_step(source, plain).peak()[0] - measure_cpu_peak(source, plain)["peak_bytes"]
    # the plain LLaVA step's residual: CLIP QuickGELU's saved 1.702 scalars, 8 B each (tests/test_vlm_images.py)
    assert abs(plain_gap) <= 64
    assert estimated - real == plain_gap, f"estimated {estimated} B, measured {real} B ({estimated - real:+d} B)"


def test_llava_images_add_their_tokens_to_the_text():
    source = load_source(model_ref("hf:llava-tiny"))  # 32px tower, patch 8: 16 image tokens per image
    model = source.build_model()
    inputs = source.image_inputs(2, 16, 3, (480, 640))
    assert inputs["pixel_values"].shape == (6, 3, 32, 32)  # resized to the tower's size, one row per image
    assert inputs["input_ids"].shape == (2, 16 + 3 * 16)
    assert (inputs["input_ids"] == model.config.image_token_id).sum() == 2 * 3 * 16
    with torch.no_grad():
        assert torch.isfinite(model(**inputs).loss)  # the real model takes them


def test_images_refused_on_a_model_without_image_tokens():
    ref = model_ref("hf:llama-tiny")
    spec = RunSpec(model=ref, batch=1, seq=16, target="cpu", images=1)
    with pytest.raises(TraceError, match="not a vision-language model"):
        trace_step(load_source(ref), spec)


def test_image_size_is_checked():
    with pytest.raises(MemestError, match="HEIGHTxWIDTH"):
        RunSpec(model="hf:llama-tiny", images=1, image_size="448")
    with pytest.raises(MemestError, match="--images N"):
        RunSpec(model="hf:llama-tiny", image_size="448x448")


QWEN = "hf:qwen2-vl-tiny"  # patch 14, spatial merge 2: one image token per 28 x 28 pixels after smart_resize


@pytest.mark.parametrize("batch,images,size,precision,freeze,tolerance", [
    # the fp32 steps miss by 12-16 B: Python floats wrapped as 8 B tensors (AdamW's, QuickGELU's), tests/test_vlm_images.py
    (1, 1, "60x90", "fp32", "", 64),
    (2, 2, "60x90", "fp32", "model.visual.*", 64),  # the vision tower frozen
    (2, 2, "60x90", "bf16-mixed", "", 4096),  # was -1,936 B (LayerNorm stats, fixed), now -16 B: tests/test_vlm_images.py
])
def test_qwen2_vl_images_estimate_matches_real_cpu_peak(batch, images, size, precision, freeze, tolerance):
    ref = model_ref(QWEN)
    spec = RunSpec(model=ref, batch=batch, seq=16, optim="adamw", precision=precision, target="cpu",
                   images=images, image_size=size, freeze=freeze)
    source = load_source(ref)
    estimated, _ = trace_step(source, spec).peak()
    real = real_cpu_peak(source, spec)
    assert abs(estimated - real) <= tolerance, f"estimated {estimated} B, measured {real} B ({estimated - real:+d} B)"


def test_qwen2_vl_images_are_cut_as_the_processor_cuts_them():
    source = load_source(model_ref(QWEN))
    model = source.build_model()
    # 60x90 -> smart_resize 56x84 (multiples of 28) -> a 4 x 6 patch grid -> 6 image tokens after the 2 x 2 merge
    inputs = source.image_inputs(2, 16, 2, (60, 90))
    assert inputs["image_grid_thw"].tolist() == [[1, 4, 6]] * 4
    assert inputs["pixel_values"].shape == (4 * 24, 3 * 2 * 14 * 14)
    assert inputs["input_ids"].shape == (2, 16 + 2 * (6 + 2))  # + <|vision_start|>, <|vision_end|> per image
    assert (inputs["input_ids"] == model.config.image_token_id).sum() == 2 * 2 * 6
    with torch.no_grad():
        features = model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
        assert sum(len(f) for f in features.pooler_output) == 4 * 6  # one feature per image token
        assert torch.isfinite(model(**inputs).loss)  # the real model takes them

"""Qwen2-VL's processors' min_pixels / max_pixels and video inputs (sources/hf_qwen_vl.py): the inputs memest
builds against transformers 5.24.0's own processors, and each step against the same step run for real on CPU
(validate/cpu_truth.py, torch.profiler memory events).

The residuals, each the known one found per tensor in tests/test_vlm_images.py (its module docstring): -12 B
when the peak is in AdamW's step (a Python float wrapped as a 0-d float64 tensor and its float32 copy); -8 B
per QuickGELU of Qwen2-VL's vision MLP (2 blocks: -16 B) when the peak is in the forward or loss.

Qwen2VLVideoProcessor's module imports torchvision, which is not installed here (nor needed by memest): its own
``smart_resize``, ``patchify`` and ``get_num_of_video_patches`` are taken from the installed file with ``ast``
and run on real tensors; the image processor is transformers' PIL backend (Qwen2VLImageProcessorPil).
"""

import ast
import math
import pathlib

import numpy as np
import pytest
import torch

from memest.errors import MemestError
from memest.features.registry import trace_step
from memest.sources import load_source
from memest.spec import RunSpec

from .conftest import CONFIGS, model_ref, real_cpu_peak

QWEN2, QWEN25 = "hf:qwen2-vl-tiny", "hf:qwen2.5-vl-tiny"


def _video_processor_code() -> dict:
    """Qwen2VLVideoProcessor's smart_resize, patchify and get_num_of_video_patches and its class default ``size``,
    from transformers' own video_processing_qwen2_vl.py."""
    import transformers

    path = pathlib.Path(transformers.__file__).parent / "models" / "qwen2_vl" / "video_processing_qwen2_vl.py"
    tree = ast.parse(path.read_text())
    funcs = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)
             and n.name in ("smart_resize", "patchify", "get_num_of_video_patches")]
    ns: dict = {"math": math, "torch": torch}
    exec(compile(ast.Module(body=funcs, type_ignores=[]), str(path), "exec"), ns)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Qwen2VLVideoProcessor")
    size = next(n.value for n in cls.body if isinstance(n, ast.Assign) and n.targets[0].id == "size")
    ns["size"] = eval(compile(ast.Expression(size), str(path), "eval"))
    return ns


@pytest.mark.parametrize("hw,bounds", [
    ((140, 250), (3136, 4000)),  # max_pixels below the image: smart_resize scales it down (2 x 6 patches)
    ((140, 250), (3136, 0)),  # the processor's default max_pixels
    ((30, 40), (20000, 0)),  # min_pixels above the image: scaled up
    ((600, 900), (0, 200000)),
])
def test_min_max_pixels_are_the_image_processors(hw, bounds):
    """pixel_values and image_grid_thw against Qwen2VLImageProcessorPil(size={shortest_edge, longest_edge}) on a
    real image of that size; 0 = the processor's own default, which memest's defaults equal."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    default = Qwen2VLImageProcessorPil().size
    lo, hi = bounds
    processor = Qwen2VLImageProcessorPil(size={"shortest_edge": lo or default["shortest_edge"],
                                               "longest_edge": hi or default["longest_edge"]})
    real = processor(images=[np.zeros((*hw, 3), dtype=np.uint8)] * 2, return_tensors="pt")
    source = load_source(model_ref(QWEN2))
    inputs = source.image_inputs(1, 8, 2, hw, min_pixels=lo, max_pixels=hi)
    assert inputs["pixel_values"].shape == real["pixel_values"].shape
    assert inputs["image_grid_thw"].tolist() == real["image_grid_thw"].tolist()
    per_image = int(real["image_grid_thw"][0].prod()) // 4
    assert (inputs["input_ids"] == source.build_model().config.image_token_id).sum() == 2 * per_image
    facts = source.image_facts(2, hw, min_pixels=lo, max_pixels=hi)
    assert (facts["min_pixels"], facts["max_pixels"]) == (processor.size["shortest_edge"], processor.size["longest_edge"])
    assert facts["tokens_per_image"] == per_image


@pytest.mark.parametrize("frames,hw,bounds", [
    (3, (60, 90), (3136, 0)),  # an odd count: the last frame repeated to make 2 temporal patches
    (4, (60, 90), (0, 0)),  # the video processor's default min_pixels (100,352) scales 60x90 up
    (5, (300, 500), (0, 20000)),
])
def test_video_is_the_video_processors(frames, hw, bounds):
    """pixel_values_videos and video_grid_thw as Qwen2VLVideoProcessor's own smart_resize and patchify make them
    of a real video tensor, and its get_num_of_video_patches; the video tokens one per merged patch."""
    code = _video_processor_code()
    lo, hi = bounds[0] or code["size"]["shortest_edge"], bounds[1] or code["size"]["longest_edge"]
    h, w = code["smart_resize"](*hw, factor=28, min_pixels=lo, max_pixels=hi)
    patches, t, gh, gw = code["patchify"](None, torch.zeros(1, frames, 3, h, w), patch_size=14, merge_size=2,
                                          temporal_patch_size=2)

    class Processor:  # what get_num_of_video_patches reads of the processor
        size, patch_size, merge_size, temporal_patch_size = {"shortest_edge": lo, "longest_edge": hi}, 14, 2, 2

    assert code["get_num_of_video_patches"](Processor, frames, *hw, {}) == t * gh * gw
    source = load_source(model_ref(QWEN2))
    inputs = source.image_inputs(2, 8, 0, hw, min_pixels=bounds[0], max_pixels=bounds[1], video_frames=frames)
    assert inputs["pixel_values_videos"].shape == (2 * patches.shape[1], patches.shape[2])
    assert inputs["video_grid_thw"].tolist() == [[t, gh, gw]] * 2
    config = source.build_model().config
    assert "pixel_values" not in inputs and (inputs["input_ids"] == config.image_token_id).sum() == 0
    assert (inputs["input_ids"] == config.video_token_id).sum() == 2 * t * gh * gw // 4
    assert (inputs["mm_token_type_ids"] == 2).sum() == 2 * t * gh * gw // 4
    video = source.image_facts(0, hw, min_pixels=bounds[0], max_pixels=bounds[1], video_frames=frames)["video"]
    assert (video["min_pixels"], video["max_pixels"], video["grid_thw"]) == (lo, hi, [t, gh, gw])


def test_images_and_video_together_reach_the_real_model():
    """Two images then a video per example: the real Qwen2.5-VL takes them (its checks that the image and video
    tokens match the features), and its video features are one per video token."""
    source = load_source(model_ref(QWEN25))
    model = source.build_model()
    inputs = source.image_inputs(1, 8, 2, (60, 90), max_pixels=3000, video_frames=3)
    assert inputs["image_grid_thw"].tolist() == [[1, 2, 4]] * 2  # 60x90 within 3,000 px -> 28x56 -> 2 x 4 patches
    assert inputs["video_grid_thw"].tolist() == [[2, 2, 4]]  # the frames' max_pixels 3,000 too; 3 frames -> 2
    with torch.no_grad():
        features = model.model.get_video_features(inputs["pixel_values_videos"], inputs["video_grid_thw"])
        assert sum(len(f) for f in features.pooler_output) == (inputs["input_ids"] == 101).sum() == 4
        assert torch.isfinite(model(**inputs).loss)


def _gap(ref: str, **kw) -> int:
    spec = RunSpec(model=model_ref(ref), seq=16, optim="adamw", target="cpu", **kw)
    source = load_source(spec.model)
    return trace_step(source, spec).peak()[0] - real_cpu_peak(source, spec)


@pytest.mark.parametrize("ref,kw,gap", [
    # 140x250 within 4,000 px: a 2 x 6 grid (3 tokens) instead of 10 x 18 (45); peak in AdamW's step
    (QWEN2, dict(batch=1, images=1, image_size="140x250", max_pixels=4000, precision="fp32"), -12),
    # 3 frames of 60x90 at min_pixels 3,136: 2 temporal patches of 2 x 3 merged patches; peak in AdamW's step
    (QWEN25, dict(batch=1, video_frames=3, image_size="60x90", min_pixels=3136, precision="fp32"), -12),
    # 4 frames, 2 examples: peak in the forward/loss, Qwen2-VL's two QuickGELU scalars
    (QWEN2, dict(batch=2, video_frames=4, image_size="60x90", min_pixels=3136, precision="fp32"), -16),
], ids=["qwen2-vl-max-pixels", "qwen2.5-vl-video", "qwen2-vl-video"])
def test_estimate_matches_real_cpu_peak(ref, kw, gap):
    assert _gap(ref, **kw) == gap


def test_refused_where_the_processor_has_no_such_rule():
    """LLaVA's processors resize to fixed tiles and take no video: exit 2 (MemestError), naming the flag."""
    for ref, kw, flag in [("hf:llava-tiny", dict(images=1, max_pixels=4000), "--max-pixels"),
                          ("hf:llava-next-tiny", dict(video_frames=4), "--video-frames")]:
        spec = RunSpec(model=model_ref(ref), batch=1, seq=16, target="cpu", **kw)
        with pytest.raises(MemestError, match=f"{flag}: a llava") as err:
            trace_step(load_source(spec.model), spec)
        assert err.value.exit_code == 2
    with pytest.raises(MemestError, match="--images N or --video-frames F"):
        RunSpec(model="hf:llama-tiny", max_pixels=4000)
    with pytest.raises(MemestError, match="above --max-pixels"):
        RunSpec(model="hf:llama-tiny", images=1, min_pixels=5000, max_pixels=4000)
    with pytest.raises(MemestError, match="--video-frames must be 0"):
        RunSpec(model="hf:llama-tiny", video_frames=-1)


def test_report_says_what_the_video_costs():
    from memest.estimator import estimate
    from memest.report.summary import summary_rows

    spec = RunSpec(model=model_ref(QWEN2), batch=2, seq=16, target="cpu", video_frames=3, image_size="60x90",
                   min_pixels=3136)
    report = estimate(spec).report
    im = report.to_dict()["images"]
    assert im["per_example"] == 0 and im["image_tokens"] == 0
    assert im["video"]["grid_thw"] == [2, 4, 6] and im["video"]["tokens_per_video"] == 12 and im["video_tokens"] == 24
    rows = [row.text for row in summary_rows(report) if row.label in ("images", "video")]
    assert rows == [f"3 frames of 60x90 per example -> 56x84, 2 temporal patches, 12 tokens each; 24 video tokens in "
                    f"the batch ({im['video']['processor']})"]


def test_advise_offers_lower_max_pixels_priced_by_its_trace():
    """advise's remedy for Qwen2-VL images: max_pixels a quarter of the resized image (448x448 -> 224x224: 256 ->
    64 tokens), re-traced like every remedy; none for LLaVA (fixed tiles) nor where min_pixels is above it."""
    from memest.plan.advise import _time_cost, candidates
    from memest.plan.runner import Runner

    runner = Runner(RunSpec(model=model_ref(QWEN2), batch=1, seq=16, target="cpu", images=1, image_size="448x448"))
    found = [c for c in candidates(runner) if "max_pixels" in c[1]]
    assert found == [("lower max_pixels to 50,176 (256 -> 64 image and video tokens per example)",
                      {"max_pixels": 50176}, 0.9)]
    lower = runner.run(max_pixels=50176)
    assert lower.needed_bytes < runner.run().needed_bytes
    cost = _time_cost(found[0][0], found[0][1], lower, runner.base)
    assert cost.startswith("fewer image tokens, lower resolution: 64 tokens per image (448x448 resized to 224x224)")
    video = Runner(RunSpec(model=model_ref(QWEN2), batch=1, seq=16, target="cpu", video_frames=4, image_size="448x448"))
    assert [c[1] for c in candidates(video) if "max_pixels" in c[1]] == [{"max_pixels": 50176}]
    floor = Runner(RunSpec(model=model_ref(QWEN2), batch=1, seq=16, target="cpu", images=1, image_size="448x448",
                           min_pixels=60000))
    assert not [c for c in candidates(floor) if "max_pixels" in c[1]]
    llava = Runner(RunSpec(model=model_ref("hf:llava-tiny"), batch=1, seq=16, target="cpu", images=1))
    assert not [c for c in candidates(llava) if "max_pixels" in c[1]]


# LLaMA-Factory's keys for Qwen2-VL (src/llamafactory/model/model_utils/visual.py at ff6d4d12, COMPOSITE_MODELS):
# vision_model_keys and projector_keys, matched as substrings of parameter names (get_forbidden_modules)
LLAMAFACTORY_QWEN2_VL = ("visual.patch_embed", "visual.blocks", "visual.merger")


def test_freeze_vision_projector_is_llamafactorys_forbidden_modules():
    """--freeze vision,projector freezes the parameters LLaMA-Factory's full fine-tuning leaves untrained with its
    defaults (freeze_vision_tower and freeze_multi_modal_projector true), on the real model; 'vision' alone leaves
    the merger trained; on a model without a tower the group is refused, naming the models it applies to."""
    from memest.features.finetune import apply_freeze

    model = load_source(model_ref(QWEN2)).build_model()
    apply_freeze(model, ["vision", "projector"], "test")
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    assert frozen == {name for name, _ in model.named_parameters() if any(k in name for k in LLAMAFACTORY_QWEN2_VL)}
    assert frozen and all(name.startswith("model.visual.") for name in frozen)
    model = load_source(model_ref(QWEN2)).build_model()
    apply_freeze(model, ["vision"], "test")
    assert {n for n, p in model.named_parameters() if p.requires_grad and n.startswith("model.visual.")} == {
        n for n, _ in model.named_parameters() if "visual.merger" in n}
    llama = load_source(model_ref("hf:llama-tiny")).build_model()
    with pytest.raises(MemestError, match="'vision' matches no parameter.*qwen2_vl"):
        apply_freeze(llama, ["vision"], "test")


@pytest.mark.parametrize("ref,kw,gap", [
    # tower and merger frozen at the model's input: nothing in them is saved for backward, QuickGELU's scalars
    # neither; the peak in the forward: to the byte
    (QWEN2, dict(batch=2, images=2, image_size="60x90", freeze="vision,projector", precision="fp32"), 0),
    # the tower frozen, its merger trained (its inputs saved); the peak in AdamW's step: its -12 B
    (QWEN25, dict(batch=1, video_frames=4, image_size="60x90", min_pixels=3136, freeze="vision",
                  precision="bf16-mixed"), -12),
], ids=["qwen2-vl-tower-and-projector-frozen", "qwen2.5-vl-video-tower-frozen"])
def test_frozen_tower_matches_real_cpu_peak(ref, kw, gap):
    assert _gap(ref, **kw) == gap


def test_llamafactory_vision_defaults(tmp_path):
    """LLaMA-Factory on a vision-language template: full fine-tuning freezes the tower and projector by default
    (freeze: vision,projector), a key set false trains that part; LoRA keeps them out of its targets (exclude:),
    the projector out of lora_target all whatever its key says; a text template
    leaves the keys without effect."""
    import yaml

    from memest.spec.trainers.load import read_trainer_config

    def read(**keys):
        path = tmp_path / "qwen2vl_full_sft.yaml"
        path.write_text(yaml.safe_dump({"model_name_or_path": str(CONFIGS / "qwen2-vl-tiny.json"), "stage": "sft",
                                        "finetuning_type": "full", "template": "qwen2_vl", "bf16": True, **keys}))
        return read_trainer_config(path)

    full = read()
    assert full.keys["freeze"] == "vision,projector" and not full.unknown
    assert any("casts only the trainable parameters to fp32" in note for note in full.notes)
    assert read(freeze_vision_tower=False).keys["freeze"] == "projector"
    assert "freeze" not in read(freeze_vision_tower=False, freeze_multi_modal_projector=False).keys
    lora = read(finetuning_type="lora")
    assert "freeze" not in lora.keys and lora.keys["lora"] == {"targets": "all-linear", "exclude": ["vision", "projector"]}
    assert read(finetuning_type="lora", freeze_vision_tower=False).keys["lora"]["exclude"] == ["projector"]
    text = read(template="llama3", freeze_vision_tower=True)
    assert "freeze" not in text.keys and ("freeze_vision_tower = True", "no effect: template 'llama3' is not a "
                                          "vision-language one memest builds inputs for") in text.mapping

"""Vision-language fine-tuning as LLaMA-Factory runs it. LoRA: its frozen vision tower (and projector) left out of
the targets (--lora exclude=vision,projector, read from a LLaMA-Factory YAML by --from), against peft's
get_peft_model given the module list LLaMA-Factory's own rule makes, one real CPU step on the tiny Qwen2-VL.

The byte-exact peak comparison (real_cpu_peak) skips on CPUs without AVX-512 (the Conv3d patch embedding's oneDNN
scratch); the trainable parameters, the gradients and the AdamW state do not depend on conv scratch and are compared
here on any CPU: the trace's storages of those categories against the real model's after a real step.

Images: image_min/max_pixels (and video_*) resize each image before the processor (--pre-resize, read by --from);
the image tokens memest uses against LLaMA-Factory's resize of a real PIL image fed to transformers' Qwen2-VL
image processor.
"""

import pytest
import torch
import yaml

from memest.features.registry import trace_step
from memest.sources import load_source
from memest.spec import RunSpec
from memest.spec.trainers.load import read_trainer_config
from memest.trace.events import Category

from .conftest import CONFIGS, model_ref, real_cpu_peak

QWEN2 = "hf:qwen2-vl-tiny"
# hiyouga/LLaMA-Factory at ff6d4d12eeb035d6ce06805a5733dd7b29f2ac30, src/llamafactory/model/model_utils/visual.py
# _register_composite_model(model_type="qwen2_vl", ...)
VISION, PROJECTOR, CONFLICT = ("visual.patch_embed", "visual.blocks"), ("visual.merger",), ("patch_embed",)


def llamafactory_targets(model, lora_target: list[str], freeze_vision_tower: bool, freeze_projector: bool) -> list[str]:
    """LLaMA-Factory's LoRA target_modules for a Qwen2-VL, its rule restated: adapter.py _setup_lora_tuning calls
    misc.py find_all_linear_modules for ``all`` (last names of Linear modules outside lm_head, the projector keys
    and, with freeze_vision_tower, the vision keys), then visual.py patch_target_modules (every module whose name
    holds a target as a substring and no forbidden key: get_forbidden_modules plus lora_conflict_keys)."""
    if lora_target == ["all"]:
        forbidden = {"lm_head", *PROJECTOR, *(VISION if freeze_vision_tower else ())}
        lora_target = sorted({name.split(".")[-1] for name, module in model.named_modules()
                              if not any(f in name for f in forbidden)
                              and "Linear" in type(module).__name__ and "Embedding" not in type(module).__name__})
    forbidden = {*(VISION if freeze_vision_tower else ()), *(PROJECTOR if freeze_projector else ()), *CONFLICT}
    return [name for name, _ in model.named_modules()
            if any(t in name for t in lora_target) and not any(f in name for f in forbidden)]


def _memest_lora(tmp_path, **keys):
    path = tmp_path / "qwen2vl_lora_sft.yaml"
    path.write_text(yaml.safe_dump({"model_name_or_path": str(CONFIGS / "qwen2-vl-tiny.json"), "stage": "sft",
                                    "finetuning_type": "lora", "template": "qwen2_vl", "lora_rank": 4, **keys}))
    return read_trainer_config(path).keys["lora"]


def _real_step(spec, source, targets):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = get_peft_model(source.build_model(), LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    trainable = {name.removeprefix("base_model.model."): p.nbytes for name, p in model.named_parameters()
                 if p.requires_grad}
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    model(**source.image_inputs(spec.batch, spec.seq, spec.images, (60, 90))).loss.backward()
    optim.step()
    grads = sum(p.grad.nbytes for p in model.parameters() if p.grad is not None)
    state = sum(t.nbytes for s in optim.state.values() for t in s.values() if torch.is_tensor(t))
    return trainable, grads, state


@pytest.mark.parametrize("keys,frozen", [
    ({}, (True, True)),  # LLaMA-Factory's defaults: lora_target all, tower and projector frozen
    ({"freeze_vision_tower": False}, (False, True)),  # the tower's own linears adapted, the merger not
    # named targets (whole last names: LLaMA-Factory's substring match and peft's suffix match agree on them); the
    # merger's first Linear adapted only when the projector is not frozen
    ({"lora_target": "qkv,q_proj,v_proj,mlp.0", "freeze_vision_tower": False,
      "freeze_multi_modal_projector": False}, (False, False)),
    ({"lora_target": "qkv,q_proj,v_proj,mlp.0", "freeze_vision_tower": False}, (False, True)),
], ids=["defaults", "tower-trained", "named-projector-trained", "named-projector-frozen"])
def test_lora_targets_and_state_are_llamafactorys(tmp_path, keys, frozen):
    lora = _memest_lora(tmp_path, **keys)
    spec = RunSpec(model=model_ref(QWEN2), batch=1, seq=8, images=1, image_size="60x90", optim="adamw",
                   target="cpu", precision="fp32", lora=lora)
    source = load_source(spec.model)
    lf = llamafactory_targets(source.build_model(), [t.strip() for t in keys.get("lora_target", "all").split(",")],
                              *frozen)
    trainable, grads, state = _real_step(spec, source, lf)
    trace = trace_step(source, spec)
    last = spec.iterations
    traced = {c: sum(r.nbytes for r in trace.storages if r.category is c and (r.iteration == last or c is
                                                                                  Category.OPTIMIZER_STATE))
              for c in (Category.GRADIENTS, Category.OPTIMIZER_STATE)}
    assert trace.trainable_count * 4 == sum(trainable.values())
    assert traced[Category.GRADIENTS] == grads and traced[Category.OPTIMIZER_STATE] == state
    if frozen[0]:
        assert not any(".visual." in name for name in trainable)


def test_lora_exclude_peak_equals_real_cpu_peak(tmp_path):
    """The whole step with the tower left out of LoRA, to the byte (skips on CPUs without AVX-512). Was 3,576 B low
    on an AMX Xeon while memest left 3d convolutions out: the Conv3d patch embedding's oneDNN reorders and blocked
    outputs (targets/cpu/onednn_conv.py's 5d rules) now priced."""
    spec = RunSpec(model=model_ref(QWEN2), batch=1, seq=8, images=1, image_size="60x90", optim="adamw",
                   target="cpu", precision="fp32", lora=_memest_lora(tmp_path))
    source = load_source(spec.model)
    real = real_cpu_peak(source, spec)
    assert trace_step(source, spec).peak()[0] == real


def test_lora_exclude_parses_and_names_modules():
    """exclude= is a list key like targets= (the string, a mapping and the canonical text agree); vision / projector
    expand to --freeze's parts, anything else must name a module of the model."""
    from memest.errors import MemestError
    from memest.features.finetune import lora_exclusion
    from memest.spec.lora import lora_settings, parse_lora

    text = parse_lora("r=4,exclude=vision,projector,targets=q_proj,v_proj")
    assert text == parse_lora({"r": 4, "targets": ["q_proj", "v_proj"], "exclude_modules": ["vision", "projector"]})
    assert lora_settings(text).exclude == ("vision", "projector")
    model = load_source(model_ref(QWEN2)).build_model()
    assert lora_exclusion(model, ("vision", "lm_head"), "test") == \
        r"(?:model\.visual\.patch_embed|model\.visual\.blocks|lm_head)(?:\..*)?"
    with pytest.raises(MemestError, match="exclude=model.tower names no module"):
        lora_exclusion(model, ("model.tower",), "test")


def _lf_preprocess_image(image, image_max_pixels: int, image_min_pixels: int):
    """LLaMA-Factory's Qwen2VLPlugin._preprocess_image on a PIL image, transcribed (LLaMA-Factory cannot be installed
    here): MMPluginMixin._preprocess_image's resize (src/llamafactory/data/mm_plugin.py lines 218-235 at ff6d4d12),
    then the plugin's own rules (lines 2261-2275): a side under 28 px raised to 28, an aspect ratio over 200 cut
    to 180."""
    import math

    if (image.width * image.height) > image_max_pixels:
        resize_factor = math.sqrt(image_max_pixels / (image.width * image.height))
        image = image.resize((int(image.width * resize_factor), int(image.height * resize_factor)))
    if (image.width * image.height) < image_min_pixels:
        resize_factor = math.sqrt(image_min_pixels / (image.width * image.height))
        image = image.resize((int(image.width * resize_factor), int(image.height * resize_factor)))
    if min(image.width, image.height) < 28:
        image = image.resize((max(image.width, 28), max(image.height, 28)))
    if image.width / image.height > 200:
        image = image.resize((image.height * 180, image.height))
    if image.height / image.width > 200:
        image = image.resize((image.width, image.width * 180))
    return image


@pytest.mark.parametrize("hw,keys", [
    ((1080, 1920), {}),  # LLaMA-Factory's default image_max_pixels 768 * 768: 576 x 1024
    ((3000, 4000), {"image_max_pixels": 512 * 512}),
    ((30, 30), {}),  # under the default image_min_pixels 32 * 32: scaled up to 32 x 32
    ((700, 500), {"image_max_pixels": 1 << 30, "image_min_pixels": 0}),  # not resized
    ((20, 1000), {}),  # Qwen2VLPlugin: a side under 28 px raised to 28
    ((30, 9000), {}),  # Qwen2VLPlugin: width / height 300 > 200, cut to 180 (smart_resize would refuse 300)
    ((9000, 30), {}),  # the same, standing
])
def test_llamafactory_image_pixels_give_the_processors_tokens(tmp_path, hw, keys):
    PIL = pytest.importorskip("PIL.Image")
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    path = tmp_path / "qwen2vl_lora_sft.yaml"
    path.write_text(yaml.safe_dump({"model_name_or_path": str(CONFIGS / "qwen2-vl-tiny.json"), "stage": "sft",
                                    "finetuning_type": "lora", "template": "qwen2_vl", **keys}))
    pre_resize = read_trainer_config(path).keys["pre_resize"]
    spec = RunSpec(model=model_ref(QWEN2), batch=1, seq=8, images=1, image_size=f"{hw[0]}x{hw[1]}",
                   pre_resize=pre_resize)
    source = load_source(spec.model)
    image = _lf_preprocess_image(PIL.new("RGB", (hw[1], hw[0])), keys.get("image_max_pixels", 768 * 768),
                                 keys.get("image_min_pixels", 32 * 32))
    facts = source.image_facts(1, spec.input_hw, **spec.vision_options)
    assert facts["size"] == f"{image.height}x{image.width}"
    real = Qwen2VLImageProcessorPil()(images=[image], return_tensors="pt")
    tokens = int(real["image_grid_thw"][0].prod()) // 4
    assert facts["tokens_per_image"] == tokens
    inputs = source.image_inputs(1, 8, 1, spec.input_hw, **spec.vision_options)
    assert (inputs["input_ids"] == source.build_model().config.image_token_id).sum() == tokens


def test_pre_resize_video_frames_and_one_size():
    """Frames take the video bounds; images and frames resized apart to different sizes are refused (one
    --image-size for both); a malformed value names the form."""
    from memest.errors import MemestError

    video = RunSpec(model=model_ref(QWEN2), video_frames=4, image_size="448x448", pre_resize="video=256:65536")
    assert video.input_hw == (256, 256)
    with pytest.raises(MemestError, match="one size for both"):
        RunSpec(model=model_ref(QWEN2), images=1, video_frames=4, image_size="448x448",
                pre_resize="image=1024:589824,video=256:65536")
    with pytest.raises(MemestError, match="image=MIN:MAX"):
        RunSpec(model=model_ref(QWEN2), images=1, image_size="448x448", pre_resize="image=5")

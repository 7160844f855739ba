"""LLaMA-Factory YAML configs (hiyouga/LLaMA-Factory: examples/train_lora/llama3_lora_sft.yaml,
examples/train_qlora/, src/llamafactory/hparams/). What LLaMA-Factory does with a key, where it matters:

- ``bf16: true``: the model is loaded in bf16 (its compute_dtype), and trainable parameters are cast to fp32
  unless ``pure_bf16`` or a quantized base (src/llamafactory/model/adapter.py, cast_trainable_params_to_fp32):
  full fine-tuning is fp32 weights under bf16 autocast (memest ``bf16-mixed``); LoRA keeps a bf16 base with fp32
  adapters (memest ``bf16``: peft's get_peft_model upcasts the adapters to fp32 by default, autocast_adapter_dtype,
  so memest's trace holds them in fp32 too).
- ``quantization_bit: 4|8``: bitsandbytes nf4 / int8 base (src/llamafactory/model/model_utils/quantization.py).
- ``lora_target: all``: every linear layer but the head (peft's all-linear).
- ``enable_liger_kernel: true``: Liger's kernels on trainable models (src/llamafactory/model/model_utils/
  liger_kernel.py, hiyouga/LLaMA-Factory at ff6d4d12eeb035d6ce06805a5733dd7b29f2ac30): for ``stage`` pt and sft
  Liger's defaults, so its fused linear cross entropy (memest ``loss_head: fused``); other stages need logits
  (loader.py ``require_logits``) and get Liger's non-fused cross entropy, but memest refuses those stages (``stage``).
- ``freeze_vision_tower`` and ``freeze_multi_modal_projector`` (both default true, hparams/finetuning_args.py) on a
  vision-language ``template`` (qwen2_vl, llava, llava_next*): full fine-tuning leaves the tower's and the
  projector's parameters untrained (model/adapter.py _setup_full_tuning, model_utils/visual.py
  get_forbidden_modules): memest ``freeze: vision,projector``; LoRA leaves them out of the targets
  (patch_target_modules: every module whose name holds a target and no forbidden key): memest ``lora: exclude=``
  the frozen parts; ``lora_target: all`` leaves the projector out whatever freeze_multi_modal_projector says
  (model_utils/misc.py find_all_linear_modules adds projector_keys to its forbidden modules), and Qwen2-VL's
  ``patch_embed`` is out of LoRA always (its lora_conflict_keys).
- ``image_max_pixels`` / ``image_min_pixels`` (default 768 * 768 / 32 * 32) and ``video_max_pixels`` /
  ``video_min_pixels`` (256 * 256 / 16 * 16, hparams/model_args.py) resize each image and frame before the processor
  (data/mm_plugin.py _preprocess_image): memest ``pre_resize``. ``video_fps`` / ``video_maxlen`` pick the frames from
  the video's length, which no config holds: memest's ``video_frames`` is given on the command line (a note).
- ``lora_target`` defaults to ``all`` (hparams/finetuning_args.py): memest ``targets=all-linear``.
"""

from __future__ import annotations

from pathlib import Path

from memest.errors import MemestError
from memest.spec.trainers import common
from memest.spec.trainers.base import TrainerConfig

FORMAT = "llamafactory"
_NO_EFFECT = {
    "do_train", "dataset", "dataset_dir", "template", "overwrite_cache", "preprocessing_num_workers",
    "dataloader_num_workers", "output_dir", "logging_steps", "save_steps", "plot_loss", "overwrite_output_dir",
    "save_only_model", "report_to", "learning_rate", "num_train_epochs", "lr_scheduler_type", "warmup_ratio",
    "warmup_steps", "ddp_timeout", "resume_from_checkpoint", "val_size", "per_device_eval_batch_size",
    "eval_strategy", "eval_steps", "max_samples", "trust_remote_code", "weight_decay", "seed",
}


def detect(path: Path, data) -> bool:
    return isinstance(data, dict) and Path(path).suffix in (".yml", ".yaml") and "model_name_or_path" in data and \
        ("finetuning_type" in data or "cutoff_len" in data)


_SIMPLE = {"per_device_train_batch_size": "batch", "cutoff_len": "seq", "gradient_accumulation_steps": "grad_accum"}
_LORA = {"lora_rank": "r", "lora_alpha": "alpha", "lora_dropout": "dropout"}
_KINDS = {"lora": "peft LoRA", "full": "every parameter trained", "freeze": "the last layers trained"}


def read(path: Path, data: dict) -> TrainerConfig:
    out = TrainerConfig(format=FORMAT, path=str(path))
    kind = data.get("finetuning_type", "lora")  # LLaMA-Factory's default (hparams/finetuning_args.py)
    if kind not in _KINDS:
        raise MemestError(f"{path}: finetuning_type = {kind!r}: memest reads lora, full and freeze")
    common.one_half(data, path)
    lora = common.read_keys(out, data, path, _TABLE)
    _finish(out, data, kind, lora)
    return out


def _stage(out, key, value, path, data, lora) -> None:
    # sft and pt train the one model on next-token loss, the step memest traces; rm, ppo, dpo and kto run other
    # steps (a value head, a reward and a reference model, pairs of sequences: src/llamafactory/train/)
    if value not in ("sft", "pt"):
        raise MemestError(f"{path}: stage = {value!r}: memest reads LLaMA-Factory's sft and pt stages (one model, "
                          "next-token loss); for DPO pass the model and --preference dpo instead of --from")
    out.mapping.append((f"{key} = {value}", "one model trained on next-token loss"))


def _quant(out, key, value, path, data, lora) -> None:
    if value not in (4, 8):
        raise MemestError(f"{path}: quantization_bit = {value!r}: memest models 4 (nf4) and 8 (int8)")
    out.keys["quant"] = "nf4" if value == 4 else "int8"
    out.mapping.append((f"{key} = {value}", f"quant: {out.keys['quant']}"))


def _half(out, key, value, path, data, lora) -> None:
    if common.switch(value, path, key):
        mixed = data.get("finetuning_type", "lora") == "full" and not data.get("pure_bf16")
        out.keys["precision"] = f"{key}-mixed" if mixed else key
        out.mapping.append((f"{key} = {value}", f"precision: {out.keys['precision']}"))
    else:
        out.mapping.append((f"{key} = {value}", f"not {key}"))


def _checkpointing(out, key, value, path, data, lora) -> None:
    on = common.switch(value, path, key) if key == "gradient_checkpointing" else not common.switch(value, path, key)
    out.mapping.append((f"{key} = {value}", "checkpointing: blocks" if on else "checkpointing: none"))


def _target(out, key, value, path, data, lora) -> None:
    lora["targets"] = common.lora_targets(value, f"{path}: {key}: ")
    out.mapping.append((f"{key} = {value}", f"lora targets: {lora['targets']}"))


# LLaMA-Factory's defaults (src/llamafactory/hparams/model_args.py at ff6d4d12eeb035d6ce06805a5733dd7b29f2ac30)
_PIXELS = {"image_min_pixels": 32 * 32, "image_max_pixels": 768 * 768, "video_min_pixels": 16 * 16,
           "video_max_pixels": 256 * 256}
_VIDEO_SAMPLING = {"video_fps": 2.0, "video_maxlen": 128}


def _pre_resize(out: TrainerConfig, data: dict) -> None:
    """image_* / video_*_pixels: the resize before the processor (data/mm_plugin.py _preprocess_image), on a
    vision-language template; video_fps / video_maxlen: frames from a video's length, not in the file."""
    if not _vision_template(data):
        for key in (*_PIXELS, *_VIDEO_SAMPLING):
            if key in data:
                out.mapping.append((f"{key} = {data[key]}", f"no effect: template {data.get('template')!r} is not a "
                                                            "vision-language one memest builds inputs for"))
        return
    values = {}
    for key, default in _PIXELS.items():
        value = data.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise MemestError(f"{out.path}: {key} = {value!r}: a number of pixels")
        values[key] = value
    out.keys["pre_resize"] = (f"image={values['image_min_pixels']}:{values['image_max_pixels']},"
                              f"video={values['video_min_pixels']}:{values['video_max_pixels']}")
    given = [f"{key} = {data[key]}" for key in _PIXELS if key in data]
    out.mapping.append((", ".join(given) or "(image_/video_min/max_pixels not set)",
                        f"pre_resize: {out.keys['pre_resize']} (each --image-size image or frame resized before the "
                        "processor, mm_plugin.py _preprocess_image" + ("" if given else "; LLaMA-Factory's defaults") + ")"))
    sampling = {key: data.get(key, default) for key, default in _VIDEO_SAMPLING.items()}
    out.notes.append(f"video_fps = {sampling['video_fps']}, video_maxlen = {sampling['video_maxlen']}: LLaMA-Factory "
                     "samples min(frames, video_maxlen, floor(seconds x video_fps)) frames of each video "
                     "(mm_plugin.py _get_video_sample_indices); a video's length is not in the file: pass "
                     f"--video-frames (at most {sampling['video_maxlen']})")


_HANDLERS = {
    "lora_target": _target,
    "model_name_or_path": lambda out, key, value, path, data, lora: common.model(out, key, value, path),
    "optim": lambda out, key, value, path, data, lora: common.optimizer(out, key, value),
    "deepspeed": lambda out, key, value, path, data, lora: common.deepspeed(out, key, value, path),
    "finetuning_type": lambda out, key, value, path, data, lora: out.mapping.append((f"{key} = {value}", _KINDS[value])),
    "stage": _stage, "quantization_bit": _quant, "bf16": _half, "fp16": _half,
    "gradient_checkpointing": _checkpointing, "disable_gradient_checkpointing": _checkpointing,
    "enable_liger_kernel": lambda out, key, value, path, data, lora: _liger(out, key, value, data),
    "freeze_vision_tower": lambda out, key, value, path, data, lora: _vision_key(out, key, value, data),
    "freeze_multi_modal_projector": lambda out, key, value, path, data, lora: _vision_key(out, key, value, data),
    **{key: lambda out, key, value, path, data, lora: None for key in (*_PIXELS, *_VIDEO_SAMPLING)},  # _pre_resize
    "pure_bf16": lambda out, key, value, path, data, lora: out.mapping.append(
        (f"{key} = {value}", "trainable parameters kept in bf16" if value else "trainable parameters in fp32")),
}


# LLaMA-Factory's templates with an image plugin for the models memest builds image inputs for (src/llamafactory/data/
# template.py: qwen2_vl (Qwen2-VL and Qwen2.5-VL), llava, llava_next, llava_next_llama3, llava_next_mistral, ...)
def _vision_template(data: dict) -> bool:
    template = str(data.get("template", ""))
    return template in ("qwen2_vl", "llava") or template.startswith("llava_next")


_VISION_PARTS = {"freeze_vision_tower": "vision", "freeze_multi_modal_projector": "projector"}


def _vision_key(out: TrainerConfig, key: str, value, data: dict) -> None:
    if not _vision_template(data):
        out.mapping.append((f"{key} = {value}", f"no effect: template {data.get('template')!r} is not a vision-language "
                                                "one memest builds inputs for"))
        return
    frozen = common.switch(value, out.path, key)
    out.mapping.append((f"{key} = {value}", f"{_freezing(data)} {_VISION_PARTS[key]}" if frozen
                        else f"{_VISION_PARTS[key]} trained"))


def _freezing(data: dict) -> str:
    """How a frozen part is said: LoRA keeps adapters out of it (patch_target_modules), full fine-tuning freezes it."""
    return "lora exclude:" if data.get("finetuning_type", "lora") == "lora" else "--freeze"


def _vision_freeze(out: TrainerConfig, data: dict, kind: str) -> None:
    """freeze_vision_tower / freeze_multi_modal_projector (default true) on a vision-language template."""
    if not _vision_template(data):
        return
    parts = [part for key, part in _VISION_PARTS.items() if data.get(key, True) is not False]  # switch() checked it
    for key, part in _VISION_PARTS.items():
        if key not in data and part in parts:
            out.mapping.append((f"({key} not set)", f"{_freezing(data)} {part} (LLaMA-Factory's default: true)"))
    if kind == "lora":
        _lora_exclusion(out, data, parts)
    if not parts:
        return
    if kind == "full":
        out.keys["freeze"] = ",".join(parts)
        if out.keys.get("precision") == "bf16-mixed":
            out.notes.append("LLaMA-Factory casts only the trainable parameters to fp32 (adapter.py _setup_full_tuning): "
                             f"the frozen {' and '.join(parts)} stay in bf16, which memest's bf16-mixed holds in fp32 "
                             "(their weights counted at twice their bytes)")


def _lora_exclusion(out: TrainerConfig, data: dict, parts: list[str]) -> None:
    """LoRA on a vision-language template: the frozen parts out of the targets (patch_target_modules), the projector
    out of ``all`` too (find_all_linear_modules), and Qwen2-VL's patch_embed out always (lora_conflict_keys)."""
    lora = out.keys["lora"] if isinstance(out.keys.get("lora"), dict) else {}
    exclude = list(parts)
    if lora.get("targets") == "all-linear" and "projector" not in exclude:
        exclude.append("projector")
        out.mapping.append(("lora_target = all", "lora exclude: projector (find_all_linear_modules leaves the "
                                                 "projector_keys out whatever freeze_multi_modal_projector says)"))
    if data.get("template") == "qwen2_vl" and "vision" not in exclude and lora.get("targets") != "all-linear":
        exclude.append("model.visual.patch_embed")  # its Conv3d proj: peft would adapt it for a target named proj
        out.mapping.append(("template = qwen2_vl", "lora exclude: model.visual.patch_embed (COMPOSITE_MODELS' "
                                                   "lora_conflict_keys)"))
    if exclude:
        out.keys["lora"] = {**lora, "exclude": exclude}
    if isinstance(lora.get("targets"), list):
        out.notes.append("LLaMA-Factory matches lora_target names as substrings of module names on vision-language "
                         "models (patch_target_modules: proj also adapts q_proj, o_proj, ...); memest, as peft, matches "
                         "whole last names: the two agree where each target is a module's whole last name")


def _liger(out: TrainerConfig, key: str, value, data: dict) -> None:
    # stages other than pt/sft (which need logits: Liger's fused head off) are refused by _stage
    if common.switch(value, out.path, key):
        out.keys["loss_head"] = "fused"
        out.mapping.append((f"{key} = {value}", f"loss_head: fused (stage {data.get('stage', 'sft')}: Liger's fused "
                                                "linear cross entropy, for the model types Liger patches)"))
    else:
        out.mapping.append((f"{key} = {value}", "loss head: the model's own"))


_TABLE = common.KeyTable(_SIMPLE, _LORA, _HANDLERS, _NO_EFFECT)


def _finish(out: TrainerConfig, data: dict, kind: str, lora: dict) -> None:
    keys = out.keys
    # LLaMA-Factory turns gradient checkpointing on unless disable_gradient_checkpointing
    # (src/llamafactory/model/model_utils/checkpointing.py, prepare_model_for_training)
    if not data.get("disable_gradient_checkpointing") and data.get("gradient_checkpointing", True) is not False:
        keys["checkpointing"] = "blocks"
        if "disable_gradient_checkpointing" not in data and "gradient_checkpointing" not in data:
            out.mapping.append(("(disable_gradient_checkpointing not set)",
                                "checkpointing: blocks (LLaMA-Factory's default: on)"))
    if "optim" not in keys:  # TrainingArguments' default optim (transformers/training_args.py): adamw_torch
        keys["optim"] = "adamw"
        out.mapping.append(("(optim not set)", "optim: adamw (TrainingArguments' default adamw_torch)"))
    if kind == "lora":
        if "targets" not in lora:  # LLaMA-Factory's default lora_target: all (hparams/finetuning_args.py)
            lora["targets"] = "all-linear"
            out.mapping.append(("(lora_target not set)", "lora targets: all-linear (LLaMA-Factory's default: all)"))
        keys["lora"] = lora
        if keys.get("quant"):
            keys["prepare_kbit"] = True
            out.notes.append("a quantized base: LLaMA-Factory calls peft's prepare_model_for_kbit_training "
                             "(src/llamafactory/model/adapter.py): prepare_kbit: true")
    elif lora:
        out.notes.append(f"lora_* keys with finetuning_type: {kind}: not LoRA, ignored by LLaMA-Factory and memest")
    _vision_freeze(out, data, kind)
    _pre_resize(out, data)
    if kind == "freeze":
        out.unknown.append("finetuning_type = freeze (which layers: set --freeze by name)")
    if keys.get("precision") == "bf16" and kind == "lora" and not data.get("pure_bf16"):
        out.notes.append("LLaMA-Factory casts the LoRA adapters to fp32 (cast_trainable_params_to_fp32); memest "
                         "traces them in fp32 too (peft's get_peft_model default, autocast_adapter_dtype=True)")
    out.notes.append("world size: the launcher's (llamafactory-cli/torchrun), not in the file; pass --world-size")

"""LLaMA-Factory YAML configs (hiyouga/LLaMA-Factory: examples/train_lora/llama3_lora_sft.yaml,
examples/train_qlora/, src/llamafactory/hparams/). What LLaMA-Factory does with a key, where it matters:

- ``bf16: true``: the model is loaded in bf16 (its compute_dtype), and trainable parameters are cast to fp32
  unless ``pure_bf16`` or a quantized base (src/llamafactory/model/adapter.py, cast_trainable_params_to_fp32):
  full fine-tuning is fp32 weights under bf16 autocast (memest ``bf16-mixed``); LoRA keeps a bf16 base with fp32
  adapters (memest ``bf16``: peft's get_peft_model upcasts the adapters to fp32 by default, autocast_adapter_dtype,
  so memest's trace holds them in fp32 too).
- ``quantization_bit: 4|8``: bitsandbytes nf4 / int8 base (src/llamafactory/model/model_utils/quantization.py).
- ``lora_target: all``: every linear layer but the head (peft's all-linear).
"""

from __future__ import annotations

from pathlib import Path

from memest.errors import MemestError
from memest.spec.trainers import common
from memest.spec.trainers.base import TrainerConfig

FORMAT = "llamafactory"
_NO_EFFECT = {
    "stage", "do_train", "dataset", "dataset_dir", "template", "overwrite_cache", "preprocessing_num_workers",
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
    lora: dict = {}
    kind = data.get("finetuning_type", "lora")  # LLaMA-Factory's default (hparams/finetuning_args.py)
    if kind not in _KINDS:
        raise MemestError(f"{path}: finetuning_type = {kind!r}: memest reads lora, full and freeze")
    for key, value in data.items():
        said = f"{key} = {value}"
        if value is None:  # `key:` with no value: the trainer's default
            out.mapping.append((f"{key} (empty)", "the trainer's default"))
        elif key in _SIMPLE:
            out.keys[_SIMPLE[key]] = value
            out.mapping.append((said, f"{_SIMPLE[key]}: {value}"))
        elif key in _LORA:
            lora[_LORA[key]] = value
            out.mapping.append((said, f"lora {_LORA[key]}: {value}"))
        elif key in _HANDLERS:
            _HANDLERS[key](out, key, value, path, data)
        elif key == "lora_target":
            lora["targets"] = common.lora_targets(value)
            out.mapping.append((said, f"lora targets: {lora['targets']}"))
        elif key in _NO_EFFECT:
            out.mapping.append((key, "no effect on memory (not modelled)"))
        else:
            out.unknown.append(key)
    _finish(out, data, kind, lora)
    return out


def _quant(out, key, value, path, data) -> None:
    if value not in (4, 8):
        raise MemestError(f"{path}: quantization_bit = {value!r}: memest models 4 (nf4) and 8 (int8)")
    out.keys["quant"] = "nf4" if value == 4 else "int8"
    out.mapping.append((f"{key} = {value}", f"quant: {out.keys['quant']}"))


def _half(out, key, value, path, data) -> None:
    if value:
        mixed = data.get("finetuning_type", "lora") == "full" and not data.get("pure_bf16")
        out.keys["precision"] = f"{key}-mixed" if mixed else key
        out.mapping.append((f"{key} = {value}", f"precision: {out.keys['precision']}"))
    else:
        out.mapping.append((f"{key} = {value}", f"not {key}"))


def _checkpointing(out, key, value, path, data) -> None:
    on = bool(value) if key == "gradient_checkpointing" else not value
    out.mapping.append((f"{key} = {value}", "checkpointing: blocks" if on else "checkpointing: none"))


_HANDLERS = {
    "model_name_or_path": lambda out, key, value, path, data: common.model(out, key, value, path),
    "optim": lambda out, key, value, path, data: common.optimizer(out, key, value),
    "deepspeed": lambda out, key, value, path, data: common.deepspeed(out, key, value, path),
    "finetuning_type": lambda out, key, value, path, data: out.mapping.append((f"{key} = {value}", _KINDS[value])),
    "quantization_bit": _quant, "bf16": _half, "fp16": _half,
    "gradient_checkpointing": _checkpointing, "disable_gradient_checkpointing": _checkpointing,
    "pure_bf16": lambda out, key, value, path, data: out.mapping.append(
        (f"{key} = {value}", "trainable parameters kept in bf16" if value else "trainable parameters in fp32")),
}


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
        keys["lora"] = lora or True
        if keys.get("quant"):
            keys["prepare_kbit"] = True
            out.notes.append("a quantized base: LLaMA-Factory calls peft's prepare_model_for_kbit_training "
                             "(src/llamafactory/model/adapter.py): prepare_kbit: true")
    elif lora:
        out.notes.append(f"lora_* keys with finetuning_type: {kind}: not LoRA, ignored by LLaMA-Factory and memest")
    if kind == "freeze":
        out.unknown.append("finetuning_type = freeze (which layers: set --freeze by name)")
    if keys.get("precision") == "bf16" and kind == "lora" and not data.get("pure_bf16"):
        out.notes.append("LLaMA-Factory casts the LoRA adapters to fp32 (cast_trainable_params_to_fp32); memest "
                         "traces them in fp32 too (peft's get_peft_model default, autocast_adapter_dtype=True)")
    out.notes.append("world size: the launcher's (llamafactory-cli/torchrun), not in the file; pass --world-size")

"""axolotl YAML configs (https://docs.axolotl.ai/docs/config-reference.html; axolotl-ai-cloud/axolotl's
examples/ folder). What axolotl does with a key, where it matters to memory:

- ``bf16: true`` / ``fp16: true`` load the model in that dtype (src/axolotl/utils/config/__init__.py,
  normalize_config: ``if cfg.bf16 or cfg.bfloat16: cfg.torch_dtype = torch.bfloat16``; loaders/model.py passes it
  as from_pretrained's dtype), then TrainingArguments' autocast runs over 16-bit weights: memest's ``bf16``.
- ``sample_packing: true`` packs examples into rows of ``sequence_len`` tokens: the traced length is sequence_len.
- ``gradient_checkpointing: true``: transformers' per-decoder-layer checkpointing (memest ``blocks``).
- ``adapter: qlora`` / ``load_in_4bit``: bitsandbytes nf4 base, peft's prepare_model_for_kbit_training applied
  when loading in 4/8 bit with an adapter (src/axolotl/loaders/model.py).
- loss heads (axolotl-ai-cloud/axolotl at 067b021c8b87a9e5e380b9173c704cf7340e30f5; only one may be on,
  src/axolotl/utils/schemas/validation.py check_cross_entropy_conflicts): ``liger_fused_linear_cross_entropy``
  (LigerPlugin, src/axolotl/integrations/liger/args.py) is memest's ``fused``; ``chunked_cross_entropy`` with
  ``chunked_cross_entropy_num_chunks`` (default 8; src/axolotl/monkeypatch/loss/chunked.py, a copy of torchtune's
  CEWithChunkedOutputLoss over the whole logits' chunks) is ``chunked-output:N``; ``cut_cross_entropy``
  (Apple's Cut Cross-Entropy) and ``liger_cross_entropy`` are not modelled and listed as not understood.
"""

from __future__ import annotations

from pathlib import Path

from memest.errors import MemestError
from memest.spec.trainers import common
from memest.spec.trainers.base import TrainerConfig

FORMAT = "axolotl"
_MARKERS = ("base_model", "micro_batch_size", "sequence_len")
# keys with no effect on one step's memory (data, logging, schedule, saving)
_NO_EFFECT = {
    "base_model_config", "model_type", "tokenizer_type", "tokenizer_config", "trust_remote_code", "datasets",
    "dataset_prepared_path", "val_set_size", "output_dir", "num_epochs", "max_steps", "learning_rate",
    "lr_scheduler", "warmup_steps", "warmup_ratio", "weight_decay", "logging_steps", "saves_per_epoch",
    "evals_per_epoch", "save_steps", "eval_steps", "wandb_project", "wandb_entity", "wandb_watch", "wandb_name",
    "wandb_log_model", "special_tokens", "seed", "strict", "pad_to_sequence_len", "train_on_inputs",
    "group_by_length", "chat_template", "hub_model_id", "resume_from_checkpoint", "early_stopping_patience",
    "local_rank", "logging_dir", "debug", "eval_sample_packing", "lora_model_dir",
    "lora_fan_in_fan_out", "save_total_limit", "save_strategy", "eval_strategy",
}


def detect(path: Path, data) -> bool:
    return isinstance(data, dict) and Path(path).suffix in (".yml", ".yaml") and "base_model" in data and \
        any(k in data for k in _MARKERS[1:])


_SIMPLE = {"micro_batch_size": "batch", "gradient_accumulation_steps": "grad_accum"}
_LORA = {"lora_r": "r", "lora_alpha": "alpha", "lora_dropout": "dropout"}


def read(path: Path, data: dict) -> TrainerConfig:
    out = TrainerConfig(format=FORMAT, path=str(path))
    common.one_half(data, path)
    lora = common.read_keys(out, data, path, _TABLE)
    _finish(out, data, lora)
    return out


def _seq(out, key, value, path, data, lora) -> None:
    out.keys["seq"] = value
    packed = " (packed rows)" if data.get("sample_packing") else ""
    out.mapping.append((f"{key} = {value}", f"seq: {value}{packed}"))


def _half(out, key, value, path, data, lora) -> None:
    if value == "auto":
        raise MemestError(f"{path}: {key}: auto picks by the GPU axolotl runs on; write true or false "
                          "(or pass --precision)")
    if common.switch(value, path, key):
        out.keys["precision"] = key
        out.mapping.append((f"{key} = {value}", f"precision: {key} (axolotl loads the weights in {key}; autocast "
                                                "over them)"))
    else:
        out.mapping.append((f"{key} = {value}", f"not {key}"))


def _checkpointing(out, key, value, path, data, lora) -> None:
    if common.switch(value, path, key):
        out.keys["checkpointing"] = "blocks"
        out.mapping.append((f"{key} = {value}", "checkpointing: blocks (each decoder layer)"))
    else:
        out.mapping.append((f"{key} = {value}", "checkpointing: none"))


def _adapter(out, key, value, path, data, lora) -> None:
    if value not in ("lora", "qlora"):
        raise MemestError(f"{path}: adapter = {value!r}: memest reads lora and qlora")
    out.mapping.append((f"{key} = {value}", "peft LoRA" + (" on a 4-bit base" if value == "qlora" else "")))


def _targets(out, key, value, path, data, lora) -> None:
    if key == "lora_target_linear":
        if common.switch(value, path, key):
            lora["targets"] = "all-linear"
        out.mapping.append((f"{key} = {value}", "lora targets: all-linear" if value else "targets from "
                                                                                        "lora_target_modules"))
    else:
        lora.setdefault("targets", common.lora_targets(value, f"{path}: {key}: "))
        out.mapping.append((f"{key} = {value}", f"lora targets: {value}"))


def _autocast(out, key, value, path, data, lora) -> None:
    """axolotl passes it to peft's get_peft_model(..., autocast_adapter_dtype=) (axolotl 067b021,
    src/axolotl/loaders/adapter.py; src/axolotl/utils/schemas/peft.py: None leaves peft's default)."""
    if not isinstance(value, bool):
        raise MemestError(f"{path}: {key} = {value!r}: expected true or false")
    lora["dtype"] = "fp32" if value else "base"
    out.mapping.append((f"{key} = {value}", f"lora dtype: {lora['dtype']} (peft's autocast_adapter_dtype={value})"))


def _load_in(out, key, value, path, data, lora) -> None:
    if common.switch(value, path, key):
        out.keys["quant"] = "nf4" if key == "load_in_4bit" else "int8"
    out.mapping.append((f"{key} = {value}", f"quant: {out.keys['quant']}" if value else "not quantized"))


_HANDLERS = {
    "sequence_len": _seq,
    "base_model": lambda out, key, value, path, data, lora: common.model(out, key, value, path),
    "optimizer": lambda out, key, value, path, data, lora: common.optimizer(out, key, value),
    "deepspeed": lambda out, key, value, path, data, lora: common.deepspeed(out, key, value, path),
    "fsdp": lambda out, key, value, path, data, lora: _fsdp(out, value),
    "fsdp_config": lambda out, key, value, path, data, lora: _fsdp_config(out, value),
    "bf16": _half, "fp16": _half, "gradient_checkpointing": _checkpointing, "adapter": _adapter,
    "lora_target_modules": _targets, "lora_target_linear": _targets, "load_in_4bit": _load_in,
    "load_in_8bit": _load_in, "peft_autocast_adapter_dtype": _autocast,
    "sample_packing": lambda out, key, value, path, data, lora: out.mapping.append(
        (f"{key} = {value}", "rows packed to sequence_len tokens" if value else
         "one example per row: sequence_len is the longest (padded) length")),
    "tf32": lambda out, key, value, path, data, lora: out.mapping.append(
        (f"{key} = {value}", "matmul precision only: no effect on memory")),
    "gradient_checkpointing_kwargs": lambda out, key, value, path, data, lora: out.mapping.append(
        (f"{key} = {value}", "use_reentrant: blocks-reentrant when true")),
    "liger_fused_linear_cross_entropy": lambda out, key, value, path, data, lora: _loss_head(out, key, value, "fused"),
    "chunked_cross_entropy": lambda out, key, value, path, data, lora: _loss_head(out, key, value, "chunked-output"),
    "chunked_cross_entropy_num_chunks": lambda out, key, value, path, data, lora: out.mapping.append(
        (f"{key} = {value}", f"loss head chunks: {value}")),
    "plugins": lambda out, key, value, path, data, lora: out.mapping.append(
        (f"{key} = {value}", "loads integrations; their own keys (liger_*, cut_cross_entropy) decide memory")),
}
# axolotl's cross-entropy options memest does not model (each changes the loss head's memory)
_UNMODELLED_HEADS = {
    "cut_cross_entropy": "Apple's Cut Cross-Entropy (not modelled)",
    "liger_cross_entropy": "Liger's non-fused cross entropy (not modelled)",
}



def _unmodelled_head(out: TrainerConfig, key: str, value, path, data, lora) -> None:
    if value:
        out.unknown.append(f"{key} = {value} ({_UNMODELLED_HEADS[key]})")
    else:
        out.mapping.append((f"{key} = {value}", "loss head: the model's own"))


_HANDLERS.update(dict.fromkeys(_UNMODELLED_HEADS, _unmodelled_head))


def _loss_head(out: TrainerConfig, key: str, value, head: str) -> None:
    if not value:
        out.mapping.append((f"{key} = {value}", "loss head: the model's own"))
        return
    if "loss_head" in out.keys:
        raise MemestError(f"{out.path}: {key} with another cross-entropy option: axolotl allows only one "
                          "(check_cross_entropy_conflicts)")
    out.keys["loss_head"] = head
    meaning = {"fused": "loss_head: fused (Liger's fused linear cross entropy, LigerPlugin)",
               "chunked-output": "loss_head: chunked-output (torchtune's CEWithChunkedOutputLoss as axolotl copies "
                                 "it: the whole logits, each chunk upcast to fp32 in turn)"}[head]
    out.mapping.append((f"{key} = {value}", meaning))


_TABLE = common.KeyTable(_SIMPLE, _LORA, _HANDLERS, _NO_EFFECT)


def _reentrant(out: TrainerConfig, data: dict) -> None:
    """gradient_checkpointing_kwargs' use_reentrant: true -> blocks-reentrant. Not given, axolotl (067b021,
    src/axolotl/utils/config/__init__.py) sets {"use_reentrant": True} unless unfrozen_parameters or rl is set; memest
    keeps its blocks (non-reentrant) there and says so (tests/test_from_config.py pins that mapping)."""
    kwargs = data.get("gradient_checkpointing_kwargs")
    if isinstance(kwargs, dict):
        if kwargs.get("use_reentrant", False):
            out.keys["checkpointing"] = "blocks-reentrant"
    elif data.get("unfrozen_parameters") is None and data.get("rl") is None:
        out.notes.append("gradient_checkpointing_kwargs not set: axolotl then sets use_reentrant=True; memest traces "
                         "non-reentrant checkpointing here (pass --checkpointing blocks-reentrant for axolotl's default)")


def _finish(out: TrainerConfig, data: dict, lora: dict) -> None:
    keys = out.keys
    if keys.get("checkpointing") == "blocks":
        _reentrant(out, data)
    if keys.get("loss_head") == "chunked-output":
        chunks = data.get("chunked_cross_entropy_num_chunks") or 8  # patch_chunked_ce_loss_fn's default
        keys["loss_head"] = f"chunked-output:{chunks}"
        out.notes.append("chunked_cross_entropy: axolotl compiles each chunk's upcast + cross-entropy with inductor "
                         "and splits with Tensor.chunk; memest traces them eager (each chunk's fp32 copy made) and "
                         "splits as torchtune does (tensor_split): the same chunks when the length divides evenly")
    if "optim" not in keys:
        out.notes.append("optimizer not set: axolotl's default applies, memest's --optim default here (pass --optim)")
    adapter = data.get("adapter")
    if adapter:
        keys["lora"] = lora
        if adapter == "qlora" and "quant" not in keys:
            keys["quant"] = "nf4"
            out.mapping.append(("adapter = qlora", "quant: nf4"))
        if keys.get("quant"):
            keys["prepare_kbit"] = True
            out.notes.append("axolotl applies peft's prepare_model_for_kbit_training to a 4/8-bit base with an "
                             "adapter (src/axolotl/loaders/model.py): prepare_kbit: true")
    elif lora:
        out.notes.append("lora_* keys without adapter: lora|qlora: axolotl trains without LoRA; so does memest")
    out.notes.append("world size: the launcher's (accelerate/torchrun), not in the file; pass --world-size")


def _fsdp(out: TrainerConfig, value) -> None:
    options = value.split() if isinstance(value, str) else list(value or [])
    for option in options:
        shard = {"full_shard": "zero3", "shard_grad_op": "zero2", "hybrid_shard": "zero3"}.get(option)
        if shard:
            out.keys["shard"] = shard
            out.mapping.append((f"fsdp: {option}", f"shard: {shard}"))
        elif option == "offload":
            out.keys["offload"] = "params"
            out.mapping.append(("fsdp: offload", "offload: params"))
        elif option == "auto_wrap":
            out.mapping.append(("fsdp: auto_wrap", "one FSDP unit per decoder layer (memest's FSDP model)"))
        else:
            out.unknown.append(f"fsdp: {option}")


def _fsdp_config(out: TrainerConfig, block) -> None:
    for key, value in (block or {}).items():
        if key == "fsdp_offload_params":
            if value:
                out.keys["offload"] = "params"
            out.mapping.append((f"fsdp_config.{key} = {value}", "offload: params" if value else "no offload"))
        elif key == "fsdp_sharding_strategy" and str(value).upper() in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"):
            shard = {"FULL_SHARD": "zero3", "SHARD_GRAD_OP": "zero2", "NO_SHARD": "none"}[str(value).upper()]
            out.keys["shard"] = shard
            out.mapping.append((f"fsdp_config.{key} = {value}", f"shard: {shard}"))
        elif key in ("fsdp_transformer_layer_cls_to_wrap", "fsdp_auto_wrap_policy"):
            out.mapping.append((f"fsdp_config.{key} = {value}", "one FSDP unit per decoder layer"))
        else:
            out.unknown.append(f"fsdp_config.{key}")

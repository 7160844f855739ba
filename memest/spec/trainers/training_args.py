"""transformers ``TrainingArguments`` (and trl's ``SFTConfig``, its subclass) dumped as JSON
(``args.to_json_string()``, ``training_args.json``-style) -> memest config keys.

Keys and defaults: transformers 5.24.0 src/transformers/training_args.py (``TrainingArguments``) and
trainer_optimizer.py (``_OPTIMIZER_HANDLERS``: which optimizer class each ``optim`` name builds); trl's SFTConfig
(trl/trainer/sft_config.py: ``max_length``, formerly ``max_seq_length``; ``packing``; ``model_init_kwargs``;
https://github.com/huggingface/trl). What Trainer does with them:

- ``bf16`` / ``fp16``: Trainer runs the forward under torch.autocast (accelerate's mixed precision); the weights stay
  in the dtype the model was loaded in. memest assumes fp32 weights (bf16-mixed / fp16-mixed) unless trl's
  ``model_init_kwargs`` loads the model in bfloat16/float16 (then bf16 / fp16: 16-bit weights and optimizer state).
- ``gradient_checkpointing`` (``activation_checkpointing`` since transformers 5): the model's own checkpointing of
  every decoder layer, ``use_reentrant=False`` unless ``gradient_checkpointing_kwargs`` says otherwise
  (transformers 5.24.0 modeling_utils.py ``_activation_checkpointing_enable``).
- Trainer drops the model's output before backward (memest ``outputs: freed``).
- ``torch_empty_cache_steps`` N: ``training_step`` calls accelerate's ``clear_device_cache()`` (torch.cuda.empty_cache)
  after the loss when ``state.global_step % N == 0`` (trainer.py l. 2092-2098): memest ``empty_cache_steps: N``.
- trl's ``activation_offloading: true`` (SFTConfig, DPOConfig, KTOConfig, RewardConfig): the trainer wraps each
  ``training_step`` in ``get_act_offloading_ctx_manager(model)`` (trl/trainer/sft_trainer.py l. 1190-1193,
  1690-1693, trl 1.16): memest ``activation_offload: trl``.

The model itself is not in the dump: give it beside the file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from memest.errors import MemestError
from memest.spec.choices import Shard
from memest.spec.trainers import common, deepspeed
from memest.spec.trainers.base import TrainerConfig

FORMAT = "training-args"

# optim name -> (memest optim, fused); transformers' OptimizerNames (training_args.py) and the classes
# trainer_optimizer.py builds for them (adamw_torch*: torch.optim.AdamW; *_bnb_8bit / adamw_8bit: bnb AdamW8bit;
# paged_*: bnb PagedAdamW; adafactor: transformers' Adafactor; sgd: torch.optim.SGD)
OPTIMIZERS = {
    "adamw_torch": ("adamw", False), "adamw_torch_fused": ("adamw", True), "adamw_bnb_8bit": ("adam8bit", False),
    "adamw_8bit": ("adam8bit", False), "paged_adamw_8bit": ("paged-adamw-8bit", False),
    "paged_adamw_32bit": ("paged-adamw-32bit", False), "adafactor": ("adafactor", False), "sgd": ("sgd", False),
}

# keys with no effect on one training step's GPU memory: reported as "ignored: no memory effect", not unknown
NEUTRAL = {
    # output, logging, hub, evaluation, saving: outside the training step
    "output_dir", "overwrite_output_dir", "run_name", "project", "report_to", "logging_dir", "logging_steps",
    "logging_strategy", "logging_first_step", "logging_nan_inf_filter", "log_level", "log_level_replica",
    "log_on_each_node", "disable_tqdm", "push_to_hub", "hub_model_id", "hub_strategy", "hub_token",
    "hub_private_repo", "hub_always_push", "hub_revision", "trackio_space_id", "trackio_bucket_id",
    "trackio_static_space_id", "do_train", "do_eval", "do_predict", "eval_strategy", "eval_steps", "eval_delay",
    "eval_on_start", "eval_accumulation_steps", "eval_do_concat_batches", "eval_use_gather_object",
    "per_device_eval_batch_size", "bf16_full_eval", "fp16_full_eval", "prediction_loss_only", "batch_eval_metrics",
    "include_for_metrics", "metric_for_best_model", "greater_is_better", "load_best_model_at_end",
    "save_strategy", "save_steps", "save_total_limit", "save_only_model", "save_on_each_node",
    "resume_from_checkpoint", "restore_callback_states_from_checkpoint", "ignore_data_skip", "enable_jit_checkpoint",
    "skip_memory_metrics", "include_num_input_tokens_seen", "debug",
    # schedule and optimizer hyper-parameters (the state's size does not depend on them)
    "learning_rate", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon", "lr_scheduler_type",
    "lr_scheduler_kwargs", "warmup_steps", "warmup_ratio", "num_train_epochs", "max_steps", "seed", "data_seed",
    "full_determinism",
    "max_grad_norm",  # clip_grad_norm_: per-parameter norms, small temporaries memest does not trace
    # data loading (host side)
    "dataloader_drop_last", "dataloader_num_workers", "dataloader_pin_memory", "dataloader_persistent_workers",
    "dataloader_prefetch_factor", "dataloader_multiprocessing_context", "dataloader_in_order",
    "remove_unused_columns", "label_names", "length_column_name", "group_by_length", "train_sampling_strategy",
    "average_tokens_across_devices", "accelerator_config",
    # process group set-up
    "local_rank", "ddp_backend", "ddp_timeout", "ddp_find_unused_parameters", "ddp_broadcast_buffers",
    "ddp_static_graph", "tf32", "torch_compile_backend", "torch_compile_mode",
    # trl SFTConfig: dataset preparation
    "dataset_text_field", "dataset_kwargs", "dataset_num_proc", "eos_token", "pad_token", "chat_template_path",
    "completion_only_loss", "assistant_only_loss", "padding_free", "pad_to_multiple_of", "packing_strategy",
    "shuffle_dataset", "eval_packing", "dataset_batch_size",
}
# keys whose default (None / False / 0) is memory-neutral; any other value is listed as unknown
OFF_BY_DEFAULT = ("ddp_bucket_cap_mb", "label_smoothing_factor", "neftune_noise_alpha", "auto_find_batch_size",
                  "optim_target_modules", "parallelism_config", "liger_kernel_config",
                  "use_cache")


def detect(path, data) -> bool:
    return (isinstance(data, dict) and "per_device_train_batch_size" in data and "gradient_accumulation_steps" in data
            and not any(k in data for k in ("stage", "finetuning_type", "base_model", "model_name_or_path")))


def read(path, data) -> TrainerConfig:
    cfg = TrainerConfig(format=FORMAT, path=str(path))
    used: set[str] = set()
    where = f"{path}: "

    def get(key: str, default: Any = None) -> Any:
        used.add(key)
        value = data.get(key, default)
        return default if value is None else value

    def put(key: str, source: str, value: Any, meaning: str = "") -> None:
        cfg.keys[key] = value
        cfg.mapping.append((f"{source} = {data.get(source, '(default)')!r}", meaning or f"{key}: {value}"))

    batch = get("per_device_train_batch_size", 8)
    put("batch", "per_device_train_batch_size", batch)
    accum = get("gradient_accumulation_steps", 1)
    if accum > 1:
        put("grad_accum", "gradient_accumulation_steps", accum)
    _generation_batch(cfg, data, get, put, batch, accum)
    _seq(cfg, data, get, put)
    _precision(cfg, data, get, put)
    _checkpointing(cfg, get, put)
    _optimizer(cfg, get, put, where)
    cfg.keys["outputs"] = "freed"
    cfg.mapping.append(("(Trainer)", "outputs: freed (Trainer drops the model's output before backward)"))
    if get("torch_compile", False):
        put("compile", "torch_compile", True)
    if get("use_liger_kernel", False):
        put("loss_head", "use_liger_kernel", "fused", "loss_head: fused (Liger's fused linear cross entropy; its "
            "RMSNorm/RoPE/SwiGLU kernels are not modelled)")
    if (steps := get("torch_empty_cache_steps")) is not None:
        put("empty_cache_steps", "torch_empty_cache_steps", steps, f"empty_cache_steps: {steps} (Trainer's training_step "
            f"empties the device cache after the loss of every micro-step of the steps 0, {steps}, {2 * steps}...)")
    if get("use_cpu", False):
        put("target", "use_cpu", "cpu")
    if common.switch(get("activation_offloading", False), path, "activation_offloading"):
        put("activation_offload", "activation_offloading", "trl", "activation_offload: trl (trl's OffloadActivations "
            "around each training_step, trl/models/activation_offloading.py)")
    _deepspeed(cfg, get, where)
    _fsdp(cfg, get, put)
    for key in OFF_BY_DEFAULT:
        if data.get(key) not in (None, False, 0, 0.0, [], {}):
            cfg.unknown.append(f"{key} = {data[key]!r}")
        used.add(key)
    common.leftovers(cfg, data, used, NEUTRAL)
    if "model" not in cfg.keys:
        cfg.notes.append("TrainingArguments do not name the model: give it beside the file")
    return cfg


def _generation_batch(cfg, data, get, put, batch: int, accum: int) -> None:
    """trl GRPOConfig's (and RLOOConfig's) ``generation_batch_size`` / ``steps_per_generation`` -> memest's
    ``generation_batch``. trl 1.16.0 trl/trainer/grpo_config.py ``__post_init__``: at most one of the two is given;
    steps_per_generation S defaults to gradient_accumulation_steps, generation_batch_size to
    per_device_train_batch_size x num_processes x S, and a dump (``to_json_string()``, after ``__post_init__``) holds
    both. memest traces one process, whose generation batch is per_device_train_batch_size x S: read from S where
    it is there, else from generation_batch_size as one process's; trl's default (S = the accumulation) is memest's
    default (0) and is not set."""
    size, steps = get("generation_batch_size"), get("steps_per_generation")
    if size is None and steps is None:
        return
    if steps is not None:
        source, value = "steps_per_generation", batch * steps
        meaning = (f"generation_batch: {value} (per_device_train_batch_size {batch} x steps_per_generation {steps}: "
                   "one process's completions generated at once)")
        if size is not None and size != value:
            cfg.notes.append(f"generation_batch_size {size} is {size // value} processes' generation batches (trl: "
                             "per_device_train_batch_size x num_processes x steps_per_generation); memest traces one "
                             "process's")
    else:
        source, value, steps = "generation_batch_size", size, size // batch if batch else 0
        meaning = f"generation_batch: {value} (one process's completions generated at once)"
        cfg.notes.append(f"generation_batch_size {size}: trl divides it over the processes (num_processes x "
                         "per_device_train_batch_size x steps_per_generation); memest reads it as one process's: with "
                         "N processes give --generation-batch <it / N>")
    if steps == accum and value == batch * accum:
        cfg.mapping.append((f"{source} = {data.get(source)!r}", "trl's default (per_device_train_batch_size x "
                            "gradient_accumulation_steps): memest's default generation_batch"))
        return
    put("generation_batch", source, value, meaning)


def _seq(cfg, data, get, put) -> None:
    get("max_length")
    source = "max_length" if data.get("max_length") is not None else "max_seq_length"
    seq = get(source)
    packing = get("packing", False)
    if seq is None:
        cfg.notes.append("no sequence length (TrainingArguments has none; trl's SFTConfig max_length): give --seq")
        return
    put("seq", source, seq, f"seq: {seq} (" + ("packed rows of exactly this length)" if packing else
                                              "the longest a padded batch reaches: the upper end)"))


def _precision(cfg, data, get, put) -> None:
    bf16, fp16 = get("bf16", False), get("fp16", False)
    init = get("model_init_kwargs", {})
    loaded = str(init.get("dtype") or init.get("torch_dtype") or "").removeprefix("torch.")
    half = "bf16" if bf16 else "fp16" if fp16 else None
    if half is None:
        put("precision", "bf16", "fp32", "precision: fp32 (neither bf16 nor fp16)")
    elif loaded in ("bfloat16", "float16"):
        put("precision", "bf16" if bf16 else "fp16", "bf16" if loaded == "bfloat16" else "fp16",
            f"precision: {'bf16' if loaded == 'bfloat16' else 'fp16'} (model_init_kwargs loads the weights in "
            f"{loaded}: 16-bit weights, gradients and optimizer state, autocast on top)")
    else:
        put("precision", half, f"{half}-mixed", f"precision: {half}-mixed (autocast over fp32 weights)")
        why = ("model_init_kwargs dtype 'auto' loads the checkpoint's own dtype, which the file does not say"
               if loaded == "auto" else "Trainer's autocast keeps the weights as loaded")
        cfg.notes.append(f"{half}: memest assumes the model is loaded in fp32 ({why}); if it is loaded in 16 bits, "
                         f"give --precision {half}")


def _checkpointing(cfg, get, put) -> None:
    new, old = get("activation_checkpointing", False), get("gradient_checkpointing", False)  # old: v4's name
    on = new or old
    kwargs = get("activation_checkpointing_kwargs") or get("gradient_checkpointing_kwargs") or {}
    get("gradient_checkpointing_kwargs")
    if not on:
        return
    source = "activation_checkpointing" if new else "gradient_checkpointing"
    if kwargs.get("use_reentrant", False):
        put("checkpointing", source, "blocks-reentrant", "checkpointing: blocks-reentrant (the model's own "
            "checkpointing of every layer, use_reentrant=True)")
    else:
        put("checkpointing", source, "blocks", "checkpointing: blocks (the model's own checkpointing of every layer)")


def _optimizer(cfg, get, put, where: str) -> None:
    name = str(get("optim", "adamw_torch_fused"))  # transformers 5.24.0's default with torch >= 2.8
    if name not in OPTIMIZERS:
        raise MemestError(f"{where}optim {name!r} is not modelled; memest models {', '.join(OPTIMIZERS)}")
    optim, fused = OPTIMIZERS[name]
    args = str(get("optim_args", "") or "")
    if name == "sgd" and "momentum" in args and "momentum=0" not in args.replace(" ", ""):
        optim = "sgd-momentum"
    elif args:
        cfg.unknown.append(f"optim_args = {args!r}")
    put("optim", "optim", optim)
    if name == "adafactor":  # transformers' Adafactor (beta1 None: Trainer's default) vs torch.optim.Adafactor
        cfg.notes.append("adafactor: Trainer builds transformers' Adafactor; memest traces torch.optim.Adafactor, "
                         "whose factored second moments (a row and a column vector per matrix) have the same sizes")
    if fused:
        put("fused", "optim", True, "fused: true (torch.optim.AdamW(fused=True))")


def _deepspeed(cfg, get, where: str) -> None:
    ds = get("deepspeed")
    if ds is None:
        return
    if isinstance(ds, str):
        cfg.includes.append(Path(ds) if Path(ds).is_absolute() else Path(cfg.path).parent / ds)
        cfg.mapping.append((f"deepspeed = {ds!r}", "read as a DeepSpeed JSON"))
    elif isinstance(ds, dict):  # given inline (TrainingArguments(deepspeed={...})): the DeepSpeed reader's keys,
        inner = deepspeed.read(Path(cfg.path), ds)
        cfg.keys = {**inner.keys, **cfg.keys}
        cfg.mapping += [(f"deepspeed.{src}", meaning) for src, meaning in inner.mapping]
        cfg.unknown += [f"deepspeed.{key}" for key in inner.unknown]
        cfg.notes += inner.notes  # under the arguments' own keys, as an included file's are
    else:
        cfg.unknown.append(f"deepspeed = {ds!r}")


FSDP_OPTIONS = {"full_shard": "zero3", "shard_grad_op": "zero2", "no_shard": "none"}  # no_shard: FSDP1 only
FSDP_NEUTRAL = {"min_num_params", "transformer_layer_cls_to_wrap", "sync_module_states", "cpu_ram_efficient_loading",
                "use_orig_params", "state_dict_type", "auto_wrap_policy", "xla", "xla_fsdp_v2",
                "xla_fsdp_grad_ckpt", "xla_fsdp_settings"}


# transformers 5.24 (training_args.py _process_fsdp_args, _apply_legacy_fsdp_to_config): `fsdp=True`, the layout in
# fsdp_config: reshard_after_forward (FSDP2: True full shard, False shard_grad_op; FSDP1: the strategy's name), cpu_offload
RESHARD = {"true": "zero3", "full_shard": "zero3", "false": "zero2", "shard_grad_op": "zero2", "no_shard": "none"}


def _fsdp1(cfg, conf: dict, put, shard: str) -> None:
    """FSDP1 (fsdp_config version 1): --fsdp-version 1 where its parameters are flat (use_orig_params False)."""
    # transformers' TrainingArguments passes use_orig_params to accelerate's plugin, default "true"
    # (training_args.py: fsdp_config.get("use_orig_params", "true"))
    orig = str(conf.get("use_orig_params", "true")).lower() == "true"
    if not orig:
        put("fsdp_version", "fsdp_config", "1",
            "fsdp_version: 1 (FSDP1 FullyShardedDataParallel, flat parameters, use_orig_params=False)")
        # transformers' TrainingArguments passes sync_module_states to accelerate's plugin, default "true"
        # (training_args.py: fsdp_config.get("sync_module_states", "true"))
        if str(conf.get("sync_module_states", "true")).lower() == "true":
            put("fsdp_sync_module_states", "fsdp_config", True,
                "fsdp_sync_module_states: true (FSDP1 broadcasts rank 0's states while it wraps)")
    elif shard == Shard.NONE:
        cfg.notes.append("FSDP1 NO_SHARD with use_orig_params=True (transformers' default): traced as DDP's "
                         "full replicas (--fsdp-version 1 traces FSDP1 with use_orig_params=False)")
    else:
        cfg.notes.append("FSDP1 (fsdp_config version 1) with use_orig_params=True (transformers' default): "
                         "traced as FSDP2's per-parameter sharding of the same bytes (--fsdp-version 1 traces "
                         "FSDP1 with use_orig_params=False)")


def _fsdp(cfg, get, put) -> None:
    fsdp = get("fsdp", "") or ""
    words = fsdp.split() if isinstance(fsdp, str) else [] if fsdp is True else [getattr(w, "value", w) for w in fsdp]
    conf = {k.removeprefix("fsdp_"): v for k, v in (get("fsdp_config") or {}).items()}
    shard = next((FSDP_OPTIONS[w] for w in words if w in FSDP_OPTIONS), None)
    for word in words:
        if word not in (*FSDP_OPTIONS, "offload", "auto_wrap"):
            cfg.unknown.append(f"fsdp = {fsdp!r} ({word})")
    if fsdp is True:
        reshard = str(conf.get("reshard_after_forward", True)).lower()
        shard = RESHARD.get(reshard)
        if shard is None:
            cfg.unknown.append(f"fsdp_config.reshard_after_forward = {conf['reshard_after_forward']!r}")
        if str(conf.get("version", 2)) == "2" and shard:  # FSDP2 is transformers 5's default
            conf["version"] = 2
    if shard == Shard.NONE and str(conf.get("version", 1)) == "2":  # fsdp=True set version 2 above when unset
        # transformers' _apply_legacy_fsdp_to_config raises for no_shard under FSDP2 ("only available with FSDP1")
        cfg.unknown.append(f"fsdp = {fsdp!r} with fsdp_config version 2 (no_shard is FSDP1's; transformers refuses it)")
        shard = None
    if shard:
        if conf.get("reshard_after_forward") is False:
            shard = "zero2"
        put("shard", "fsdp", shard, f"shard: {shard} (FSDP; world size from the launcher: give --world-size)")
        if str(conf.get("version", 1)) != "2":
            _fsdp1(cfg, conf, put, shard)
    if "offload" in words or conf.get("offload_params") or conf.get("cpu_offload"):
        put("offload", "fsdp", "params", "offload: params (FSDP CPU offload)")
    if str(conf.get("activation_checkpointing", "false")).lower() == "true":
        put("checkpointing", "fsdp_config", "blocks", "checkpointing: blocks (fsdp_config activation_checkpointing)")
    for key, value in conf.items():
        if key not in ("version", "reshard_after_forward", "offload_params", "cpu_offload", "activation_checkpointing") \
                and key not in FSDP_NEUTRAL:
            cfg.unknown.append(f"fsdp_config.{key} = {value!r}")

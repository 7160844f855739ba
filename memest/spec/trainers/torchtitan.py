"""torchtitan's job config TOML (``--job.config_file``) -> memest config keys.

Source of truth: torchtitan/config/job_config.py and torchtitan/models/*/train_configs/*.toml at commit
238fa9953e4aec2a62582121564273d7cbb1e9f1 (2026-02-23, https://github.com/pytorch/torchtitan), the last commit
before torchtitan replaced its TOML configs with Python dataclass registries (#2386). What the trainer does with a
key is read from the same commit: mixed precision via fully_shard when FSDP is on, via torch.autocast for DDP or a
single device, and not at all with TP or PP without FSDP (torchtitan/distributed/utils.py ``maybe_enable_amp``);
TP always with sequence parallel and, unless disabled, loss parallel (torchtitan/models/llama3/infra/parallelize.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from memest.errors import MemestError
from memest.spec.trainers.base import TrainerConfig

FORMAT = "torchtitan"
SOURCE = "torchtitan/config/job_config.py @ 238fa9953e4aec2a62582121564273d7cbb1e9f1"

# [model] name/flavor -> a bundled hf config with the same shapes (torchtitan/models/llama3/__init__.py
# llama3_args["8B"]: dim 4096, 32 layers, 32 heads, 8 kv heads, ffn_dim_multiplier 1.3, vocab 128256, rope 500000:
# Llama 3.1 8B)
FLAVORS = {("llama3", "8B"): "hf:llama-3.1-8b"}

# sections, and keys, with no effect on a training step's GPU memory (reported as ignored, not unknown)
NEUTRAL_SECTIONS = ("job", "profiling", "metrics", "lr_scheduler", "checkpoint", "comm", "fault_tolerance",
                    "memory_estimation", "validation")
NEUTRAL_KEYS = {
    "experimental.custom_import", "experimental.custom_args_module", "debug.seed", "debug.deterministic",
    "debug.deterministic_warn_only",
    "model.hf_assets_path", "model.tokenizer_path", "model.print_after_conversion",
    "optimizer.lr", "optimizer.eps", "optimizer.weight_decay", "optimizer.beta1", "optimizer.beta2",
    "training.dataset", "training.dataset_path", "training.steps", "training.gc_freq", "training.gc_debug",
    "training.mixed_precision_reduce",  # float32 only: FSDP2's reduce dtype, the one memest traces
    "training.max_norm",  # clip_grad_norm_: its per-parameter norms are small temporaries, not traced
    "parallelism.enable_async_tensor_parallel",  # symmetric-memory matmuls: same tensors, overlapped
    "parallelism.pipeline_parallel_expert_parallel_overlap", "parallelism.expert_parallel_comm_backend",
    "parallelism.context_parallel_load_balancer",
    "activation_checkpoint.preserve_rng_state", "activation_checkpoint.determinism_check",
    "activation_checkpoint.debug", "activation_checkpoint.early_stop",
    "compile.backend", "compile.components",
    "quantize.linear.float8.enable_fsdp_float8_all_gather", "quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp",
    "quantize.linear.float8.filter_fqns", "quantize.linear.float8.recipe_name", "quantize.linear.float8.emulate",
    "quantize.linear.mx.recipe_name", "quantize.linear.mx.filter_fqns", "quantize.grouped_mm.float8.fqns",
    "quantize.grouped_mm.mx.recipe_name", "quantize.grouped_mm.mx.fqns",  # only with model.converters (below)
}
SCHEDULES = {"1F1B": "1f1b", "GPipe": "gpipe", "Interleaved1F1B": "interleaved", "LoopedBFS": "looped-bfs"}


def detect(path, data) -> bool:
    return (Path(path).suffix == ".toml" and isinstance(data, dict)
            and any(isinstance(data.get(s), dict) for s in ("training", "parallelism", "activation_checkpoint")))


def _flat(data: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in data.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def read(path, data) -> TrainerConfig:
    path = Path(path)
    flat = _flat(data)
    cfg = TrainerConfig(format=FORMAT, path=str(path))
    used: set[str] = set()
    where = f"{path}: "

    def get(key: str, default: Any = None) -> Any:
        used.add(key)
        return flat.get(key, default)

    def put(key: str, source: str, value: Any, meaning: str = "") -> None:
        cfg.keys[key] = value
        cfg.mapping.append((f"{source} = {flat.get(source, '(default)')!r}", meaning or f"{key}: {value}"))

    _model(cfg, path, get, where)
    batch = get("training.local_batch_size", get("training.batch_size", 8))  # default: job_config.py Training
    put("batch", "training.local_batch_size" if "training.local_batch_size" in flat else "training.batch_size", batch)
    put("seq", "training.seq_len", get("training.seq_len", 2048))

    fsdp, tp, pp, rep, shard = _parallel(cfg, get, put)
    _pipeline(cfg, flat, get, put, pp, batch, where)

    _precision(cfg, get, put, fsdp, tp, pp)
    if get("training.enable_cpu_offload", False):
        put("offload", "training.enable_cpu_offload", "params", "offload: params (FSDP2 CPUOffloadPolicy)")
    accum = _accum(cfg, get, batch, rep * shard if shard > 0 else None, where)
    if accum > 1:
        put("grad_accum", "training.global_batch_size", accum,
            f"grad_accum: {accum} (global_batch_size / (local_batch_size x dp degree))")
    _checkpointing(cfg, get, put, where)
    _optimizer(cfg, get, put, where)
    if get("compile.enable", False):
        components = get("compile.components", ["model", "loss"])  # job_config.py Compile's default
        if "model" in components:
            put("compile_scope", "compile.enable", "blocks", "compile_scope: blocks (apply_compile: each "
                "TransformerBlock compiled in place, fullgraph, after the float8 conversion and checkpointing, before "
                "FSDP; torchtitan/models/llama3/infra/parallelize.py)")
        if "loss" in components:
            cfg.notes.append("compile.components has 'loss': torchtitan compiles its loss function apart; memest "
                             "traces the loss eager (transformers' loss inside the model's forward)")
    if flat.get("validation.enable"):
        cfg.notes.append("validation.enable: the validation forward (no grad, its own local_batch_size) is not estimated")
    _converters(cfg, get, put, shard)

    for key in flat:
        if key in used or key in NEUTRAL_KEYS or key.split(".")[0] in NEUTRAL_SECTIONS:
            continue
        cfg.unknown.append(f"{key} = {flat[key]!r}")
    ignored = sorted(k for k in flat if k not in used and (k in NEUTRAL_KEYS or k.split(".")[0] in NEUTRAL_SECTIONS))
    if ignored:
        cfg.notes.append(f"ignored: no memory effect: {', '.join(ignored)}")
    cfg.notes.append(f"read as {SOURCE} defines the keys")
    return cfg


FLOAT8_CONVERTERS = ("quantize.linear.float8", "float8")  # its registered name at 238fa99, and the older one
# torchtitan's llama3 module names -> transformers' (torchtitan/models/llama3/model/state_dict_adapter.py at 238fa99,
# from_hf_map): filter_fqns name torchtitan's modules, memest traces transformers' Llama (FLAVORS)
LLAMA3_NAMES = {"attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
                "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
                "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj",
                "feed_forward.w2": "mlp.down_proj", "output": "lm_head", "tok_embeddings": "model.embed_tokens"}


def _hf_name(part: str) -> str:
    """A filter_fqns part in transformers' names: each torchtitan llama3 module name in it translated."""
    for titan, hf in LLAMA3_NAMES.items():
        if part == titan or part.endswith("." + titan):
            return part[: len(part) - len(titan)] + hf
    return part


def _converters(cfg, get, put, shard: int) -> None:
    """model.converters: torchao's float8 training (Float8LinearConverter, torchtitan/components/quantization/
    float8.py at 238fa99) -> --fp8 with its recipe, all-gather and filter; any other converter (MXFP8's, whose
    torchao API at that commit is not torchao 0.18's; grouped-mm float8) is reported unknown."""
    converters = list(get("model.converters", []) or [])
    float8 = [c for c in converters if c in FLOAT8_CONVERTERS]
    other = [c for c in converters if c not in FLOAT8_CONVERTERS]
    if other:
        cfg.unknown.append(f"model.converters = {other!r}")
        cfg.notes.append(f"model.converters {other!r} is not modelled (memest traces torchao's float8 converter; "
                         "torchtitan's MX converter at 238fa99 uses torchao's MXLinearConfig, which torchao 0.18's "
                         "--fp8 mxfp8 recipes replaced): the estimate is the model without it")
    if not float8:
        return
    key = "quantize.linear.float8"
    recipe = get(f"{key}.recipe_name")
    if get(f"{key}.emulate", False):
        cfg.unknown.append(f"{key}.emulate = True")
        return
    if recipe not in (None, "tensorwise", "rowwise"):
        cfg.unknown.append(f"{key}.recipe_name = {recipe!r}")
        return
    put("fp8", "model.converters", recipe or "tensorwise",
        f"fp8: {recipe or 'tensorwise'} (Float8LinearConverter: "
        + (f"Float8LinearConfig.from_recipe_name({recipe!r}))" if recipe else
           "recipe_name unset: Float8LinearConfig(), tensorwise scaling)"))
    gather = get(f"{key}.enable_fsdp_float8_all_gather", False) and recipe is None and shard != 1
    if gather:  # the converter turns it on only where FSDP shards (parallel_dims.dp_shard_enabled)
        pre = get(f"{key}.precompute_float8_dynamic_scale_for_fsdp", False)
        put("fp8_all_gather", f"{key}.enable_fsdp_float8_all_gather", "float8-precomputed" if pre else "float8")
    skip = [f for f in get(f"{key}.filter_fqns", []) or [] if f != "auto_filter_small_kn"]
    if "auto_filter_small_kn" in (get(f"{key}.filter_fqns", []) or []):
        cfg.unknown.append(f"{key}.filter_fqns 'auto_filter_small_kn' (torchao's _auto_filter_for_recipe)")
    if skip:
        names = ",".join(_hf_name(part) for part in skip)
        put("fp8_skip", f"{key}.filter_fqns", names,
            f"fp8_skip: {names} (module_filter_fn: a Linear whose name contains one stays high precision; torchtitan's "
            "llama3 names in transformers' terms, its state_dict_adapter.py)")


def _parallel(cfg, get, put) -> tuple:
    """The parallel layout: world = dp_replicate x dp_shard x cp x tp x pp (torchtitan's ParallelDims)."""
    rep, shard = get("parallelism.data_parallel_replicate_degree", 1), get("parallelism.data_parallel_shard_degree", -1)
    tp, pp = get("parallelism.tensor_parallel_degree", 1), get("parallelism.pipeline_parallel_degree", 1)
    cp, ep = get("parallelism.context_parallel_degree", 1), get("parallelism.expert_parallel_degree", 1)
    fsdp = shard != 1 or cp > 1  # -1 fills the launcher's world; torchtitan shards over cp too
    if shard == -1:
        cfg.notes.append("parallelism.data_parallel_shard_degree = -1: torchtitan shards over every rank the launcher "
                         "starts (NGPU), which the TOML does not hold; give --world-size N (the whole world)")
    if rep > 1 and shard not in (1,):
        cfg.notes.append(f"HSDP (data_parallel_replicate_degree {rep} x shard {shard}): each rank holds what FSDP over "
                         "its shard group holds; memest estimates one replica group (--world-size without the "
                         "replicas); the all-reduce across replicas is not traced")
    world = (shard if shard > 0 else 1) * (rep if shard == 1 else 1) * cp * tp * pp
    if world > 1:
        cfg.keys["world_size"] = world
        cfg.mapping.append(("parallelism.*_degree", f"world_size: {world} (dp x cp x tp x pp)"))
    if fsdp:
        reshard = get("parallelism.fsdp_reshard_after_forward", "default")
        zero2 = reshard == "never" or (reshard == "default" and pp > 1)  # default: no reshard with PP
        put("shard", "parallelism.fsdp_reshard_after_forward", "zero2" if zero2 else "zero3",
            f"shard: {'zero2' if zero2 else 'zero3'} (FSDP2 fully_shard, reshard_after_forward={not zero2})")
    for key, value, word in (("tp", tp, "tensor"), ("pp", pp, "pipeline"), ("cp", cp, "context"), ("ep", ep, "expert")):
        if value > 1:
            put(key, f"parallelism.{word}_parallel_degree", value)
    if tp > 1:
        put("sp", "parallelism.tensor_parallel_degree", True, "sp: true (torchtitan's TP plan is sequence parallel)")
        if get("parallelism.disable_loss_parallel", False):
            put("loss_parallel", "parallelism.disable_loss_parallel", False)
    else:
        get("parallelism.disable_loss_parallel")
    if cp > 1:
        put("cp_rotate", "parallelism.context_parallel_rotate_method",
            get("parallelism.context_parallel_rotate_method", "allgather"))
    else:
        get("parallelism.context_parallel_rotate_method")
    return fsdp, tp, pp, rep, shard


def _model(cfg: TrainerConfig, path: Path, get, where: str) -> None:
    name, flavor = get("model.name", "llama3"), str(get("model.flavor", "debugmodel"))
    cfg.notes.append("the model is traced as transformers builds it from the config (same shapes), not as "
                     "torchtitan's own model code runs it")
    assets = get("model.hf_assets_path")
    if assets:
        for base in (path.parent, Path.cwd()):
            candidate = base / assets / "config.json"
            if candidate.is_file():
                model = f"hf:{candidate.resolve()}"
                cfg.keys["model"] = model
                cfg.mapping.append((f"model.hf_assets_path = {assets!r}", f"model: {model} (its config.json; "
                                    f"flavor {flavor!r} is assumed to match it)"))
                return
    if (name, flavor) in FLAVORS:
        cfg.keys["model"] = FLAVORS[(name, flavor)]
        cfg.mapping.append((f"model.name, model.flavor = {name!r}, {flavor!r}", f"model: {FLAVORS[(name, flavor)]}"))
        return
    # no model key: memest's config check then refuses (no `model:`) unless the user passes one beside the file
    cfg.mapping.append((f"model.name, model.flavor = {name!r}, {flavor!r}", "model: not mapped"))
    cfg.notes.append(f"{where}model {name!r} flavor {flavor!r}: memest has no config with its shapes; point [model] "
                     "hf_assets_path at a folder holding the model's config.json, or give the model "
                     "(hf:path/config.json) beside the file")


def _pipeline(cfg, flat, get, put, pp: int, batch: int, where: str) -> None:
    schedule = get("parallelism.pipeline_parallel_schedule", "1F1B")
    mbs = get("parallelism.pipeline_parallel_microbatch_size", 1)
    for key in ("first_stage_less_layers", "last_stage_less_layers", "layers_per_stage", "schedule_csv"):
        get(f"parallelism.pipeline_parallel_{key}")
    if pp <= 1:
        return
    if schedule not in SCHEDULES:
        raise MemestError(f"{where}parallelism.pipeline_parallel_schedule {schedule!r} is not traced; memest "
                          f"models {', '.join(SCHEDULES)}")
    put("pp_schedule", "parallelism.pipeline_parallel_schedule", SCHEDULES[schedule])
    if batch % mbs:
        raise MemestError(f"{where}training.local_batch_size {batch} is not a multiple of "
                          f"parallelism.pipeline_parallel_microbatch_size {mbs}")
    # torchtitan splits local_batch_size into micro-batches of pipeline_parallel_microbatch_size; memest's --batch
    # under --pp is one micro-batch (docs/sharding.md: --microbatches micro-batches of --batch)
    put("batch", "parallelism.pipeline_parallel_microbatch_size", mbs, f"batch: {mbs} (one pipeline micro-batch)")
    put("microbatches", "training.local_batch_size", batch // mbs,
        f"microbatches: {batch // mbs} (local_batch_size / pipeline_parallel_microbatch_size)")
    for key in ("layers_per_stage", "schedule_csv"):
        if flat.get(f"parallelism.pipeline_parallel_{key}"):
            cfg.unknown.append(f"parallelism.pipeline_parallel_{key} = {flat[f'parallelism.pipeline_parallel_{key}']!r}")
    cfg.notes.append("pipeline stages split as memest's even split (torchtitan's first/last_stage_less_layers "
                     "are not read)")


def _precision(cfg, get, put, fsdp: bool, tp: int, pp: int) -> None:
    dtype, param = get("training.dtype", "float32"), get("training.mixed_precision_param", "bfloat16")
    if dtype == "bfloat16":
        put("precision", "training.dtype", "bf16", "precision: bf16 (parameters, gradients and optimizer state bf16)")
    elif param == "float32":
        put("precision", "training.mixed_precision_param", "fp32")
    elif fsdp or (tp == 1 and pp == 1):
        how = "FSDP2 MixedPrecisionPolicy" if fsdp else "torch.autocast (DDP / one device)"
        put("precision", "training.mixed_precision_param", "bf16-mixed", f"precision: bf16-mixed ({how})")
    else:
        put("precision", "training.mixed_precision_param", "fp32",
            "precision: fp32 (torchtitan disables mixed precision with TP or PP without FSDP)")


def _accum(cfg, get, batch: int, dp: int | None, where: str) -> int:
    total = get("training.global_batch_size", -1)
    if total is None or total < 0:
        return 1
    if dp is None:
        cfg.notes.append(f"training.global_batch_size {total}: the accumulation steps depend on the launcher's world "
                         "size (data_parallel_shard_degree = -1); give --grad-accum")
        return 1
    if total % (batch * dp):
        raise MemestError(f"{where}training.global_batch_size {total} is not a multiple of local_batch_size {batch} x "
                          f"data-parallel degree {dp}")
    return total // (batch * dp)


def _checkpointing(cfg, get, put, where: str) -> None:
    ac_mode = get("activation_checkpoint.mode", "selective")  # job_config.py default
    option = str(get("activation_checkpoint.selective_ac_option", "2"))
    get("activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns")
    if ac_mode == "none":
        value = "none"
    elif ac_mode == "full":
        value = "blocks"
    elif ac_mode == "selective" and option == "op":
        value = "selective"
    elif ac_mode == "selective" and option.isdigit() and int(option) >= 1:
        value = "blocks" if option == "1" else f"every:{option}"
        if option != "1":  # torchtitan/distributed/activation_checkpoint.py _apply_layer_sac: count % N == 0
            cfg.notes.append(f"selective_ac_option {option}: torchtitan checkpoints layers {option}, {2 * int(option)}, "
                             f"... (1-based), memest's every:{option} layers 1, {int(option) + 1}, ...: the same count "
                             f"when the layer count is a multiple of {option}, one more otherwise (the high side)")
    else:
        raise MemestError(f"{where}activation_checkpoint mode {ac_mode!r} (selective_ac_option {option!r}) is not "
                          "modelled: memest models none, full, selective op and selective N")
    source = "activation_checkpoint.selective_ac_option" if ac_mode == "selective" else "activation_checkpoint.mode"
    put("checkpointing", source, value, f"checkpointing: {value} (mode {ac_mode}"
        + (f", selective_ac_option {option})" if ac_mode == "selective" else ")"))


def _optimizer(cfg, get, put, where: str) -> None:
    name = get("optimizer.name", "AdamW")
    optim = {"AdamW": "adamw", "Adam": "adam"}.get(name)
    if optim is None:
        raise MemestError(f"{where}optimizer.name {name!r}: memest models torchtitan's Adam and AdamW")
    put("optim", "optimizer.name", optim)
    impl = get("optimizer.implementation", "fused")
    if impl == "fused":
        put("fused", "optimizer.implementation", True, "fused: true (fused kernels on CUDA)")
    elif impl == "for-loop":
        cfg.notes.append("optimizer.implementation for-loop: memest traces foreach (its per-step temporaries are "
                         "larger than a for-loop's)")
    if get("optimizer.early_step_in_backward", False):
        put("optim_in_backward", "optimizer.early_step_in_backward", True)

"""accelerate's config YAML (``accelerate config`` output, ~/.cache/huggingface/accelerate/default_config.yaml)
-> memest config keys.

Keys: accelerate 1.15.0 accelerate/commands/config/config_args.py (``ClusterConfig``: distributed_type,
num_processes, mixed_precision, fsdp_config, deepspeed_config, ...) and the FSDP / DeepSpeed plugin keys
``accelerate config`` writes (accelerate/commands/config/cluster.py; examples modelled:
examples/config_yaml_templates/fsdp.yaml and deepspeed.yaml, https://github.com/huggingface/accelerate).
``num_processes`` is the whole world (every machine's processes); ``mixed_precision`` is accelerate's autocast
over the weights as loaded (memest assumes fp32 weights: bf16-mixed / fp16-mixed). The model is not in the file:
give it beside the file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from memest.errors import MemestError
from memest.spec.choices import Shard
from memest.spec.trainers import common
from memest.spec.trainers.base import TrainerConfig

FORMAT = "accelerate"

# keys with no effect on a training step's GPU memory (launcher, network, TPU, state-dict and loading settings)
NEUTRAL = {
    "compute_environment", "machine_rank", "num_machines", "gpu_ids", "main_process_ip", "main_process_port",
    "rdzv_backend", "same_network", "main_training_function", "enable_cpu_affinity", "debug", "downcast_bf16",
    "tpu_name", "tpu_zone", "tpu_use_cluster", "tpu_use_sudo", "command_file", "commands", "tpu_vm", "tpu_env",
    "mpirun_config",
}
FSDP_NEUTRAL = {"auto_wrap_policy", "transformer_layer_cls_to_wrap", "min_num_params", "cpu_ram_efficient_loading",
                "state_dict_type", "sync_module_states", "use_orig_params"}
# FSDP's own prefetch defaults (torch.distributed.fsdp.FullyShardedDataParallel: backward_prefetch=BACKWARD_PRE,
# forward_prefetch=False), read as memest's FSDP2 trace with its default schedule; any other value is unknown
FSDP_AS_TRACED = {"backward_prefetch": "BACKWARD_PRE", "forward_prefetch": False}
DS_NEUTRAL = {"zero3_init_flag", "zero3_save_16bit_model", "deepspeed_multinode_launcher", "deepspeed_hostfile",
              "gradient_clipping", "offload_optimizer_nvme_path", "offload_param_nvme_path"}
# FSDP1 sharding strategies (by name, or the 1-based index accelerate's older configs wrote)
SHARDING = {"FULL_SHARD": "zero3", "SHARD_GRAD_OP": "zero2", "NO_SHARD": "none", "HYBRID_SHARD": "zero3",
            "HYBRID_SHARD_ZERO2": "zero2", "1": "zero3", "2": "zero2", "3": "none", "4": "zero3", "5": "zero2"}
PRECISION = {"no": "fp32", "bf16": "bf16-mixed", "fp16": "fp16-mixed"}
MAPPED = ("distributed_type", "num_processes", "mixed_precision", "fsdp_config", "deepspeed_config", "use_cpu")
PLUGINS = ("fp8_config", "parallelism_config", "megatron_lm_config", "dynamo_config")  # unknown when set


def detect(path, data) -> bool:
    return isinstance(data, dict) and "distributed_type" in data and Path(path).suffix in (".yaml", ".yml")


def read(path, data) -> TrainerConfig:
    cfg = TrainerConfig(format=FORMAT, path=str(path))
    where = f"{path}: "
    used = set(MAPPED)

    def put(key: str, source: str, value: Any, meaning: str = "") -> None:
        cfg.keys[key] = value
        cfg.mapping.append((source, meaning or f"{key}: {value}"))

    kind = str(data.get("distributed_type", "NO")).upper()
    world = data.get("num_processes")
    world = 1 if world is None else world
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:  # "four" was a TypeError, 0 read as 1
        raise MemestError(f"{where}num_processes = {world!r}: a whole number of processes, at least 1")
    if kind not in ("NO", "MULTI_GPU", "FSDP", "DEEPSPEED", "MULTI_CPU"):
        raise MemestError(f"{where}distributed_type {kind!r} is not modelled; memest reads NO, MULTI_GPU, "
                          "MULTI_CPU, FSDP and DEEPSPEED")
    if kind != "NO" and world > 1:
        put("world_size", f"num_processes = {world!r}", world)
    if kind == "MULTI_CPU" or data.get("use_cpu"):
        put("target", f"distributed_type = {kind!r}" if kind == "MULTI_CPU" else "use_cpu = True", "cpu")
    mixed = str(data.get("mixed_precision") or "no").lower()
    if mixed not in PRECISION:
        raise MemestError(f"{where}mixed_precision {mixed!r} is not modelled; memest reads no, bf16 and fp16")
    put("precision", f"mixed_precision = {mixed!r}", PRECISION[mixed],
        f"precision: {PRECISION[mixed]}" + (" (autocast over fp32 weights)" if mixed != "no" else ""))
    if mixed != "no":
        cfg.notes.append(f"mixed_precision {mixed}: memest assumes the model is loaded in fp32 (accelerate autocasts "
                         "the forward and keeps the weights as loaded)")
    if kind == "FSDP":
        _fsdp(cfg, data.get("fsdp_config") or {}, put, data, world)
    elif data.get("fsdp_config"):
        cfg.notes.append(f"fsdp_config ignored: distributed_type is {kind}, not FSDP")
    if kind == "DEEPSPEED":
        _deepspeed(cfg, data.get("deepspeed_config") or {}, put, where)
    elif data.get("deepspeed_config"):
        cfg.notes.append(f"deepspeed_config ignored: distributed_type is {kind}, not DEEPSPEED")
    _leftovers(cfg, data, used)
    cfg.notes.append("an accelerate config does not name the model: give it beside the file")
    return cfg


def _leftovers(cfg, data: dict, used: set) -> None:
    """Plugins memest does not model are unknown when set; every other key is unknown or ignored (neutral)."""
    for key in PLUGINS:
        used.add(key)
        if data.get(key):
            cfg.unknown.append(f"{key} = {data[key]!r}")
    common.leftovers(cfg, data, used, NEUTRAL)


def _fsdp(cfg, conf: dict, put, data: dict, world: int) -> None:
    conf = {k.removeprefix("fsdp_"): v for k, v in conf.items()}
    version = int(conf.get("version", 1))
    strategy = str(conf.get("sharding_strategy", "FULL_SHARD")).upper()
    if version == 2:
        strategy = "FULL_SHARD" if conf.get("reshard_after_forward", True) else "SHARD_GRAD_OP"
    shard = SHARDING.get(strategy)
    if shard is None:
        cfg.unknown.append(f"fsdp_config.fsdp_sharding_strategy = {strategy!r}")
        return
    source = "fsdp_config.fsdp_reshard_after_forward" if version == 2 else "fsdp_config.fsdp_sharding_strategy"
    put("shard", f"{source} = {conf.get('reshard_after_forward' if version == 2 else 'sharding_strategy')!r}", shard,
        f"shard: {shard} (FSDP{version} {strategy})")
    if strategy.startswith("HYBRID") or strategy in ("4", "5"):
        machines = data.get("num_machines") or 1
        put("world_size", f"num_machines = {machines!r}", world // machines,
            f"world_size: {world // machines} (HYBRID_SHARD shards within a machine; one replica estimated)")
        cfg.notes.append("HYBRID_SHARD: each rank holds what FSDP over its machine's ranks holds; the all-reduce "
                         "across machines is not traced")
    if version != 2:
        # accelerate 1.x FullyShardedDataParallelPlugin (utils/dataclasses.py): FSDP1's use_orig_params defaults to False
        orig = str(conf.get("use_orig_params", False)).lower() == "true"
        hybrid = strategy.startswith("HYBRID") or strategy in ("4", "5")
        if not (orig or hybrid):  # NO_SHARD too: FSDP1's flat parameters kept whole, not DDP's buckets
            put("fsdp_version", f"fsdp_config.fsdp_use_orig_params = {conf.get('use_orig_params', False)!r}", "1",
                "fsdp_version: 1 (FSDP1 FullyShardedDataParallel, flat parameters, use_orig_params=False)")
            # accelerate 1.15 FullyShardedDataParallelPlugin.__post_init__ (utils/dataclasses.py): sync_module_states
            # defaults to False for FSDP1 and is set True with cpu_ram_efficient_loading
            key = next((k for k in ("sync_module_states", "cpu_ram_efficient_loading")
                        if str(conf.get(k, False)).lower() == "true"), None)
            if key:
                put("fsdp_sync_module_states", f"fsdp_config.fsdp_{key} = {conf[key]!r}", True,
                    "fsdp_sync_module_states: true (FSDP1 broadcasts rank 0's states while it wraps)")
        elif shard == Shard.NONE:
            cfg.notes.append("FSDP1 NO_SHARD with use_orig_params=True: traced as DDP's full replicas (--fsdp-version "
                             "1 traces FSDP1 with use_orig_params=False)")
        else:
            why = "use_orig_params=True" if orig else "HYBRID_SHARD"
            cfg.notes.append(f"FSDP1 with {why}: traced as FSDP2's per-parameter sharding of the same bytes "
                             "(--fsdp-version 1 traces FSDP1 with use_orig_params=False, no HYBRID_SHARD)")
    if conf.get("offload_params"):
        put("offload", f"fsdp_config.fsdp_offload_params = {conf['offload_params']!r}", "params")
    if conf.get("activation_checkpointing"):
        put("checkpointing", "fsdp_config.fsdp_activation_checkpointing = True", "blocks",
            "checkpointing: blocks (FSDP's checkpoint wrapper on every wrapped block)")
    for key, value in conf.items():
        if key in FSDP_AS_TRACED and value == FSDP_AS_TRACED[key]:
            cfg.mapping.append((f"fsdp_config.fsdp_{key} = {value!r}", "FSDP's default prefetch, as memest traces FSDP2"))
        elif key not in ("version", "sharding_strategy", "reshard_after_forward", "offload_params",
                         "activation_checkpointing") and key not in FSDP_NEUTRAL:
            cfg.unknown.append(f"fsdp_config.fsdp_{key} = {value!r}")


def _deepspeed(cfg, conf: dict, put, where: str) -> None:
    if conf.get("deepspeed_config_file"):
        file = Path(conf["deepspeed_config_file"])
        cfg.includes.append(file if file.is_absolute() else Path(cfg.path).parent / file)
        cfg.mapping.append((f"deepspeed_config.deepspeed_config_file = {str(file)!r}", "read as a DeepSpeed JSON"))
    stage = conf.get("zero_stage")
    if stage is not None:
        if stage not in (0, 1, 2, 3):
            raise MemestError(f"{where}deepspeed_config.zero_stage {stage!r}: DeepSpeed's stages are 0 to 3")
        put("shard", f"deepspeed_config.zero_stage = {stage!r}", "none" if stage == 0 else f"zero{stage}")
    opt, param = str(conf.get("offload_optimizer_device", "none")), str(conf.get("offload_param_device", "none"))
    if param in ("cpu", "nvme"):
        put("offload", f"deepspeed_config.offload_param_device = {param!r}", "params",
            "offload: params (parameters, gradients and optimizer state off the GPU)")
    elif opt in ("cpu", "nvme"):
        put("offload", f"deepspeed_config.offload_optimizer_device = {opt!r}", "optimizer")
    if "nvme" in (opt, param):
        cfg.notes.append("nvme offload: modelled as CPU offload (the GPU side is the same; host memory is not used)")
    accum = conf.get("gradient_accumulation_steps")
    if isinstance(accum, int) and accum > 1:
        put("grad_accum", f"deepspeed_config.gradient_accumulation_steps = {accum}", accum)
    for key, value in conf.items():
        if key not in ("deepspeed_config_file", "zero_stage", "offload_optimizer_device", "offload_param_device",
                       "gradient_accumulation_steps") and key not in DS_NEUTRAL:
            cfg.unknown.append(f"deepspeed_config.{key} = {value!r}")

"""DeepSpeed JSON configs (``--deepspeed ds.json``): ZeRO stage, offload, bf16/fp16, micro-batch, accumulation.

Keys as DeepSpeed documents them (https://www.deepspeed.ai/docs/config-json/; deepspeed/runtime/config.py and
deepspeed/runtime/zero/config.py parse them). ``"auto"`` values are filled by the trainer that launches DeepSpeed
(transformers' integrations/deepspeed.py HfTrainerDeepSpeedConfig): memest leaves them to that file or the flags.
"""

from __future__ import annotations

from pathlib import Path

from memest.errors import MemestError
from memest.spec.trainers.base import TrainerConfig

FORMAT = "deepspeed"
_MARKERS = ("zero_optimization", "train_micro_batch_size_per_gpu", "train_batch_size", "zero_allow_untested_optimizer")
_STAGES = {0: "none", 1: "zero1", 2: "zero2", 3: "zero3"}
# DeepSpeed's optimizer.type names (deepspeed/runtime/config.py: ADAM_OPTIMIZER = "adam", ADAMW_OPTIMIZER = "adamw",
# matched lower-cased); DeepSpeed's Adam is AdamW unless "adam_w_mode": false (deepspeed/ops/adam/fused_adam.py)
_OPTIMIZERS = {"adamw": "adamw", "adam": "adamw", "sgd": "sgd"}
# keys with no effect on the memory of a step (logging, schedules, clipping)
_NO_EFFECT = {"steps_per_print", "wall_clock_breakdown", "scheduler", "prescale_gradients",
              "gradient_predivide_factor", "zero_allow_untested_optimizer", "flops_profiler", "tensorboard", "wandb",
              "csv_monitor", "comms_logger", "dump_state"}
_FP16_NO_EFFECT = {"enabled", "loss_scale", "loss_scale_window", "initial_scale_power", "hysteresis", "min_loss_scale",
                   "auto_cast"}


def detect(path: Path, data) -> bool:
    return isinstance(data, dict) and Path(path).suffix == ".json" and any(k in data for k in _MARKERS)


def _auto(out: TrainerConfig, key: str) -> None:
    out.mapping.append((f"{key} = auto", "left to the trainer that launches DeepSpeed (its own config or the flags)"))


def read(path: Path, data: dict) -> TrainerConfig:
    out = TrainerConfig(format=FORMAT, path=str(path))
    keys = out.keys
    for key, value in data.items():
        if key == "zero_optimization":
            _zero(out, value)
        elif key in ("bf16", "fp16"):
            _half(out, key, value)
        elif key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
            field = "batch" if key.startswith("train_micro") else "grad_accum"
            if value == "auto":
                _auto(out, key)
            else:
                keys[field] = value
                out.mapping.append((f"{key} = {value}", f"{field}: {value}"))
        elif key == "train_batch_size":
            if value == "auto":
                _auto(out, key)
            else:
                out.mapping.append((f"{key} = {value}", "global batch (micro-batch x accumulation x ranks): "
                                                        "world_size derived when both others are given"))
        elif key == "optimizer":
            _optimizer(out, value)
        elif key in _NO_EFFECT:
            out.mapping.append((f"{key}", "no effect on memory (not modelled)"))
        else:
            out.unknown.append(key)
    micro, accum, total = data.get("train_micro_batch_size_per_gpu"), data.get("gradient_accumulation_steps", 1), \
        data.get("train_batch_size")
    if all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (micro, accum, total)):
        if total % (micro * accum):
            raise MemestError(f"{path}: train_batch_size {total} is not train_micro_batch_size_per_gpu {micro} x "
                              f"gradient_accumulation_steps {accum} x ranks (DeepSpeed refuses it too)")
        keys["world_size"] = total // (micro * accum)
        out.mapping.append((f"train_batch_size / (micro x accum) = {keys['world_size']}",
                            f"world_size: {keys['world_size']}"))
    return out


def _zero(out: TrainerConfig, zero) -> None:
    if not isinstance(zero, dict):
        raise MemestError(f"{out.path}: zero_optimization: expected a mapping, got {zero!r}")
    for key, value in zero.items():
        where = f"zero_optimization.{key}"
        if key == "stage":
            if value == "auto":
                _auto(out, where)
            elif value in _STAGES:
                out.keys["shard"] = _STAGES[value]
                out.mapping.append((f"{where} = {value}", f"shard: {_STAGES[value]}"))
            else:
                raise MemestError(f"{out.path}: {where} = {value!r}: DeepSpeed's ZeRO stages are 0, 1, 2 and 3")
        elif key in ("offload_optimizer", "offload_param"):
            device = (value or {}).get("device", "none") if isinstance(value, dict) else value
            what = "optimizer" if key == "offload_optimizer" else "params"
            if device in ("cpu", "nvme"):
                # params offload moves the optimizer too (memest's 'params': both off the GPU)
                if what == "params" or out.keys.get("offload") != "params":
                    out.keys["offload"] = what
                out.mapping.append((f"{where}.device = {device}", f"offload: {out.keys['offload']}"
                                    + (" (nvme: off the GPU as cpu is)" if device == "nvme" else "")))
            elif device in ("none", None):
                out.mapping.append((f"{where}.device = {device}", "no offload"))
            else:
                out.unknown.append(f"{where}.device")
            extra = [k for k in (value or {}) if k != "device"] if isinstance(value, dict) else []
            out.unknown += [f"{where}.{k}" for k in extra if k not in ("pin_memory",)]
        else:
            out.unknown.append(where)  # buckets, prefetch, persistence: DeepSpeed's buffers, not modelled


def _half(out: TrainerConfig, key: str, block) -> None:
    enabled = block.get("enabled", False) if isinstance(block, dict) else block
    if enabled == "auto":
        _auto(out, f"{key}.enabled")
    elif enabled is True:
        # DeepSpeed keeps an fp32 master copy beside the 16-bit weights (its bf16/fp16 optimizers): the
        # per-parameter state is that of fp32 weights with 16-bit compute, memest's -mixed
        out.keys["precision"] = f"{key}-mixed"
        out.mapping.append((f"{key}.enabled = true", f"precision: {key}-mixed"))
        out.notes.append(f"DeepSpeed {key}: 16-bit weights and grads plus an fp32 master copy in the optimizer "
                         f"(deepspeed/runtime/bf16_optimizer.py, fp16/fused_optimizer.py); memest models it as "
                         f"{key}-mixed (fp32 weights, 16-bit activations): the same bytes per parameter with Adam")
    elif enabled is False:
        out.mapping.append((f"{key}.enabled = false", "not this precision"))
    if isinstance(block, dict):
        out.unknown += [f"{key}.{k}" for k in block if k not in _FP16_NO_EFFECT]


def _optimizer(out: TrainerConfig, block) -> None:
    kind = block.get("type") if isinstance(block, dict) else None
    if kind is None or kind == "auto":
        _auto(out, "optimizer.type")
        return
    name = _OPTIMIZERS.get(str(kind).lower())
    if name is None:
        raise MemestError(f"{out.path}: optimizer.type {kind!r} has no memest model; memest models "
                          f"{', '.join(sorted(_OPTIMIZERS))} from a DeepSpeed config (or drop the key and pass --optim)")
    if str(kind).lower() == "adam" and isinstance(block.get("params"), dict) and \
            block["params"].get("adam_w_mode") is False:
        name = "adam"
    out.keys["optim"] = name
    out.mapping.append((f"optimizer.type = {kind}", f"optim: {name}"))

"""What the YAML trainer readers share: the key loop (``read_keys`` over a format's ``KeyTable``), the model key,
the optimizer names, LoRA targets, a DeepSpeed include."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from memest.errors import MemestError
from memest.spec.trainers.base import TrainerConfig

BUNDLED = Path(__file__).resolve().parents[2] / "data" / "models"  # sources/hf.py's BUNDLED (spec/ sits below sources/)


def bundled_names() -> list[str]:
    return sorted(p.stem for p in BUNDLED.glob("*.json"))

# transformers' OptimizerNames (transformers/training_args.py) -> (memest --optim, --fused); axolotl and
# LLaMA-Factory pass these to TrainingArguments.optim
OPTIMIZERS = {
    "adamw_torch": ("adamw", False), "adamw_hf": ("adamw", False), "adamw_torch_fused": ("adamw", True),
    "adamw_apex_fused": ("adamw", True), "adamw_bnb_8bit": ("adam8bit", False), "adamw_8bit": ("adam8bit", False),
    "adam8bit": ("adam8bit", False), "paged_adamw_8bit": ("paged-adamw-8bit", False),
    "paged_adamw_32bit": ("paged-adamw-32bit", False), "adafactor": ("adafactor", False), "sgd": ("sgd", False),
}


def model(out: TrainerConfig, key: str, value, config_path: Path) -> None:
    """``value``: a hub id, a local folder or config.json: memest has no network, so a local config or a
    bundled name, else refused with the fix."""
    name = str(value)
    local = Path(name) if Path(name).is_absolute() else Path(config_path).parent / name
    for candidate in (local, local / "config.json"):
        if candidate.is_file():
            shown = _shown(candidate)
            out.keys["model"] = f"hf:{shown}"
            out.mapping.append((f"{key} = {name}", f"model: hf:{shown}"))
            return
    short = name.rstrip("/").rsplit("/", 1)[-1].lower()
    if short in bundled_names() or name in bundled_names():
        bundled = name if name in bundled_names() else short
        out.keys["model"] = f"hf:{bundled}"
        out.mapping.append((f"{key} = {name}", f"model: hf:{bundled} (memest's bundled config)"))
        return
    raise MemestError(f"{config_path}: {key} = {name!r}: memest reads no network; download its config.json and "
                      f"point {key} at that folder or file, or pass the model on the command line "
                      "(memest estimate hf:path/config.json --from FILE)")


def _shown(path: Path) -> str:
    """A path relative to the working directory when it lies under it (reports name nothing of this machine),
    else absolute."""
    import os

    relative = os.path.relpath(path.resolve())
    return relative if not relative.startswith("..") else str(path.resolve())


def optimizer(out: TrainerConfig, key: str, value) -> None:
    found = OPTIMIZERS.get(str(value))
    if found is None:
        raise MemestError(f"{out.path}: {key} = {value!r} has no memest model; memest reads "
                          f"{', '.join(OPTIMIZERS)} (or pass --optim beside --from)")
    optim, fused = found
    out.keys["optim"] = optim
    out.mapping.append((f"{key} = {value}", f"optim: {optim}" + (", fused: true" if fused else "")))
    if fused:
        out.keys["fused"] = True


def deepspeed(out: TrainerConfig, key: str, value, config_path: Path) -> None:
    if not isinstance(value, str):  # an inline mapping was printed as a missing file's name
        raise MemestError(f"{config_path}: {key}: expected the path of a DeepSpeed JSON, got {value!r}; write the "
                          "mapping to a .json file beside the config and name it")
    path = Path(str(value))
    path = path if path.is_absolute() else Path(config_path).parent / path
    if not path.is_file():
        raise MemestError(f"{config_path}: {key} = {value!r}: no such file beside the config ({path})")
    out.includes.append(path)
    out.mapping.append((f"{key} = {value}", f"read {path.name} (DeepSpeed: shard, offload, precision)"))


def lora_targets(value, where: str = "") -> list[str] | str:
    """Module names (a list or a comma-separated string) or all-linear; ``where`` ("FILE: key: ") names the key
    in the one-line error for anything else."""
    if value in ("all-linear", "all"):
        return "all-linear"
    if isinstance(value, str):
        return [t.strip() for t in value.split(",") if t.strip()]
    if isinstance(value, list) and all(isinstance(t, str) for t in value):
        return list(value)
    raise MemestError(f"{where}expected module names (a list or a comma-separated string) or "
                      f"all-linear, got {value!r}")


def switch(value, path, key) -> bool:
    """A trainer config's true/false key, never a string or number read as truthy (``gradient_checkpointing:
    sometimes`` would otherwise turn checkpointing on silently)."""
    if not isinstance(value, bool):
        raise MemestError(f"{path}: {key} = {value!r}: expected true or false")
    return value


def one_half(data: dict, path) -> None:
    """bf16 and fp16 both true: the trainer refuses it (transformers' TrainingArguments: 'At most one of fp16 and
    bf16 can be True'); memest would otherwise keep whichever key comes last."""
    if data.get("bf16") is True and data.get("fp16") is True:
        raise MemestError(f"{path}: bf16 and fp16 are both true; set one of them")


def leftovers(cfg: TrainerConfig, data: dict, used: set, neutral) -> None:
    """The keys a reader did not map: memory-neutral ones noted as ignored, every other one reported unknown."""
    for key in data:
        if key not in used and key not in neutral:
            cfg.unknown.append(f"{key} = {data[key]!r}")
    ignored = sorted(k for k in data if k not in used and k in neutral)
    if ignored:
        cfg.notes.append(f"ignored: no memory effect: {', '.join(ignored)}")


# a key's handler: (out, key, value, config path, the whole file, the LoRA fields read so far) -> None
Handler = Callable[[TrainerConfig, str, object, Path, dict, dict], None]


@dataclass
class KeyTable:
    """One YAML format's keys (axolotl.py, llamafactory.py): ``simple`` source key -> memest key, taken as is;
    ``lora`` source key -> memest's lora field; ``handlers`` key -> Handler; ``no_effect``: keys listed as such."""

    simple: dict[str, str]
    lora: dict[str, str]
    handlers: dict[str, Handler] = field(default_factory=dict)
    no_effect: set[str] = field(default_factory=set)


def read_keys(out: TrainerConfig, data: dict, path: Path, table: KeyTable) -> dict:
    """Every key of ``data`` through ``table``, in the file's order: an empty key is the trainer's default, a key
    no row names is unknown. Returns the LoRA fields read (memest's lora mapping)."""
    lora: dict = {}
    for key, value in data.items():
        said = f"{key} = {value}"
        if value is None:  # `key:` with no value: the trainer's default
            out.mapping.append((f"{key} (empty)", "the trainer's default"))
        elif key in table.simple:
            out.keys[table.simple[key]] = value
            out.mapping.append((said, f"{table.simple[key]}: {value}"))
        elif key in table.lora:
            lora[table.lora[key]] = value
            out.mapping.append((said, f"lora {table.lora[key]}: {value}"))
        elif key in table.handlers:
            table.handlers[key](out, key, value, path, data, lora)
        elif key in table.no_effect:
            out.mapping.append((key, "no effect on memory (not modelled)"))
        else:
            out.unknown.append(key)
    return lora

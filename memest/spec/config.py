"""YAML run configs for `memest check` (and any command that takes a config).

    # configs/gpt2-finetune-11gb.yaml
    model: hf:gpt2            # model.py[:factory] or hf:path/config.json (relative to this file), or hf:NAME
    batch: 4
    seq: 1024
    optim: adamw
    precision: bf16-mixed
    grad_accum: 8
    checkpointing: blocks
    outputs: freed            # the loop drops the output before backward (HF Trainer); default kept (plain loop)
    lora: {r: 16, alpha: 32, dropout: 0.05, targets: [q_proj, k_proj, v_proj, o_proj]}  # peft LoRA (or all-linear)
    quant: nf4                # QLoRA: the base's linear weights as bitsandbytes stores them (with lora:)
    freeze: model.embed_tokens  # parameters frozen by name (glob patterns, comma-separated)
    compile: true             # torch.compile the step (Inductor); false: trace a self-compiling model file eager
    gpu: 11GB                 # budget: size (GB = 10^9 B, GiB = 2^30 B), card name, or device index
    margin: 10%               # required headroom: needed x (1 + margin) must fit
    calibration: profiles/rtx2080ti.json  # a `memest calibrate --out` profile (relative to this file)
    from: axolotl.yml         # a trainer config (axolotl, LLaMA-Factory, DeepSpeed JSON, ...; relative to this
                              # file): its keys first, this file's keys override (spec/trainers)

Keys are RunSpec's fields plus ``gpu``, ``margin``, ``name`` and ``calibration``; unknown keys are rejected with a
did-you-mean; CLI flags override the file's values.

A ``serve:`` mapping makes the config a serving config (memest serve's options; ``check`` gates it: it passes
when the engine starts and, with ``min_concurrency``, holds that many full-length sequences at once; tight when
that holds with the expected costs only, not at the high end of their ranges). ``non_torch_memory`` (GiB) is a
measured non-torch figure (the user's own vLLM log), and the config's ``calibration:`` profile applies too:

    model: hf:llama-3-8b
    gpu: h100
    serve: {max_model_len: 8192, gpu_memory_utilization: 0.9, tp: 1, kv_dtype: auto, min_concurrency: 32,
            non_torch_memory: 0.16}

A ``colocate:`` mapping on a training config adds a vLLM rollout engine on the same GPU (trl GRPO colocate):
``{utilization: 0.3, max_model_len: 768, max_num_seqs: 8, tp: 1}``.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from memest.errors import MemestError
from memest.spec import options
from memest.spec.choices import Choice, CudaGraphs, Engine, KvDtype
from memest.spec.lora import freeze_patterns
from memest.spec.run import RunSpec
from memest.spec.trainers.base import TrainerConfig
from memest.spec.trainers.load import read_trainer_config
from memest.spec.yaml_keys import UniqueKeyLoader

SPEC_KEYS = sorted(options.spec_options())  # every RunSpec field a user sets (spec/options.py)
EXTRA_KEYS = ("gpu", "margin", "name", "calibration", "serve", "colocate", "from")
SERVE_KEYS = options.serve_keys()
COLOCATE_KEYS = {"utilization": float, "max_model_len": int, "max_num_seqs": int, "tp": int, "non_torch_memory": float}
ALL_KEYS = SPEC_KEYS + list(EXTRA_KEYS)


@dataclass
class RunConfig:
    name: str
    path: str  # the file it came from ('' for flags only)
    values: dict[str, Any]  # RunSpec fields
    gpu: str | None = None
    margin: float = 0.0
    calibration: str | None = None  # a calibration profile file (memest calibrate --out)
    serve: dict | None = None  # a serving config (memest serve's options + min_concurrency)
    colocate: dict | None = None  # a rollout engine beside the training step
    trainer: object | None = None  # the TrainerConfig a `from:` trainer config gave (spec/trainers)

    def spec(self, **overrides) -> RunSpec:
        return RunSpec(**{**self.values, **{k: v for k, v in overrides.items() if v is not None}})


def parse_margin(value: Any, what: str = "margin") -> float:
    """Required headroom: '10%' or a fraction 0.1 -> 0.1. A bare number of 1 or more is ambiguous (10 could
    mean 10% or x11, 1 could mean 1% or +100%) and is rejected with the fix."""
    if isinstance(value, bool):
        raise MemestError(f"{what} {value!r} is not a number; write a percentage such as 10%")
    text = str(value).strip()
    percent = text.endswith("%")
    try:
        margin = float(text[:-1].strip()) / 100 if percent else float(text)
    except ValueError:
        raise MemestError(f"{what} {value!r} is not a number; write a percentage such as 10%") from None
    if margin != margin or margin in (float("inf"), float("-inf")):
        raise MemestError(f"{what} {value!r} is not a finite number; write a percentage such as 10%")
    if margin < 0:
        raise MemestError(f"{what} {value!r} is below zero; write 0% or more")
    if not percent and margin >= 1:  # a bare 1 reads as +100% or as 1%: as ambiguous as a bare 10
        whole = f"{margin:g}"
        raise MemestError(
            f"{what} {value!r} is ambiguous: write {whole}% for {whole} percent, or {margin / 100:g} as a fraction "
            "(a bare number is a fraction below 1: 0.1 = 10%)"
        )
    return margin


def load_config(path: str | Path) -> RunConfig:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise MemestError(f"config {str(path)!r} not found or unreadable ({exc.strerror}); pass a YAML run config") from exc
    except UnicodeDecodeError as exc:
        raise MemestError(f"{path}: not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset {exc.start}); "
                          "save the config as UTF-8") from None
    try:
        data = yaml.load(text, Loader=UniqueKeyLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise MemestError(f"{path}: malformed YAML{where}: {getattr(exc, 'problem', exc)}") from exc
    if data is None:
        raise MemestError(f"{path}: empty config; it needs at least `model:` (see configs/ for examples)")
    if not isinstance(data, dict):
        raise MemestError(f"{path}: a run config is a mapping of keys (model:, batch:, ...), not {type(data).__name__}")
    return config_from_dict(data, path)


def config_from_dict(data: dict, path: str | Path = "", given: Iterable[str] = ()) -> RunConfig:
    """A run config from its YAML mapping, every value checked; an error names the YAML key the user wrote
    (``pp_split:``, ``lora:``), never the CLI flag of the same option (issue 22); the options in ``given`` (flags or
    keywords the user set beside the file, --from) keep their flag: they are not the file's (battery 31 #66, #68)."""
    try:
        return _from_dict(data, path)
    except MemestError as exc:
        raise type(exc)(options.as_yaml_keys(str(exc), keep=given)) from None


def _from_dict(data: dict, path: str | Path = "") -> RunConfig:
    where = f"{path}: " if path else ""
    trainer = None
    if data.get("from") is not None:  # a trainer config (axolotl, DeepSpeed, ...): its keys, this file's win
        trainer = _from_key(data["from"], path, where)
        data = {**trainer.keys, **{k: v for k, v in data.items() if k != "from"}}
    for key in data:
        if key not in ALL_KEYS:
            close = difflib.get_close_matches(str(key), ALL_KEYS, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"known keys: {', '.join(ALL_KEYS)}"
            raise MemestError(f"{where}unknown key {key!r}; {hint}")
    if data.get("model") is None:  # absent, or `model:` with no value (YAML null)
        raise MemestError(f"{where}no `model:`; give a model file, hf:NAME or hf:path/config.json")
    values: dict[str, Any] = {}
    for key in SPEC_KEYS:
        if key in data and data[key] is not None:
            values[key] = _typed(key, data[key], where)
    values["model"] = _relative_to(str(values["model"]), path)
    margin = parse_margin(data["margin"], f"{where}margin:") if data.get("margin") is not None else 0.0
    gpu = str(data["gpu"]) if data.get("gpu") is not None else None
    name = str(data.get("name") or (Path(path).stem if path else values["model"]))
    calibration = None
    if data.get("calibration") is not None:
        calibration = str(data["calibration"])
        beside = Path(path).parent / calibration if path else None
        if beside is not None and not Path(calibration).is_absolute() and beside.exists():
            calibration = str(beside.resolve())
    try:
        RunSpec(**values)  # every value checked now (choices, ranges), with the file named
    except MemestError as exc:
        raise MemestError(f"{where}{exc}") from None
    serve = _block(data, "serve", SERVE_KEYS, where)
    colocate = _block(data, "colocate", COLOCATE_KEYS, where)
    if serve is not None:
        _serve_choices(serve, where)
        if serve.get("min_concurrency") is not None and serve["min_concurrency"] < 1:
            raise MemestError(f"{where}serve.min_concurrency: full-length sequences that must fit at once, at least 1; "
                              f"got {serve['min_concurrency']}")
        ignored = [k for k in data if (k in SPEC_KEYS and k != "model" or k == "colocate") and data[k] is not None]
        if ignored:
            raise MemestError(f"{where}a serving config (serve:) sizes the engine from model: and serve: only; "
                              f"{', '.join(repr(k) for k in ignored)} would be ignored: drop it, or put training keys in "
                              "a config without serve:")
        if not values["model"].startswith("hf:"):
            raise MemestError(f"{where}serve: needs an hf: model (a decoder LM config), not {values['model']!r}")
    return RunConfig(name=name, path=str(path), values=values, gpu=gpu, margin=margin, calibration=calibration,
                     serve=serve, colocate=colocate, trainer=trainer)


def _from_key(value: Any, path: str | Path, where: str) -> TrainerConfig:
    """``from: FILE`` read beside the config; its errors name the key, not the --from flag."""
    if not isinstance(value, str):
        raise MemestError(f"{where}from: expected the path of a trainer config, got {value!r}")
    source = Path(value)
    try:
        return read_trainer_config(source if source.is_absolute() or not path else Path(path).parent / source)
    except MemestError as exc:  # the reader speaks of --from; here the user wrote `from:`
        raise MemestError(where + str(exc).replace("--from ", "from: ", 1)) from None


def _block(data: dict, key: str, schema: dict, where: str) -> dict | None:
    """A nested mapping (serve:, colocate:): known keys, each of its type."""
    if data.get(key) is None:
        return None
    block = data[key]
    if not isinstance(block, dict):
        raise MemestError(f"{where}{key}: expected a mapping of {', '.join(schema)}, got {block!r}")
    out = {}
    for k, v in block.items():
        if k not in schema:
            close = difflib.get_close_matches(str(k), list(schema), n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"known keys: {', '.join(schema)}"
            raise MemestError(f"{where}{key}: unknown key {k!r}; {hint}")
        kind = schema[k]
        if isinstance(v, bool) or (kind is int and not isinstance(v, int)) or \
                (kind is float and not isinstance(v, (int, float))):
            raise MemestError(f"{where}{key}.{k}: expected a {'whole number' if kind is int else 'number'}, got {v!r}")
        out[k] = kind(v)
    return out


def _serve_choices(block: dict, where: str) -> None:

    try:
        for k, cls in (("engine", Engine), ("kv_dtype", KvDtype), ("cuda_graphs", CudaGraphs)):
            if k in block:
                block[k] = str(cls.parse(block[k], f"serve.{k}"))
    except MemestError as exc:
        raise MemestError(f"{where}{exc}") from None


def _relative_to(model: str, config_path: str | Path) -> str:
    """Model files and hf: config paths named in a config are relative to the config's folder (a bundled name
    or a hub id is left alone unless a config.json by that path lies beside the config)."""
    if not config_path:
        return model
    if model.startswith("hf:"):
        name = model[3:]
        candidate = Path(config_path).parent / name
        found = candidate.is_file() if name.endswith(".json") else (candidate / "config.json").is_file()
        return f"hf:{candidate.resolve()}" if name and not Path(name).is_absolute() and found else model
    file, sep, factory = model.rpartition(":")
    if not (sep and file.endswith(".py") and factory.isidentifier()):
        file, sep, factory = model, "", ""
    candidate = Path(config_path).parent / file
    if not Path(file).is_absolute() and candidate.exists():
        return str(candidate.resolve()) + sep + factory
    return model


def _typed(key: str, value: Any, where: str) -> Any:
    if key == "lora" and isinstance(value, (dict, bool)):
        return value  # a mapping (r:, alpha:, dropout:, targets:) or true (peft's defaults); RunSpec parses it
    if key == "freeze" and isinstance(value, (list, tuple, dict)):
        try:
            return ",".join(freeze_patterns(value))
        except MemestError as exc:
            raise MemestError(f"{where}{exc}") from None
    if key == "pp_split" and isinstance(value, (list, tuple)):  # [16, 16]: the flag's "16,16"
        if not value or any(isinstance(c, bool) or not isinstance(c, int) for c in value):
            raise MemestError(f"{where}pp_split: expected whole layer counts, one per stage (e.g. [16, 16] or 16,16), "
                              f"got {value!r}")
        return ",".join(str(c) for c in value)
    kind = options.yaml_kind(key)
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise MemestError(f"{where}{key}: expected a whole number, got {value!r}")
        return value
    if kind is bool:
        if not isinstance(value, bool):
            raise MemestError(f"{where}{key}: expected true or false, got {value!r}")
        return value
    return str(value)


def spec_from_trainer(path: str | Path, flags: dict, given: set[str], drop: tuple[str, ...] = (),
                      command: str = "estimate") -> tuple[TrainerConfig, dict]:
    """``--from FILE`` beside a command's flags: the file's keys checked as a memest config (spec/config.py's
    config_from_dict), the flags the user gave (``given``) over them, the other flags' defaults under them.
    ``drop``: keys the command sets itself (plan-parallel's searched layout): the file's values are not used, and
    a note says so. Returns the TrainerConfig and the RunSpec fields."""
    trainer = read_trainer_config(path)
    data = dict(trainer.keys)
    dropped = [f"{key}: {data.pop(key)}" for key in drop if key in data]
    if dropped:
        trainer.notes.append(f"{command} searches the layout itself: the file's {', '.join(dropped)} not used")
    for name in given:
        if name in flags and flags[name] is not None:
            data[name] = str(flags[name]) if isinstance(flags[name], Choice) else flags[name]
    if data.get("model") is None:
        why = f" ({trainer.no_model})" if trainer.no_model else ""
        raise MemestError(f"--from {path}: the file names no model memest can read{why}; pass one (memest {command} "
                          "hf:path/config.json --from FILE)")
    config = config_from_dict(data, path, given={name for name in given if name != "model"})
    values = dict(config.values)
    if "model" in given and flags.get("model"):
        values["model"] = flags["model"]  # the command line's own path, not resolved beside the file
    return trainer, {name: values.get(name, value) for name, value in flags.items()}

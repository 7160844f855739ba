"""``--from FILE``: parse a trainer config (JSON/YAML/TOML by suffix), find its reader (READERS' detect, in
order), read it and the files it includes, and merge into one TrainerConfig whose ``keys`` are memest config keys.
"""

from __future__ import annotations

import json
from pathlib import Path

import tomllib
import yaml

from memest.errors import MemestError
from memest.spec.trainers import READERS
from memest.spec.trainers.base import TrainerConfig
from memest.spec.yaml_keys import UniqueKeyLoader


def parse(path: Path, label: str = ""):
    """The parsed file: a mapping from JSON, YAML or TOML (by suffix); None for other suffixes (a reader
    that parses its own files, e.g. a Python file, detects it by its path). ``label``: how errors name the file
    (default ``--from PATH``; an include names the user's --from too)."""
    label = label or f"--from {path}"
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        where = f"--from {str(path)!r}" if label == f"--from {path}" else label
        raise MemestError(f"{where}: not found or unreadable ({exc.strerror})") from None
    except UnicodeDecodeError:
        raise MemestError(f"{label}: not UTF-8 text") from None
    suffix = path.suffix.lower()
    try:
        if suffix == ".json":
            return json.loads(text, object_pairs_hook=_unique_keys(label))
        if suffix in (".yml", ".yaml"):
            return yaml.load(text, Loader=UniqueKeyLoader)
        if suffix == ".toml":
            return tomllib.loads(text)
    except (json.JSONDecodeError, yaml.YAMLError, tomllib.TOMLDecodeError) as exc:
        raise MemestError(f"{label}: malformed {suffix[1:].upper()}: {_one_line(exc)}") from None
    return None


def _unique_keys(label: str):
    """json's object_pairs_hook: a key given twice is refused, as the YAML loader refuses it (json keeps the last
    value silently)."""
    def pairs(items: list) -> dict:
        seen: dict = {}
        for key, value in items:
            if key in seen:
                raise MemestError(f"{label}: key {key!r} is given twice (JSON would keep the last silently)")
            seen[key] = value
        return seen
    return pairs


def _one_line(exc: Exception) -> str:
    """A parser's error in one line: YAML's problem and where (its multi-line snippet dropped)."""
    mark = getattr(exc, "problem_mark", None)
    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem:
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        return f"{exc.context + ': ' if exc.context else ''}{exc.problem}{where}"
    return " ".join(str(exc).split())


def read_trainer_config(path: str | Path, _seen: tuple = (), _root: str = "") -> TrainerConfig:
    """The file's TrainerConfig, its includes merged in (the including file's keys win); exit-2 error naming
    the known formats when no reader claims it. An error in an include names it and the user's --from file."""
    path = Path(path)
    included = _root and path.resolve() != Path(_root).resolve()
    label = f"{path} (included by --from {_root})" if included else f"--from {path}"
    if path.resolve() in _seen:
        raise MemestError(f"{label}: includes itself (through {', '.join(str(p) for p in _seen)})")
    data = parse(path, label)
    reader = next((r for r in READERS if r.detect(path, data)), None)
    if reader is None:
        if isinstance(data, dict) and "base_model" not in data and {"micro_batch_size", "sequence_len"} & set(data):
            raise MemestError(f"{label}: an axolotl config without base_model: add it (a local config.json "
                              "or a bundled name), memest reads the model from it")
        known = ", ".join(r.FORMAT for r in READERS)
        raise MemestError(f"{label}: not a trainer config memest reads (known formats: {known}); "
                          "pass memest flags instead, or a memest YAML config to `memest check`")
    out = reader.read(path, data)
    for include in out.includes:
        inner = read_trainer_config(include, (*_seen, path.resolve()), _root or str(path))
        out.keys = {**inner.keys, **out.keys}
        out.mapping += [(f"{Path(include).name}: {src}", meaning) for src, meaning in inner.mapping]
        out.unknown += [f"{Path(include).name}: {key}" for key in inner.unknown]
        out.notes += inner.notes
    return out


def as_dict(config: TrainerConfig) -> dict:
    """The JSON form (the estimate document's ``from``)."""
    return {"format": config.format, "path": config.path, "keys": config.keys,
            "mapping": [{"source": s, "memest": m} for s, m in config.mapping],
            "unknown": config.unknown, "notes": config.notes, "includes": [str(p) for p in config.includes]}


def lines(config: TrainerConfig) -> list[str]:
    """The mapping as text lines (the table and Markdown reports)."""
    out = [f"from {config.path} ({config.format}):"]
    out += [f"  {source} -> {meaning}" for source, meaning in config.mapping]
    out += [f"  note: {note}" for note in config.notes]
    out.append(f"  not understood ({len(config.unknown)}): {', '.join(config.unknown)}" if config.unknown
               else "  not understood: none")
    return out


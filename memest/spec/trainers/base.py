"""What a trainer-config reader returns (spec/trainers/__init__.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class TrainerConfig:
    format: str  # the reader's FORMAT: 'axolotl', 'deepspeed', 'torchtitan', ...
    path: str  # the file read
    keys: dict[str, Any] = field(default_factory=dict)  # memest config keys (spec/config.py ALL_KEYS) -> value
    mapping: list[tuple[str, str]] = field(default_factory=list)  # (source key = value, what memest made of it)
    unknown: list[str] = field(default_factory=list)  # source keys memest did not understand: reported, never dropped
    notes: list[str] = field(default_factory=list)  # what the trainer really does that memest assumed or models
    includes: list[Path] = field(default_factory=list)  # files this one points to (e.g. a DeepSpeed JSON), read too
    no_model: str = ""  # why the file names no model memest can read (a script's several or unreadable ones)

"""Trainer configs users already have (issue 25: ``--from FILE``): one reader module per format turns a file
into memest config keys (spec/config.py's keys), the mapping it used and every key it did not understand.

A reader module exposes ``FORMAT`` (its name), ``detect(path, data) -> bool`` (is this file mine?) and
``read(path, data) -> TrainerConfig``. ``data`` is the parsed file (JSON/YAML/TOML), or None for a file the
reader parses itself. READERS lists the modules; base.py holds the shared types."""

from memest.spec.trainers import (
    accelerate_config,
    axolotl,
    deepspeed,
    llamafactory,
    torchtitan,
    training_args,
    training_script,
)
from memest.spec.trainers.base import TrainerConfig

READERS: list = [axolotl, llamafactory, deepspeed, torchtitan, training_args, accelerate_config, training_script]  # detection order

__all__ = ["READERS", "TrainerConfig"]

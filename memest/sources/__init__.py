"""Where models come from. Every source yields a :class:`ModelSource`."""

from __future__ import annotations

from memest.sources.base import ModelSource
from memest.sources.hf import load_hf_source
from memest.sources.model_file import load_model_file


def load_source(ref: str) -> ModelSource:
    """``hf:NAME``, ``hf:path/config.json``, ``path/model.py`` or ``path/model.py:factory``."""
    if ref.startswith("hf:"):

        return load_hf_source(ref[3:])

    return load_model_file(ref)


__all__ = ["ModelSource", "load_source"]

"""The transformers config of an hf: model, and its build on the meta device (no memory), for the serving
engines' weights and KV arithmetic."""

from __future__ import annotations

import contextlib
import sys

from memest.errors import MemestError


def load_config(model: str):
    """The transformers config of an hf: reference, without building the model (imports with the garbage
    collector paused, as load_hf_source does)."""
    if not model.startswith("hf:"):
        raise MemestError(f"memest serve takes an hf: model (hf:NAME, hf:path/config.json, hf:org/name), not {model!r}")
    from memest.trace.step import imports_without_gc  # memest.trace imports torch: only when a config is read

    name = model[3:]
    with contextlib.nullcontext() if "transformers" in sys.modules else imports_without_gc():
        import transformers

        from memest.sources.hf import _config_path, _from_file, _from_hub

        transformers.logging.set_verbosity_error()
        path = _config_path(name)
        return _from_file(transformers, path) if path is not None else _from_hub(transformers, name)


def build_meta(config):
    """The model of ``config`` on the meta device."""
    import torch
    import transformers

    arch = (getattr(config, "architectures", None) or [None])[0]
    cls = getattr(transformers, arch, None) if arch else None
    if cls is None:
        cls = transformers.AutoModelForCausalLM._model_mapping[type(config)]
    with torch.device("meta"):
        return cls(config)

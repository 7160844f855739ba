"""The serving engines memest knows, keyed by the --engine choice. A new engine: its module (a ServeEngine
subclass, serve/engine.py) and one line here."""

from __future__ import annotations

from memest.errors import MemestError
from memest.serve.engine import ServeEngine
from memest.serve.sglang import SglangEngine
from memest.serve.vllm import VllmEngine
from memest.spec.choices import Engine

ENGINES: dict[str, type[ServeEngine]] = {
    Engine.VLLM: VllmEngine,
    Engine.SGLANG: SglangEngine,
}


def engine_for(name: str) -> type[ServeEngine]:
    """The engine registered under ``name`` (an Engine member or its value)."""
    try:
        return ENGINES[name]
    except KeyError:
        raise MemestError(f"unknown serving engine {name!r}; choose one of: {', '.join(map(str, ENGINES))}") from None

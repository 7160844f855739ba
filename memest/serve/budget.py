"""One term of a serving engine's memory budget: expected bytes with a low-high range and where the number
comes from. Each engine's own arithmetic lives in its module (serve/vllm.py, serve/sglang.py)."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Part:
    """One term of the budget: expected bytes with a low-high range and where the number comes from."""

    name: str
    bytes: int
    low: int
    high: int
    source: str

    @classmethod
    def exact(cls, name: str, value: int, source: str) -> Part:
        return cls(name, int(value), int(value), int(value), source)

    def to_dict(self) -> dict:
        return asdict(self)

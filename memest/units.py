"""Byte counts: ints inside, binary units (GiB, MiB) at the edges.

Budget strings accept decimal (``GB`` = 10**9) and binary (``GiB`` = 2**30) suffixes; card names
are resolved by :mod:`memest.device.catalogue`.
"""

from __future__ import annotations

import re

from memest.errors import MemestError

KiB = 2**10
MiB = 2**20
GiB = 2**30

_SUFFIXES = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_PATTERN = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str) -> int:
    """Parse ``11GB`` (10**9), ``11GiB`` (2**30), ``11000MiB`` or a plain byte count."""
    if text.strip().startswith("-"):
        raise MemestError(f"memory size {text!r} is below zero; use a positive size such as 11GB")
    match = _PATTERN.match(text)
    if not match or match.group(2).lower() not in _SUFFIXES:
        raise MemestError(
            f"cannot read {text!r} as a memory size; use a number with a unit such as 11GB (10^9 bytes), "
            "11GiB (2^30 bytes) or 11000MiB"
        )
    return int(float(match.group(1)) * _SUFFIXES[match.group(2).lower()])


def format_bytes(n: int | float, precision: int = 2) -> str:
    """Binary units, labelled as such: 1536 -> '1.50 KiB'."""
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{sign}{n / size:.{precision}f} {unit}"
    return f"{sign}{int(n)} B"


def plural(n: int, word: str, many: str | None = None) -> str:
    """'1 GPU', '8 GPUs', '1 trace', '2 traces'."""
    return f"{n} {word if n == 1 else (many or word + 's')}"


def format_count(n: int) -> str:
    """Parameter counts: 124439808 -> '124.4M'."""
    for unit, size in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


_UNITS = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("B", 1))


def table_unit(values) -> tuple[str, int]:
    """One binary unit for a whole table: the largest that the biggest value reaches."""
    top = max((abs(v) for v in values if v is not None), default=0)
    for unit, size in _UNITS:
        if top >= size:
            return unit, size
    return "B", 1


def format_in(n: int | float, unit: tuple[str, int], precision: int = 2) -> str:
    """``n`` bytes in a given unit from ``table_unit``: (GiB, 2**30) -> '0.45 GiB'."""
    name, size = unit
    return f"{int(n)} B" if size == 1 else f"{n / size:.{precision}f} {name}"


def format_bound(n: int | None, precision: int = 2) -> str:
    """An upper bound that may be unbounded (None)."""
    return "unbounded" if n is None else format_bytes(n, precision)

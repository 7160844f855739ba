"""Known cards and their memory, for ``--gpu rtx2080ti``.

Nominal memory as the vendor sells it (binary units for all of these cards). The driver keeps a
little for itself, so ``memest gpus`` shows a slightly smaller total on the real card.
"""

from __future__ import annotations

GiB = 2**30

CARDS: dict[str, int] = {
    "gtx1080ti": 11 * GiB,
    "rtx2080ti": 11 * GiB,
    "rtx3060": 12 * GiB,
    "rtx3080": 10 * GiB,
    "rtx3090": 24 * GiB,
    "rtx4080": 16 * GiB,
    "rtx4090": 24 * GiB,
    "rtx5090": 32 * GiB,
    "t4": 16 * GiB,
    "v100-16gb": 16 * GiB,
    "v100": 32 * GiB,
    "v100-32gb": 32 * GiB,
    "a10": 24 * GiB,
    "a10g": 24 * GiB,
    "l4": 24 * GiB,
    "a100-40gb": 40 * GiB,
    "a100": 80 * GiB,
    "a100-80gb": 80 * GiB,
    "a6000": 48 * GiB,
    "l40s": 48 * GiB,
    "h100": 80 * GiB,
    "h100-80gb": 80 * GiB,
    "h200": 141 * 10**9,  # sold as 141 GB (HBM3e)
}


def normalise(name: str) -> str:
    return name.lower().replace(" ", "").replace("_", "").replace("geforce", "").replace("nvidia", "")


def card_bytes(name: str) -> int | None:
    return CARDS.get(normalise(name))

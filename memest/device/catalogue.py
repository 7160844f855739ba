"""Known cards and their memory, for ``--gpu rtx2080ti``.

Nominal memory as the vendor sells it (binary units for all of these cards). The driver keeps a
little for itself, so ``memest gpus`` shows a slightly smaller total on the real card.
"""

from __future__ import annotations

from memest.units import GiB

# name -> (nominal memory bytes, CUDA compute capability)
CARDS: dict[str, tuple[int, tuple[int, int]]] = {
    "gtx1080ti": (11 * GiB, (6, 1)),
    "rtx2080ti": (11 * GiB, (7, 5)),
    "rtx3060": (12 * GiB, (8, 6)),
    "rtx3080": (10 * GiB, (8, 6)),
    "rtx3090": (24 * GiB, (8, 6)),
    "rtx4080": (16 * GiB, (8, 9)),
    "rtx4090": (24 * GiB, (8, 9)),
    "rtx5090": (32 * GiB, (12, 0)),
    "t4": (16 * GiB, (7, 5)),
    "v100-16gb": (16 * GiB, (7, 0)),
    "v100": (32 * GiB, (7, 0)),
    "v100-32gb": (32 * GiB, (7, 0)),
    "a10": (24 * GiB, (8, 6)),
    "a10g": (24 * GiB, (8, 6)),
    "l4": (24 * GiB, (8, 9)),
    "a100-40gb": (40 * GiB, (8, 0)),
    "a100": (80 * GiB, (8, 0)),
    "a100-80gb": (80 * GiB, (8, 0)),
    "a6000": (48 * GiB, (8, 6)),
    "l40s": (48 * GiB, (8, 9)),
    "h100": (80 * GiB, (9, 0)),
    "h100-80gb": (80 * GiB, (9, 0)),
    "h200": (141 * 10**9, (9, 0)),  # sold as 141 GB (HBM3e)
    # sold as 180 GB of HBM3e per GPU (NVIDIA DGX B200: 1,440 GB over 8 GPUs); Blackwell data-centre, sm100
    "b200": (180 * 10**9, (10, 0)),
}
DEFAULT_COMPUTE_CAPABILITY = (9, 0)  # when the target GPU is unknown: Hopper-class kernels


def normalise(name: str) -> str:
    return name.lower().replace(" ", "").replace("_", "").replace("geforce", "").replace("nvidia", "")


def card_bytes(name: str) -> int | None:
    card = CARDS.get(normalise(name))
    return card[0] if card else None


def compute_capability(name: str) -> tuple[int, int] | None:
    """For a card name or an NVML device name ('NVIDIA H100 80GB HBM3' -> h100)."""
    key = normalise(name)
    if key in CARDS:
        return CARDS[key][1]
    # NVML names: the longest catalogue key contained in the name wins ('a100-80gb' before 'a100')
    matches = [k for k in CARDS if k.split("-")[0] in key]
    return CARDS[max(matches, key=len)][1] if matches else None

"""The device-wide figure: what a GPU shows as used beyond the processes on it.

memest's ``device_bytes`` (DeviceUsage.process_bytes_*) is the training process's own use: nvidia-smi's
per-process "GPU Memory Usage", NVML nvmlDeviceGetComputeRunningProcesses' usedGpuMemory. The device-wide
used (nvmlDeviceGetMemoryInfo) also holds memory the driver or firmware reserves for itself outside any
process. NVML documents it: nvmlMemory_v2_t.reserved is 'Device memory (in bytes) reserved for system use
(driver or firmware)', and v2's used includes it in R525
(https://docs.nvidia.com/deploy/archive/R525/nvml-api/structnvmlMemory__v2__t.html); nvmlMemory_t (v1)
used is the 'Sum of Reserved and Allocated device memory'
(https://docs.nvidia.com/deploy/nvml-api/api/structnvmlMemory__t.html). Either way NVML's free excludes it,
so a verdict against live free memory takes the process figure; against a card's total (the physical
memory, reservation included) the device-wide figure: process + reservation. nvidia-smi's
"Memory-Usage" column shows the reservation on older drivers (V100, driver 440) and not on newer ones
(P100 with driver 515: nvidia-smi 0 MiB, NVML v1 used 103 MB), so "device used" depends on the tool.

The reservation is a Spread from the rows below: expected = the median, low / high = the smallest and
largest (it depends on the GPU, the driver, ECC and GSP firmware; no row per generation is enough to
pick one).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from memest.units import MiB


@dataclass(frozen=True)
class Reservation:
    bytes: int
    gpu: str
    driver: str
    source: str
    measured: str


RESERVATIONS: tuple[Reservation, ...] = (
    Reservation(112 * MiB, "Tesla V100-SXM2 16GB", "440.64.00 (CUDA 10.2)",
                "https://github.com/4paradigm/k8s-vgpu-scheduler/issues/7",
                "nvidia-smi Memory-Usage 112MiB / 16160MiB with 'No running processes found'"),
    Reservation(103 * MiB, "Tesla P100-PCIE-16GB", "515.65.01 (CUDA 11.7)",
                "https://github.com/wookayin/gpustat/issues/130",
                "gpustat (NVML v1 used) 103 MB on each idle GPU where nvidia-smi shows 0MiB (gpustat's MB are MiB)"),
    Reservation(256 * MiB, "Tesla T4 (passthrough VM, GSP firmware)", "515.65.01 (open kernel modules)",
                "https://github.com/NVIDIA/open-gpu-kernel-modules/issues/357",
                "nvidia-smi shows 256MB used with no process; maintainer: 'The GSP microprocessor carves out 256MB "
                "of VRAM for its own use'"),
    Reservation(541_917_184, "NVIDIA A10", "535.129.03 (CUDA 12.2)", "https://github.com/mayooot/detect-gpu/issues/3",
                "NVML Used 541,917,184 B on idle GPUs 1-3 (no process)"),
    Reservation(1_257_242_624 - 706_740_224, "NVIDIA A10", "535.129.03 (CUDA 12.2)",
                "https://github.com/mayooot/detect-gpu/issues/3",
                "GPU 0: NVML Used 1,257,242,624 B minus its one process's usedGpuMemory 706,740,224 B"),
)


@dataclass(frozen=True)
class ReservationSpread:
    low: int
    expected: int
    high: int
    basis: str


def reservation_spread(rows: tuple[Reservation, ...] = RESERVATIONS) -> ReservationSpread:
    """Device memory outside any process: the median of the rows, range smallest to largest."""
    if not rows:
        raise ValueError("no device-reservation measurement")
    values = [r.bytes for r in rows]
    low, high = min(values), max(values)
    return ReservationSpread(
        low, int(statistics.median(values)), high,
        f"driver/firmware reservation outside any process (NVML nvmlMemory_v2_t.reserved): median of {len(values)} "
        f"idle-GPU measurements, range {low / MiB:.0f}-{high / MiB:.0f} MiB (V100, P100, T4, A10; "
        "device/reservation.py RESERVATIONS)")

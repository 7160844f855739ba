"""Live NVIDIA GPUs through gpustat (NVML). A machine without a driver is a normal state: the query
returns no devices and a one-line reason. Reading NVML allocates nothing on the GPU."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from memest.units import MiB


@dataclass
class GpuProcess:
    pid: int
    command: str
    used_bytes: int


@dataclass
class Gpu:
    index: int
    name: str
    total_bytes: int
    used_bytes: int
    free_bytes: int
    utilization: int | None = None
    processes: list[GpuProcess] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class GpuQuery:
    gpus: list[Gpu]
    reason: str = ""  # why there are none, if there are none
    driver: str = ""


def query_gpus() -> GpuQuery:
    try:
        import gpustat

        stats = gpustat.new_query()
    except Exception as exc:  # no driver, no libnvidia-ml, no permission: all the same to the user
        return GpuQuery([], f"no NVIDIA GPU visible (NVML: {_short(exc)})")
    gpus = []
    for g in stats.gpus:
        total = int(g.memory_total) * MiB  # gpustat reports MiB
        used = int(g.memory_used) * MiB
        free = int(getattr(g, "memory_free", g.memory_total - g.memory_used)) * MiB
        procs = [
            GpuProcess(
                pid=int(p.get("pid", 0)),
                command=str(p.get("command", "?")),
                used_bytes=int(p.get("gpu_memory_usage") or 0) * MiB,
            )
            for p in (g.processes or [])
        ]
        gpus.append(Gpu(int(g.index), str(g.name), total, used, free, g.utilization, procs))
    if not gpus:
        return GpuQuery([], "NVML found no NVIDIA GPU")
    return GpuQuery(gpus, driver=str(getattr(stats, "driver_version", "") or ""))


def _short(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:120]

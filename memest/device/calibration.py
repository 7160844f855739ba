"""`memest calibrate`: measure this GPU's fixed costs once, reuse them in later estimates.

Calibration is the one place memest touches a GPU, on purpose and only when asked. Results are
stored per (GPU name, driver, torch version) in the user's cache dir; estimates on a matching GPU use
them instead of the defaults in overheads.py, and the report says which values are calibrated.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from ..errors import MemestError


def cache_file() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "memest" / "calibrations.json"


def calibration_key(gpu_name: str, driver: str, torch_version: str) -> str:
    return f"{gpu_name}|{driver}|{torch_version}"


def load_all(path: Path | None = None) -> dict:
    path = path or cache_file()
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def lookup(gpu_name: str, driver: str, torch_version: str, path: Path | None = None) -> dict | None:
    return load_all(path).get(calibration_key(gpu_name, driver, torch_version))


def save(entry: dict, path: Path | None = None) -> Path:
    path = path or cache_file()
    data = load_all(path)
    data[calibration_key(entry["gpu_name"], entry["driver"], entry["torch_version"])] = entry
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)  # never leave a half-written cache
    return path


def _process_used_bytes(handle, pid: int) -> int | None:
    import pynvml

    for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
        if proc.pid == pid and proc.usedGpuMemory is not None:
            return int(proc.usedGpuMemory)
    return None


def measure(device_index: int = 0) -> dict:
    """Measure the CUDA context, the cuBLAS workspace and a small reference step on a real GPU."""
    import torch

    if not torch.cuda.is_available():
        raise MemestError("memest calibrate needs a CUDA GPU visible to torch; none is (estimates still work without one)")
    import pynvml

    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(device_index)
    pid = os.getpid()
    torch.cuda.set_device(device_index)
    torch.empty(1, device="cuda")  # creates the context and one 2 MiB small-pool segment
    torch.cuda.synchronize()
    used = _process_used_bytes(handle, pid)
    context = used - torch.cuda.memory_reserved() if used is not None else None

    a = torch.randn(256, 256, device="cuda")
    before = torch.cuda.memory_allocated()
    b = a @ a
    torch.cuda.synchronize()
    workspace = torch.cuda.memory_allocated() - before - b.numel() * b.element_size()

    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024)).cuda()
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(64, 1024, device="cuda")
    torch.cuda.reset_peak_memory_stats()
    for _ in range(2):
        model(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    step_used = _process_used_bytes(handle, pid)
    props = torch.cuda.get_device_properties(device_index)
    return {
        "gpu_name": _text(pynvml.nvmlDeviceGetName(handle)),
        "driver": _text(pynvml.nvmlSystemGetDriverVersion()),
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "compute_capability": [props.major, props.minor],
        "total_bytes": int(props.total_memory),
        "context_bytes": context,
        "cublas_workspace_bytes": workspace,
        "reference_step": {
            "max_memory_allocated": torch.cuda.max_memory_allocated(),
            "max_memory_reserved": torch.cuda.max_memory_reserved(),
            "nvml_used": step_used,
        },
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "source": "memest calibrate",
    }


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)

"""`memest calibrate`: measure this GPU's fixed costs once, reuse them anywhere.

Calibration is the one place memest touches a GPU, on purpose and only when asked. A measurement is a
**profile**: the CUDA context, the libraries a training step loads (cuBLAS/cuBLASLt, cuDNN, NCCL) and
the cuBLAS workspace, each as NVML used memory minus torch's reserved, stage by stage, with the GPU,
driver, CUDA, cuDNN and torch versions and how it was measured (provenance). Profiles are used two ways:

  - automatically, on the machine that measured it: stored per (GPU name, driver, torch version) in
    the user's cache dir; an estimate on a matching GPU uses it;
  - portably: ``memest calibrate --out profiles/rtx2080ti.json`` on the GPU machine, then
    ``--calibration profiles/rtx2080ti.json`` (or ``calibration:`` in a run config, or
    ``memest.estimate(..., calibration=...)``) on any machine, a CPU-only CI runner included.

A calibrated value replaces the evidence default (overheads.py) and has no spread; the report says
which values are calibrated and where the profile came from.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

from memest.errors import MemestError
from memest.version import __version__

SCHEMA = "memest-calibration/1"
REQUIRED = ("gpu_name", "compute_capability", "driver", "torch_version", "context_bytes")
BYTE_KEYS = ("context_bytes", "cublas_library_bytes", "cudnn_library_bytes", "nccl_library_bytes",
             "cublas_workspace_bytes")


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
    _write_json(path, data)
    return path


def write_profile(entry: dict, path: str | Path) -> Path:
    """One profile, one file: what ``--calibration FILE`` reads."""
    path = Path(path)
    _write_json(path, {"schema": SCHEMA, **entry})
    return path


def _write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)  # never leave a half-written file


def load_profile(path: str | Path) -> dict:
    """A profile written by ``memest calibrate --out``: checked, one-line errors naming the file."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise MemestError(f"calibration {str(path)!r} not found or unreadable ({exc.strerror}); pass a profile "
                          "written by `memest calibrate --out FILE`") from None
    except json.JSONDecodeError as exc:
        raise MemestError(f"calibration {str(path)!r} is not JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise MemestError(f"calibration {str(path)!r} is not a memest calibration profile (schema {SCHEMA!r}); "
                          "write one with `memest calibrate --out FILE` on the GPU machine")
    data = check_profile(data, f"calibration {str(path)!r}")
    data["profile_path"] = str(path)
    return data


def check_profile(data: dict, where: str) -> dict:
    """A profile's fields checked (a file's, or a dict given to the Python API), one-line errors naming
    ``where``; compute_capability as a (major, minor) tuple."""
    missing = [k for k in REQUIRED if data.get(k) is None]
    if missing:
        raise MemestError(f"{where} lacks {', '.join(missing)}; re-run `memest calibrate --out`")
    for key in BYTE_KEYS:
        value = data.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise MemestError(f"{where}: {key} must be a whole number of bytes, got {value!r}")
    return {**data, "compute_capability": compute_capability_of(data["compute_capability"], where)}


def compute_capability_of(value, where: str) -> tuple[int, int]:
    """[9, 0] (as `memest calibrate` writes it) or the unambiguous "9.0" -> (9, 0); 90 or [9] is refused (is 90
    sm90, or 9.0? is [9] 9.0?)."""
    parts = value.strip().split(".") if isinstance(value, str) else value
    if isinstance(parts, (list, tuple)) and len(parts) == 2:
        try:
            major, minor = (int(p) if isinstance(p, str) and p.strip().isdigit() else p for p in parts)
        except ValueError:
            major = minor = None
        if all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (major, minor)):
            return major, minor
    raise MemestError(f"{where}: compute_capability must be [major, minor] such as [9, 0] (or \"9.0\"), got {value!r}")


def describe(profile: dict) -> str:
    """One line for the report: which GPU and stack, when, by what."""
    prov = profile.get("provenance") or {}
    where = f" ({profile['profile_path']})" if profile.get("profile_path") else ""
    return (f"calibration{where}: {profile['gpu_name']}, driver {profile['driver']}, torch {profile['torch_version']}"
            f", measured {profile.get('measured_at', '?')} by {prov.get('measured_by', profile.get('source', '?'))}")


# ------------------------------------------------------------------------------ on a real GPU


def _process_used_bytes(handle, pid: int) -> int | None:
    import pynvml

    for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
        if proc.pid == pid and proc.usedGpuMemory is not None:
            return int(proc.usedGpuMemory)
    return None


def measure(device_index: int = 0, nccl: bool = True) -> dict:
    """Measure, stage by stage in this (fresh) process, what a training process holds outside torch's
    allocator: the CUDA context, + cuBLAS/cuBLASLt (first GEMMs), + cuDNN (a convolution forward and
    backward), + NCCL (a world of 1, one all_reduce); and the cuBLAS workspace and a reference step."""
    import torch
    import torch.nn.functional as F

    if not torch.cuda.is_available():
        raise MemestError("memest calibrate needs an NVIDIA GPU visible to torch (CUDA); none is (estimates still work without one)")
    if torch.cuda.is_initialized():
        raise MemestError("memest calibrate must create the CUDA context itself; run it in a fresh process")
    if device_index >= torch.cuda.device_count():
        raise MemestError(f"--device {device_index}: no such GPU (torch sees {torch.cuda.device_count()})")
    import pynvml

    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(device_index)
    pid = os.getpid()
    torch.cuda.set_device(device_index)
    outside: dict[str, int | None] = {}

    def stage(name: str) -> None:
        torch.cuda.synchronize()
        time.sleep(0.2)  # NVML's per-process accounting lags a little
        used = _process_used_bytes(handle, pid)
        outside[name] = used - torch.cuda.memory_reserved() if used is not None else None

    torch.empty(1, device="cuda")  # the context, and one 2 MiB small-pool segment
    stage("context")
    a = torch.randn(256, 256, device="cuda")
    before = torch.cuda.memory_allocated()
    b = a @ a
    torch.cuda.synchronize()
    workspace = torch.cuda.memory_allocated() - before - b.numel() * b.element_size()
    half = torch.bfloat16 if torch.cuda.get_device_capability(device_index) >= (8, 0) else torch.float16
    x = torch.randn(1024, 1024, device="cuda", dtype=half)
    w = torch.randn(1024, 1024, device="cuda", dtype=half, requires_grad=True)
    bias = torch.randn(1024, device="cuda", dtype=half, requires_grad=True)
    F.linear(x, w, bias).sum().backward()
    stage("cublas")
    img = torch.randn(8, 64, 56, 56, device="cuda", requires_grad=True)
    kernel = torch.randn(64, 64, 3, 3, device="cuda", requires_grad=True)
    F.conv2d(img, kernel, padding=1).sum().backward()
    stage("cudnn")
    nccl_error = _nccl_world_of_one(lambda: stage("nccl")) if nccl else None
    del a, b, x, w, bias, img, kernel
    reference = _reference_step(handle, pid)
    props = torch.cuda.get_device_properties(device_index)

    def delta(later: str, earlier: str) -> int | None:
        if outside.get(later) is None or outside.get(earlier) is None:
            return None
        return max(0, outside[later] - outside[earlier])

    return {
        "gpu_name": _text(pynvml.nvmlDeviceGetName(handle)),
        "driver": _text(pynvml.nvmlSystemGetDriverVersion()),
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "cudnn_version": torch.backends.cudnn.version(),
        "compute_capability": [props.major, props.minor],
        "total_bytes": int(props.total_memory),
        "module_loading": os.environ.get("CUDA_MODULE_LOADING", "LAZY").lower(),
        "context_bytes": outside["context"],
        "cublas_library_bytes": delta("cublas", "context"),
        "cudnn_library_bytes": delta("cudnn", "cublas"),
        "nccl_library_bytes": delta("nccl", "cudnn"),
        "cublas_workspace_bytes": workspace,
        "stages_outside_allocator": outside,
        "reference_step": reference,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "source": "memest calibrate",
        "provenance": {
            "measured_by": f"memest {__version__} calibrate",
            "command": " ".join(["memest"] + sys.argv[1:]) if sys.argv else "memest calibrate",
            "method": "one fresh process; NVML used memory of the process minus torch.cuda.memory_reserved() after "
                      "each stage: torch.empty(1) (context); a 256x256 fp32 GEMM and a 1024x1024 16-bit linear "
                      "forward+backward (cuBLAS/cuBLASLt); conv2d 8x64x56x56 3x3 forward+backward (cuDNN); "
                      "init_process_group('nccl') world of 1 + one all_reduce (NCCL)",
            "nccl": "not measured (--no-nccl)" if not nccl else (nccl_error or "measured"),
        },
    }


def _nccl_world_of_one(measure_stage) -> str | None:
    """A world of one over a file store (no network), measured by ``measure_stage()`` while the
    communicator exists; None when it worked, else why not."""
    try:
        import torch
        import torch.distributed as dist

        with tempfile.TemporaryDirectory() as folder:
            dist.init_process_group("nccl", init_method=f"file://{folder}/store", rank=0, world_size=1)
            try:
                t = torch.ones(1024, device="cuda")
                dist.all_reduce(t)
                measure_stage()
            finally:
                dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 -- a missing NCCL leaves that one value unmeasured
        return f"not measured: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
    return None


def _reference_step(handle, pid: int) -> dict:
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024)).cuda()
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(64, 1024, device="cuda")
    torch.cuda.reset_peak_memory_stats()
    for _ in range(2):
        model(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return {
        "what": "Linear(1024,4096)-GELU-Linear(4096,1024), batch 64, fp32, AdamW, two steps",
        "max_memory_allocated": torch.cuda.max_memory_allocated(),
        "max_memory_reserved": torch.cuda.max_memory_reserved(),
        "nvml_used": _process_used_bytes(handle, pid),
    }


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)

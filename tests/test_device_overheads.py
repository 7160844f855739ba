"""Fixed costs (each constant from its source), the device-usage arithmetic, fitting with the
allocator's OOM recovery, and calibration storage."""

import json

from typer.testing import CliRunner

from memest.cli import app
from memest.device.calibration import calibration_key, lookup, save
from memest.device.overheads import cublas_workspace_bytes, fixed_costs
from memest.device.usage import device_usage, fits_in
from memest.trace.events import Category, Phase, StorageRecord, Trace

MiB = 2**20


def test_cublas_workspace_defaults_and_env():
    assert cublas_workspace_bytes((8, 0), env={}) == 4096 * 1024 * 2 + 16 * 1024 * 8  # ":4096:2:16:8"
    assert cublas_workspace_bytes((9, 0), env={}) == 32 * MiB  # Hopper default
    assert cublas_workspace_bytes((12, 0), env={}) == 32 * MiB  # Blackwell consumer
    assert cublas_workspace_bytes((8, 0), env={"CUBLAS_WORKSPACE_CONFIG": ":16:8"}) == 128 * 1024
    assert cublas_workspace_bytes((9, 0), env={"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}) == 32 * MiB


def by_name(costs):
    return {c.name: c for c in costs}


def test_fixed_costs_context_modes_and_nccl():
    lazy = by_name(fixed_costs((8, 0), env={}))
    eager = by_name(fixed_costs((8, 0), env={"CUDA_MODULE_LOADING": "EAGER"}))
    assert lazy["cuda_context"].bytes < eager["cuda_context"].bytes
    ampere_consumer = by_name(fixed_costs((8, 6), env={}))
    assert ampere_consumer["cuda_context"].bytes == 256 * MiB  # the one generation with a public measurement
    assert lazy["cublas_workspaces"].bytes == 2 * cublas_workspace_bytes((8, 0), env={})  # two threads
    assert lazy["cublas_workspaces"].in_allocator and not lazy["cuda_context"].in_allocator
    assert "nccl_buffers" not in lazy
    dist = by_name(fixed_costs((8, 0), world_size=4, env={"NCCL_BUFFSIZE": str(2 * MiB), "NCCL_MAX_NCHANNELS": "8"}))
    assert dist["nccl_buffers"].bytes == 2 * MiB * 8 * 2
    split = by_name(fixed_costs((8, 0), env={"TORCH_CUBLASLT_UNIFIED_WORKSPACE": "0"}))
    assert split["cublaslt_workspaces"].bytes == 2 * 1024 * 1024


def test_calibration_replaces_defaults_and_is_reported():
    cal = {"context_bytes": 300 * MiB, "cublas_workspace_bytes": 16 * MiB}
    costs = by_name(fixed_costs((9, 0), calibration=cal, env={}))
    assert costs["cuda_context"].bytes == 300 * MiB and costs["cuda_context"].calibrated
    assert costs["cublas_workspaces"].bytes == 32 * MiB and costs["cublas_workspaces"].calibrated


def hand_trace(sizes_and_frees):
    """Events from a list of +bytes (allocate a new storage) and -index (free storage index)."""
    trace = Trace()
    trace.phase_marks.append((0, 1, Phase.FORWARD))
    for item in sizes_and_frees:
        if item > 0:
            sid = len(trace.storages)
            trace.storages.append(StorageRecord(item, Category.TEMPORARIES, "", Phase.FORWARD, "op", 1))
            trace.events.append((sid, item))
        else:
            sid = -item
            trace.events.append((sid, -trace.storages[sid].nbytes))
    return trace


NO_WORKSPACE = {"context_bytes": 100 * MiB, "cublas_library_bytes": 0, "cudnn_library_bytes": 0, "cublas_workspace_bytes": 0}


def test_device_usage_is_reserved_plus_context():
    # 12 MiB (>= kMinLargeAlloc: its own 12 MiB segment), freed and cached; then 14 MiB, which the
    # cached block cannot hold: a second segment, so reserved = 26 MiB while allocated peaks at 14 MiB
    trace = hand_trace([12 * MiB, -0, 14 * MiB])
    usage = device_usage(trace, (8, 0), calibration=NO_WORKSPACE, env={})
    assert usage.tensor_peak_bytes == 14 * MiB
    assert usage.allocated_peak_bytes == 14 * MiB
    assert usage.reserved_peak_bytes == 26 * MiB
    assert usage.device_bytes == 26 * MiB + 100 * MiB


def test_fits_counts_the_allocators_cache_release():
    trace = hand_trace([12 * MiB, -0, 14 * MiB])
    usage = device_usage(trace, (8, 0), calibration=NO_WORKSPACE, env={})
    # 120 MiB < 126 MiB predicted, but the allocator frees its cached 12 MiB segment and retries
    assert fits_in(trace, usage, 120 * MiB, env={})
    assert not fits_in(trace, usage, 113 * MiB, env={})  # 13 MiB left for a 14 MiB block
    # so the step needs 14 MiB + the context, not the 126 MiB it holds with room to spare
    assert usage.min_allocator_limit_bytes == 14 * MiB
    assert usage.min_budget_bytes == 114 * MiB and usage.device_bytes == 126 * MiB


def test_workspaces_are_allocator_blocks():
    trace = hand_trace([4 * MiB])
    usage = device_usage(trace, (9, 0), calibration={"context_bytes": 0}, env={})
    assert usage.allocated_peak_bytes == 4 * MiB + 32 * MiB  # forward thread's workspace; no backward here


def test_calibration_store_roundtrip(tmp_path):
    path = tmp_path / "cal.json"
    entry = {"gpu_name": "NVIDIA H100 80GB HBM3", "driver": "570.1", "torch_version": "2.13.0", "context_bytes": 1}
    save(entry, path)
    save({**entry, "driver": "580.0", "context_bytes": 2}, path)
    assert lookup("NVIDIA H100 80GB HBM3", "570.1", "2.13.0", path)["context_bytes"] == 1
    assert lookup("NVIDIA H100 80GB HBM3", "999", "2.13.0", path) is None
    assert set(json.loads(path.read_text())) == {
        calibration_key("NVIDIA H100 80GB HBM3", "570.1", "2.13.0"),
        calibration_key("NVIDIA H100 80GB HBM3", "580.0", "2.13.0"),
    }


def test_calibrate_without_gpu_is_a_plain_exit_2():
    result = CliRunner().invoke(app, ["calibrate"])
    assert result.exit_code == 2
    assert "needs an NVIDIA GPU" in result.stderr and len(result.stderr.strip().splitlines()) == 1

"""FSDP1's wrap before the step (parallel/fsdp1.py ``load_events``, issue 21): the device allocations that
``FullyShardedDataParallel(...)`` makes while it wraps, rebuilt from each unit's FlatParameter in torch's order, against
the real wrap on 2 gloo ranks measured with torch.profiler memory events.

On a CPU the model is already where FSDP computes, so the real wrap moves nothing: it is compared with
``load_events(..., on_device=True)`` (every unit's parameters resident first). Measured per rank, from the wrap's
start: the highest bytes above that start and the bytes left when it returns, both to the byte; with and without
``sync_module_states`` (gloo broadcasts CPU tensors: c10d ``broadcast_coalesced``'s flattened buckets are real
allocations), FULL_SHARD and SHARD_GRAD_OP, a LoRA model whose trainable leaves are units of their own. The move to
the GPU (``_move_module_to_device``) is not measurable here; its allocations are the parameters' own bytes."""

import gc
import json
import socket
import tempfile
import time

import pytest
import torch

from memest.device.allocator import RESET_PEAK, replay
from memest.device.usage import allocator_events
from memest.features.registry import trace_step
from memest.sources import load_source
from memest.spec import RunSpec
from memest.trace.events import Category

from .conftest import model_ref

LORA = "r=8,targets=all-linear"
CASES = [  # (shard, precision, extra RunSpec fields)
    ("zero3", "bf16", {"fsdp_sync_module_states": True}),
    ("zero3", "fp32", {}),
    ("zero2", "bf16", {"lora": LORA, "fsdp_sync_module_states": True}),
    ("zero3", "bf16-mixed", {"fsdp_sync_module_states": True}),
    ("none", "bf16", {"lora": LORA, "fsdp_sync_module_states": True}),  # NO_SHARD: the flat parameters kept whole
]
MARK = 7_654_321  # a marker allocation: the wrap starts after its free


def _spec(case, model="hf:llama-tiny-wide") -> RunSpec:
    shard, precision, extra = case
    return RunSpec(model=model_ref(model), batch=2, seq=16, precision=precision, target="cpu", world_size=2,
                   shard=shard, fsdp_version="1", **extra)


def _levels(deltas: list[int], start: int = 0) -> tuple[int, int]:
    """(highest level above the start, level at the end) of a running sum of ``deltas``."""
    level = top = 0
    for d in deltas[start:]:
        level += d
        top = max(top, level)
    return top, level


def _rank(rank: int, world_size: int, port: int, specs: list[dict], out_dir: str) -> None:
    import os

    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from memest.features.checkpointing import repeated_blocks
    from memest.features.registry import build
    from memest.parallel import fsdp1
    from memest.validate.cpu_truth import _allocation_events
    from memest.validate.distributed_truth import (
        _count_frees_on_every_thread,
        _drop_inherited_log_handlers,
        _other_threads_idle,
    )

    def settle() -> None:
        """gloo's worker thread drops its reference to a broadcast's flat bucket after the broadcast completes (see
        distributed_truth._gloo_workers_settle_after_each_wait, for Work.wait from Python; c10d's
        broadcast_coalesced waits in C++): wait for it, as NCCL's stream-ordered free would not outlive the op."""
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline and _other_threads_idle() is False:
            time.sleep(0.0001)

    from torch.distributed.fsdp import _init_utils

    sync = _init_utils._sync_params_and_buffers

    def synced(*args, **kwargs):
        out = sync(*args, **kwargs)
        settle()
        return out

    _init_utils._sync_params_and_buffers = synced

    torch.set_num_threads(1)  # a forked child of an OpenMP process: one thread (tests/test_fsdp_qlora.py)
    _drop_inherited_log_handlers()  # pytest's log capture would keep what a library logs about (distributed_truth)
    _count_frees_on_every_thread()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    rows = []
    try:
        for d in specs:
            spec = RunSpec(**{**d, "compute_capability": tuple(d["compute_capability"])})
            gc.collect()  # the previous case's model and wrapper, then whatever gloo's threads still hold of them
            settle()
            torch.manual_seed(0)
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                model = build(load_source(spec.model), spec).model  # allocated while profiling: its frees are seen
                marker = torch.empty(MARK, dtype=torch.uint8)
                del marker
                root, _, _ = fsdp1.wrap(model, spec, repeated_blocks(model))  # as parallel/distributed.py's _fsdp
                settle()
                end = torch.empty(MARK, dtype=torch.uint8)
                del end
            events = [e.extra_fields for e in _allocation_events(prof)]
            start = next(i for i, e in enumerate(events) if e.alloc_size == -MARK) + 1
            stop = next(i for i, e in enumerate(events) if i >= start and e.alloc_size == MARK)
            base = events[start - 1].total_allocated
            wrap_events = events[start:stop]
            measured = (max([0] + [e.total_allocated - base for e in wrap_events]),
                        (wrap_events[-1].total_allocated - base) if wrap_events else 0)
            modelled = fsdp1.load_events(root, spec, lambda t: None, rank=rank, on_device=True).events
            resident = sum(1 for u in fsdp1._init_order(root, type(root))
                           if u._handle is not None for n in u._handle.flat_param._numels if n)
            moved = fsdp1.load_events(root, spec, lambda t: None, rank=rank)
            rows.append({"measured": list(measured), "modelled": list(_levels([d for _, d in modelled], resident)),
                         "moved": [d for _, d in moved.events], "marks": [list(m) for _, m in moved.marks]})
            del root, model
    finally:
        dist.destroy_process_group()
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(rows, f)


@pytest.fixture(scope="module")
def measured():
    """Every case wrapped for real on 2 gloo ranks, in one pair of processes."""
    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    specs = [_spec(c).to_dict() for c in CASES]
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_rank, args=(2, port, specs, out_dir), nprocs=2, join=True, start_method="fork")
        return [json.loads(open(f"{out_dir}/rank{r}.json").read()) for r in range(2)]


@pytest.mark.parametrize("k", range(len(CASES)), ids=["-".join(map(str, c[:2])) + ("-sync" if c[2].get(
    "fsdp_sync_module_states") else "") + ("-lora" if "lora" in c[2] else "") for c in CASES])
def test_wrap_allocations_match_the_real_wrap_on_each_rank(k, measured):
    for rank in (0, 1):
        row = measured[rank][k]
        assert row["measured"] == row["modelled"], f"rank {rank}: real (peak, end) {row['measured']}, modelled " \
            f"{row['modelled']}"
        assert row["measured"][0] > 0  # the wrap allocates (the flat parameters, the shards)


@pytest.mark.parametrize("k", range(len(CASES)), ids=[str(k) for k in range(len(CASES))])
def test_traced_wrap_is_the_real_ranks_wrap(k, measured):
    """The trace's wrap (FSDP1 under the fake process group) gives the events the real rank 0's FlatParameters give."""
    spec = _spec(CASES[k])
    trace = trace_step(load_source(spec.model), spec)
    assert [d for _, d in trace.load_events] == measured[0][k]["moved"]
    assert any("FSDP1's wrap before the step" in n for n in trace.notes)


def test_replay_starts_the_step_after_the_wrap_with_its_cache():
    """The allocator replay runs the wrap first, then resets its peaks (as fsdp_qlora's train.py does before the
    first step): the wrap's shards are not allocated twice, and the reserved peak is at least what the wrap left
    reserved."""
    spec = _spec(CASES[0])
    trace = trace_step(load_source(spec.model), spec)
    events = allocator_events(trace, [])
    cut = events.index(RESET_PEAK)
    assert events[:cut] == trace.load_events
    wrap_only = replay(trace.load_events)
    whole = replay(events)
    assert whole.peak_reserved >= wrap_only.final_reserved
    shards = {sid for sid, d in trace.load_events if d > 0 and sid >= 0}
    assert shards and all(sum(1 for sid, d in events if sid == s and d > 0) == 1 for s in shards)


def test_buffers_and_the_4bit_quant_state_move_with_their_unit():
    """Each unit's buffers (here the 4-bit stand-in's quant state: absmax, nested absmax, code, offset; the rotary
    inv_freq) are moved to the device by the wrap with the unit's parameters and kept: allocated once, before the
    step's peaks are reset, under the step's own storage ids."""
    spec = _spec(("zero3", "bf16", {"lora": LORA, "quant": "nf4", "double_quant": True,
                                    "fsdp_sync_module_states": True}))
    trace = trace_step(load_source(spec.model), spec)
    events = allocator_events(trace, [])
    cut = events.index(RESET_PEAK)
    buffers = {sid for sid, rec in enumerate(trace.storages) if rec.category is Category.BUFFERS}
    loaded = {sid for sid, d in events[:cut] if d > 0 and sid >= 0}
    # 4 per double-quantized layer (absmax, nested absmax, nested code, offset) + its code table, + inv_freq
    assert len(buffers) > 4 * 7 * 2 and buffers <= loaded, (len(buffers), len(buffers & loaded))
    assert all(sum(1 for sid, d in events if sid == s and d > 0) == 1 for s in loaded)


def test_sync_module_states_needs_fsdp1():
    from memest.errors import MemestError

    with pytest.raises(MemestError, match="--fsdp-version 1"):
        RunSpec(model=model_ref("hf:llama-tiny"), world_size=2, shard="zero3", target="cpu",
                fsdp_sync_module_states=True)


_BROADCAST_TRUTH = """
import json, sys
import torch, torch.distributed as dist
from torch.profiler import ProfilerActivity, profile
from memest.validate.cpu_truth import _allocation_events
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
states = [torch.zeros(n, dtype=getattr(torch, d)) for d, n in json.loads(sys.argv[1])]
with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
    dist._broadcast_coalesced(dist.group.WORLD, states, int(sys.argv[2]), 0)
print(json.dumps([e.extra_fields.alloc_size for e in _allocation_events(prof)]))
dist.destroy_process_group()
"""


def test_broadcast_buckets_as_c10d_allocates_them():
    """fsdp1._buckets and the wrap's broadcast rule (a bucket of one tensor is a view of it, no allocation) against
    c10d's own ``broadcast_coalesced`` on a real gloo group, measured with torch.profiler memory events: the
    allocations it makes, in order, each freed once its broadcast is done. Mixed dtypes (a bucket per dtype), buckets
    closed at the limit, lone tensors at the limit, in the middle and at the end."""
    import subprocess
    import sys

    from memest.parallel import fsdp1

    limit = 2000
    states = [("float32", 1000), ("float64", 7), ("float32", 75), ("float64", 50), ("float32", 5), ("float32", 600),
              ("bfloat16", 3), ("float32", 3)]
    out = subprocess.run([sys.executable, "-c", _BROADCAST_TRUTH, json.dumps(states), str(limit)], capture_output=True,
                         text=True, check=True, timeout=120)
    real = json.loads(out.stdout.strip().splitlines()[-1])
    sizes = [(getattr(torch, d), n * getattr(torch, d).itemsize) for d, n in states]
    buckets = fsdp1._buckets(sizes, limit)
    allocated = [nbytes for nbytes, tensors in buckets if tensors > 1]
    assert sorted(n for n in real if n > 0) == sorted(allocated), (real, buckets)
    assert any(tensors == 1 for _, tensors in buckets)  # the case the rule is for is in the test
    assert [n for n in real if n > 0] == allocated  # in the order c10d flattens them


def test_broadcast_buckets_pending_in_the_high_end_only(measured):
    """The wrap's record_stream marks (fsdp1.Wrap.marks): every flattened bucket is record_stream'ed before its free
    and its unit's broadcast is a CUDA event; on rank 0 the next unit's first host-to-device copy waits for it (a
    GPU_PASSED right after that unit's first allocation); on rank 1 nothing waits in the wrap. The point estimate's
    replay is the wrap without them; the high end's (allocator_events(..., deferred=True)) holds each pending bucket,
    so the wrap leaves at least as much reserved, and the high end of reserved is at least the plain replay's."""
    from memest.device.allocator import FREE_EVENT_ID, GPU_PASSED_ID, RECORD_STREAM_ID
    from memest.device.usage import device_usage

    spec = _spec(CASES[0])
    trace = trace_step(load_source(spec.model), spec)
    marks = trace.load_marks
    frees = {i for i, (sid, d) in enumerate(trace.load_events) if d < 0}
    recorded = [(i, sid) for i, (kind, sid) in marks if kind == RECORD_STREAM_ID]
    assert recorded and all(i in frees and trace.load_events[i][0] == sid for i, sid in recorded)
    events = [k for _, (kind, k) in marks if kind == FREE_EVENT_ID]
    passed = [(i, k) for i, (kind, k) in marks if kind == GPU_PASSED_ID]
    assert events and all(k < 0 for k in events)  # the step's events are numbered from 0
    assert [k for _, k in passed] == events[:-1]  # each unit's broadcast waited for by the next unit's move; not the root's
    assert all(trace.load_events[i - 1][1] > 0 for i, _ in passed)  # right after an allocation (the copy's)
    def shape(ms):  # the storage ids differ (the real ranks' are fresh ids): the kinds and the CUDA events
        return [(kind, None if kind == RECORD_STREAM_ID else k) for kind, k in ms]

    assert shape(m for _, m in marks) == shape(measured[0][0]["marks"])  # the traced wrap is rank 0's
    assert not [m for m in measured[1][0]["marks"] if m[0] == GPU_PASSED_ID]  # rank 1's wrap never waits
    high = allocator_events(trace, [], deferred=True)
    cut = high.index(RESET_PEAK)
    assert [e for e in high[:cut] if e[0] not in (RECORD_STREAM_ID, FREE_EVENT_ID, GPU_PASSED_ID)] == trace.load_events
    assert replay(high[:cut]).final_reserved >= replay(trace.load_events).final_reserved
    usage = device_usage(trace, (8, 0), world_size=2)
    assert usage.reserved_bytes_high >= usage.reserved_peak_bytes

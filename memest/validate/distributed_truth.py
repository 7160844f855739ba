"""Ground truth for --world-size/--shard/--offload: the same step run for real as N processes on this
CPU (gloo backend), each rank measuring its own peak with torch.profiler memory events exactly as
cpu_truth does. The processes wrap the model with the same code the trace uses
(trace/distributed.wrap), on real tensors and a real process group.

Processes come from a forkserver that imports torch (and memest) once, so each run costs a fork,
not an interpreter start; every rank runs all the cases it is given, one after another. Each rank runs under the
caller's oneDNN switch (``torch.backends.mkldnn.enabled``), which a trace in the caller's process reads where the
CPU kernel depends on it (targets/cpu: ``_scaled_mm``'s oneDNN path, oneDNN's bf16/fp16 matmuls).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import glob
import json
import os
import socket
import tempfile
import threading
import time
from dataclasses import asdict

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.profiler import ProfilerActivity, profile

from memest.features.registry import build, run_step
from memest.imports import FORKSERVER_PRELOAD
from memest.parallel.distributed import fake_process_group, wrap
from memest.parallel.expert_parallel import route_as
from memest.sources import load_source
from memest.spec import RunSpec
from memest.spec.choices import CompileScope, Target
from memest.trace.step import LoopState
from memest.validate.collector import full_collection_after_compile
from memest.validate.cpu_truth import (
    _allocation_events,
    _distinct_storage_bytes,
    held_before_step,
    onednn_half_matmuls,
    profiled_phase_peaks,
)

PHASE_PREFIX = "memest.grpo."  # features/grpo.py GRPOStep.mark
PRELOAD = ["memest.validate.distributed_truth", *FORKSERVER_PRELOAD]  # imports.FORKSERVER_PRELOAD says why


def measure_distributed_peaks(specs: list[RunSpec], seed: int = 0, threads: int = 1) -> list[list[dict]]:
    """Run each spec (all with the same --world-size) for real; for each spec, every rank's
    ``{"rank", "peak_bytes", "op_at_peak", "baseline_bytes"}`` (under FSDP also ``state_bytes``: parameters,
    gradients and optimizer state as the last optimizer step begins; for --preference grpo ``phase_peaks``: each
    phase's peak in the last iteration). CPU only (``--target cpu``)."""
    if not specs:
        return []
    world_size = specs[0].world_size
    assert all(s.world_size == world_size and s.target == Target.CPU for s in specs), "one --world-size, --target cpu"
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # takes effect when this process's forkserver first starts
    with tempfile.TemporaryDirectory(prefix="memest-dist-") as out_dir:
        mp.start_processes(
            _rank_main,
            args=(world_size, _free_port(), [asdict(s) for s in specs], seed, threads, out_dir,
                  torch.backends.mkldnn.enabled),
            nprocs=world_size,
            join=True,
            start_method="forkserver",
        )
        per_rank = []
        for rank in range(world_size):
            with open(os.path.join(out_dir, f"rank{rank}.json")) as f:
                per_rank.append(json.load(f))
    return [[per_rank[r][i] for r in range(world_size)] for i in range(len(specs))]


def measure_pipeline_stage_peaks(spec: RunSpec, seed: int = 0) -> list[dict]:
    """--pp: each stage's step run for real, in this process, one stage after another, on a fake process
    group whose rank is the stage: real tensors and the real CPU allocator, measured as ``_measure`` does,
    but the point-to-point transfers move no data (received activations and gradients are left as
    allocated). torch.distributed.pipelining hangs on gloo (pytorch/pytorch#132644: batch_isend_irecv
    is not stable on gloo; reproduced with torch 2.13 on a 2-layer Sequential, Schedule1F1B and
    ScheduleGPipe), so no multi-process run exists; the allocations do not depend on the values sent."""

    out = []
    for stage in range(spec.pp):
        with fake_process_group(spec.world_size, rank=stage):
            out.append(_measure(RunSpec(**{**spec.to_dict(), "pp_stage": stage}), stage, seed))
    return out


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _drop_inherited_log_handlers() -> None:
    """A rank forked from a process whose root logger keeps what it logs (pytest's log capture holds every LogRecord,
    and with it the objects its arguments name: a library logging about a parameter keeps that parameter alive)
    would hold memory a training process's handlers, which format a record and drop it, do not: the rank's root
    logger loses the handlers it inherited (measured: tests/test_fsdp1_load.py's LoRA wrap read three layers' LoRA
    parameters, 887,808 B, above the real frees when the rank inherited pytest's handlers in a fresh test process)."""
    import logging

    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)


def _count_frees_on_every_thread() -> None:
    """gloo runs collectives on worker threads, which drop their references to the buffers (the
    reduce-scatter's input clone) after the profiler's thread-local state is gone. The CPU
    allocator's running total (``total_allocated`` in the profiler's memory events) then misses
    those frees and drifts upward by a layer's worth at random. With c10's
    ``caffe2_report_cpu_memory_usage`` flag the allocator counts every allocation and free, on any
    thread, so the totals the profiler records are exact (checked: 5 of 5 runs identical)."""
    libs = glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "*c10.*"))
    lib = ctypes.CDLL(next(p for p in libs if p.endswith((".so", ".dylib", ".dll"))))
    ctypes.c_bool.in_dll(lib, "FLAGS_caffe2_report_cpu_memory_usage").value = True


# an upper bound on one wait for gloo's worker threads to go idle: on an idle machine the longest of the 326 waits of
# tests/test_preference_fsdp.py's zero2 case took 9 ms (2026-11-29). Under a loaded clean-clone CI run that case read
# one rank +256,000 B (its embedding's all-gather output outliving the op) with the bound at 0.2 s and idle seen once;
# which of the two let it through was not told apart: both are tightened
SETTLE_TIMEOUT_S = 1.0
SETTLE_RECHECK_S = 0.0005  # idle seen twice this far apart: a worker briefly blocked on gloo's work mutex is not idle


def _other_threads_idle() -> bool | None:
    """Whether every thread of this process but the caller is off the CPU (Linux /proc state not R or D);
    None where /proc cannot tell."""
    me = threading.get_native_id()
    try:
        tids = [t for t in os.listdir("/proc/self/task") if int(t) != me]
        states = []
        for tid in tids:
            with open(f"/proc/self/task/{tid}/stat") as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
    except (OSError, IndexError, ValueError):
        return None
    return not any(state in ("R", "D") for state in states)


@contextlib.contextmanager
def _gloo_workers_settle_after_each_wait():
    """gloo runs a collective on a worker thread that signals completion and only then drops its reference to the
    collective's buffers (the all-gather's flat buffer, the reduce-scatter's clone of its input). When that
    thread is not scheduled before the caller goes on, the buffer outlives the op by a few of the caller's
    allocations and one rank's measured peak rises by its size (seen: +1.6% to +5.8%, 5 of 6 runs of the CP 2
    truth case on this 2-core machine, a different rank each time). The estimate, like NCCL's stream-ordered
    frees, counts the buffer gone when the op completes; so each ``Work.wait`` returns only once the other
    threads of this rank are idle (blocked on their queue), seen so twice SETTLE_RECHECK_S apart (a worker that has
    signalled completion and blocks on the work queue's mutex before dropping its reference sleeps too, briefly:
    ProcessGroupGloo::runLoop), bounded by SETTLE_TIMEOUT_S. torch's functional collectives (DTensor's, transformers'
    AllToAllEP) wait in C++ and are not settled: their tests measure again while a rank reads above the trace."""
    work = dist.distributed_c10d.Work
    original = work.wait

    def wait(self, *args, **kwargs):
        done = original(self, *args, **kwargs)
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        seen_idle = False
        while time.monotonic() < deadline:
            idle = _other_threads_idle()
            if idle is None:
                time.sleep(0.001)
                break
            if idle and seen_idle:
                break
            seen_idle = idle
            time.sleep(SETTLE_RECHECK_S if idle else 0.0001)
        return done

    work.wait = wait
    try:
        yield
    finally:
        work.wait = original


def _rank_main(rank: int, world_size: int, port: int, specs: list[dict], seed: int, threads: int, out_dir: str,
               onednn: bool = True) -> None:
    torch.set_num_threads(threads)  # ranks share this machine's cores
    torch.backends.mkldnn.enabled = onednn  # the caller's switch (module docstring)
    _drop_inherited_log_handlers()
    _count_frees_on_every_thread()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        # full_collection_after_compile: when dynamo's compile cycle is freed, as the traces compared see it
        with _gloo_workers_settle_after_each_wait(), full_collection_after_compile():
            results = [_measure(RunSpec(**_spec_args(s)), rank, seed) for s in specs]
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)


def _spec_args(d: dict) -> dict:
    d = dict(d)
    d["compute_capability"] = tuple(d["compute_capability"])
    return d


SENTINEL_BYTES = 7_777_777  # a marker allocation: the step starts after its free


def _measure(spec: RunSpec, rank: int, seed: int) -> dict:
    """This rank's peak over the step, counting everything alive when the step starts.

    The profiler cannot see the free of a block allocated before it started ("Memory block of
    unknown size was allocated before the profiling started"), so whatever the step frees must be
    allocated while it profiles. DDP frees its gradient buckets in the second iteration (it rebuilds
    them in the order gradients arrived), so DDP is wrapped inside the profile; FSDP frees the
    unsharded parameters when it shards them, so it is wrapped before. A marker allocation
    separates the wrapping from the step; the peak is taken after it."""
    dims = spec.parallel
    if dims.pp_enabled:  # each rank runs its own pipeline stages: the "pp" coordinate of its rank
        stage = dims.stage_of(rank)
        spec = RunSpec(**{**spec.to_dict(), "pp_stage": stage}) if spec.pp_stage != stage else spec
    source = load_source(spec.model)
    torch.manual_seed(seed)
    built = build(source, spec)
    # --compile-scope blocks: each block compiled in place (block.compile()) before FSDP2 wraps it, torchtitan's order
    model, inputs = (built.runnable if spec.compile_scope is CompileScope.BLOCKS else built.model), built.inputs
    del built
    if dims.ep_enabled:  # weights that make the router split the pairs as the traced assumption says

        route_as(model, spec)
    # wrapped before: FSDP and TP replace the parameters, a pipeline stage drops the other stages' layers
    fsdp = spec.fsdp_wraps or dims.tp_enabled or dims.pp_enabled
    # a frozen model's ranks are plain replicas, as traced (trace/step.py): nothing to wrap
    replicas = not any(p.requires_grad for p in model.parameters())
    parallel = wrap(model, spec, fake=False) if fsdp and not replicas else None
    if parallel is not None and parallel.shard_inputs is not None:  # --cp: this rank's part of the sequence
        inputs = parallel.shard_inputs(inputs)
    # alive before profiling: parameters (this rank's shards under FSDP), buffers, plain tensor attributes, inputs
    held = held_before_step(model, inputs, params=_plain(model.parameters()))
    baseline = _distinct_storage_bytes(held)
    del held
    gc.collect()  # the previous case's model and optimizer (FSDP and DDP keep reference cycles)
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True) as prof:
        if parallel is None and not replicas:
            parallel = wrap(model, spec, fake=False)
        if parallel is not None:
            parallel.ddp_buckets = []
        module, optimizer = (model, None) if parallel is None else (parallel.module, parallel.optimizer)
        state: dict[str, int] = {}
        # the sharded state as the last optimizer step begins, read where the step is one module and a torch
        # optimizer (not a pipeline stage's step, nor the optimizer-in-backward stand-in, which has no step hook)
        if dims.fsdp_enabled and isinstance(module, torch.nn.Module) and isinstance(optimizer, torch.optim.Optimizer):
            optimizer.register_step_pre_hook(lambda opt, *_: state.update(_sharded_state_bytes(module, opt)))
        marker = torch.empty(SENTINEL_BYTES, dtype=torch.uint8)
        del marker
        loop = LoopState()  # what the user's loop keeps between steps (--outputs kept)
        context = parallel.step_context() if parallel is not None and parallel.step_context else contextlib.nullcontext()
        with context:
            for _ in range(spec.iterations):
                run_step(module, inputs, optimizer, source.compute_loss, spec, loop=loop)
    dist.barrier()
    # a step that marks its phases (features/grpo.py: record_function("memest.grpo." + phase)): each phase's peak in
    # the last iteration, counted as cpu_truth.measure_cpu_phase_peaks counts them (the baseline added)
    phases = profiled_phase_peaks(prof, PHASE_PREFIX, spec.iterations, allocator_totals=True)
    phases = {name: peak + baseline for name, peak in phases.items()}
    half = onednn_half_matmuls(prof)
    return {**_peak(_allocation_events(prof), baseline, rank), **({"state_bytes": state} if state else {}),
            **({"phase_peaks": phases} if phases else {}), **({"onednn_half_matmuls": half} if half else {})}


def _sharded_state_bytes(module, optimizer) -> dict[str, int]:
    """This rank's parameters, gradients and optimizer state (the local shards of FSDP's DTensors; a shard's
    storage is FSDP's padded one), in distinct storage bytes: what parallel.distributed.model_state_bytes
    counts in a trace, read from the real run's tensors. Reads sizes only: nothing is allocated."""
    params = list(module.parameters())
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    grads = [p.grad for p in params if p.grad is not None]
    # FSDP1's CPUOffload keeps a host gradient buffer (``_cpu_grad``) for every FlatParameter, frozen ones too (its
    # .grad for trainable ones); FSDP2 has none
    grads += [g for p in params if isinstance(g := getattr(p, "_cpu_grad", None), torch.Tensor)]
    return {"parameters": _distinct_storage_bytes(_plain(params)),
            "gradients": _distinct_storage_bytes(_plain(grads)),
            "optimizer_state": _distinct_storage_bytes(_plain(state))}


def _plain(tensors) -> list[torch.Tensor]:
    """The plain tensors that hold ``tensors``' memory: a wrapper subclass (FSDP's DTensor, torchao's
    WeightWithDynamicFloat8CastTensor inside it under --fp8-all-gather) owns no storage of its own, so each is
    replaced by its inner tensors (``__tensor_flatten__``), recursively."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    out, stack = [], list(tensors)[::-1]
    while stack:
        t = stack.pop()
        if isinstance(t, torch.Tensor) and is_traceable_wrapper_subclass(t):
            stack.extend(getattr(t, name) for name in reversed(t.__tensor_flatten__()[0]))
        else:
            out.append(t)
    return out


def _peak(events: list, baseline: int, rank: int) -> dict:
    first = events[0].extra_fields
    start_total = first.total_allocated - first.alloc_size
    after = next(i for i, e in enumerate(events) if e.extra_fields.alloc_size == -SENTINEL_BYTES)
    step = events[after + 1 :]
    result = {"rank": rank, "peak_bytes": baseline, "op_at_peak": None, "baseline_bytes": baseline}
    if step:
        top = max(step, key=lambda e: e.extra_fields.total_allocated)
        result["peak_bytes"] = max(baseline, top.extra_fields.total_allocated - start_total + baseline)
        result["op_at_peak"] = top.parent.name if top.parent is not None else None
    return result

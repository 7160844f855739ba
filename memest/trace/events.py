"""The trace: an ordered list of allocate/free events over storages, and what each storage is.

A storage's category is its final role (a backward op's output that becomes ``param.grad`` is a
gradient from birth); module, phase and op describe where it was allocated.
"""

from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass, field
from enum import Enum


class Category(str, Enum):
    PARAMETERS = "parameters"
    BUFFERS = "buffers"
    INPUTS = "inputs"
    GRADIENTS = "gradients"
    OPTIMIZER_STATE = "optimizer_state"
    ACTIVATIONS = "activations"  # allocated by the step and saved for backward
    TEMPORARIES = "temporaries"  # everything else the step allocates


# When one storage plays several roles, the first in this order wins.
CATEGORY_PRIORITY = list(Category)


class Phase(str, Enum):
    SETUP = "setup"  # storages alive before the step: parameters, buffers, inputs
    FORWARD = "forward"
    LOSS = "loss"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"
    ZERO_GRAD = "zero_grad"
    DECODE = "decode"  # --mode generate: one token at a time after the prefill (forward)


@dataclass
class StorageRecord:
    nbytes: int
    category: Category
    module: str  # fully qualified module name ('' = the model itself, outside any module)
    phase: Phase
    op: str
    iteration: int
    saved_for_backward: bool = False
    # held in host (CPU) memory by an offloading run (--offload): not part of the per-GPU events
    host: bool = False
    # a saved tensor's host copy made by activation offloading (--activation-offload; also ``host``), apart from
    # --offload's model state
    saved_copy: bool = False
    # the stream current when it was allocated (0: the default one; others numbered in order of first use):
    # the caching allocator keeps each stream's freed blocks for that stream (device/allocator.py)
    stream: int = 0

    def classify(self, category: Category) -> None:
        if CATEGORY_PRIORITY.index(category) < CATEGORY_PRIORITY.index(self.category):
            self.category = category


@dataclass(frozen=True)
class EmptyCache:
    """A call that empties the CUDA caching allocator's cache during the step (torch.cuda.empty_cache()): the
    allocator replay releases its cached whole segments there (device/allocator.py ``EMPTY_CACHE``)."""

    event: int  # device events before the call (the replay empties the cache between events[event - 1] and events[event])
    iteration: int  # the traced step (1, 2)
    by: str  # who calls it, for the report: "torch.cuda.empty_cache() in the forward of 'blocks.1'"
    # 1: the run calls it at this point in every step; N > 1: in one step of N (the step whose 0-based number is a
    # multiple of N: transformers' torch_empty_cache_steps), so the run also has steps that do not
    every: int = 1


@dataclass
class ModuleRecord:
    name: str  # fully qualified name, '' for the root
    type: str
    params: int  # parameters owned directly or by children (shared ones counted once)
    param_bytes: int
    output_shape: str = ""
    calls: int = 0
    output_bytes: int = 0  # bytes of the first call's tensor outputs (for the folklore formula)


@dataclass
class Trace:
    """Events are ``(storage_id, delta_bytes)``: +nbytes on allocation, -nbytes on free."""

    storages: list[StorageRecord] = field(default_factory=list)
    events: list[tuple[int, int]] = field(default_factory=list)
    # (index of the first event of the phase, iteration, phase)
    phase_marks: list[tuple[int, int, Phase]] = field(default_factory=list)
    modules: dict[str, ModuleRecord] = field(default_factory=dict)
    # storage id -> module that owns it (parameters, their gradients and optimizer state)
    owner_module: dict[int, str] = field(default_factory=dict)
    rank: int = 0  # the rank traced (--pp: the pipeline stage)
    model_type: str = ""
    attention_backends: dict[str, int] = field(default_factory=dict)  # SDPA backend -> calls (cuda)
    # FLOPs (torch.utils.flop_counter formulas) by (iteration, phase, module)
    flops: dict[tuple[int, Phase, str], int] = field(default_factory=dict)
    uncounted_flop_ops: set[str] = field(default_factory=set)  # ops whose flop formula failed (counted as 0)
    checkpointed: list[str] = field(default_factory=list)  # modules wrapped by --checkpointing
    # FLOPs one traced iteration recomputes, where a feature knows them (selective checkpointing); None: the
    # checkpointed modules' whole forward
    recompute_flops: int | None = None
    param_count: int = 0
    param_bytes: int = 0
    trainable_count: int = 0  # elements of the parameters that require grad
    # data parallelism (--world-size, --shard, --offload): the trace is rank 0's; ``events`` are its
    # device memory, ``host_events`` what an offloading run keeps in host memory, as
    # ``(number of device events before it, storage_id, delta_bytes)`` so both can be merged in order
    world_size: int = 1
    parallel: str = ""  # how the step was wrapped, e.g. "FSDP2 fully_shard (reshard_after_forward=True)"
    shard_units: list[str] = field(default_factory=list)  # modules wrapped by fully_shard ('' = root)
    host_events: list[tuple[int, int, int]] = field(default_factory=list)
    host_marks: list[int] = field(default_factory=list)  # per phase mark: host events before it
    notes: list[str] = field(default_factory=list)  # facts of the trace for the report (one line each)
    # --data-dependent upper-bound: op -> calls answered at their bound (features/upper_bound.py)
    bounded_ops: dict[str, int] = field(default_factory=dict)
    # kernel scratch whose size the CUDA library picks at run time (cuDNN workspaces): storage id ->
    # (low bytes, high bytes or None = up to the free device memory, what it is); events hold the expected
    workspace_ranges: dict[int, tuple[int, int | None, str]] = field(default_factory=dict)

    # --outputs kept: per micro-step, (index of the first event after the loss, where a loop that frees
    # outputs drops them; storage ids of the output the loop keeps from there on)
    held_outputs: list[tuple[int, list[int]]] = field(default_factory=list)
    # the step's calls that empty the CUDA cache, in event order (trace/empty_cache.py, features/empty_cache.py)
    empty_caches: list[EmptyCache] = field(default_factory=list)
    # device allocations before the step that the step's events do not hold: FSDP1's wrap (parallel/fsdp1.py
    # load_events), ``(storage_id, delta_bytes)``; a step storage allocated here (a unit's shard) is not allocated
    # again at the step's setup. The allocator replay runs them first, then resets its peaks (device/usage.py).
    load_events: list[tuple[int, int]] = field(default_factory=list)
    # the record_stream marks of those (the wrap's broadcast buckets), as ``stream_marks`` are of the step's events:
    # (load events before it, replay event); the high end's replay only
    load_marks: list[tuple[int, tuple[int, int]]] = field(default_factory=list)

    # record_stream and FSDP1's rate-limiter syncs, in event order (parallel/fsdp1.py instrument): (events before it,
    # the allocator replay's event: RECORD_STREAM_ID / FREE_EVENT_ID / GPU_PASSED_ID, device/allocator.py). The
    # replay of the high end inserts them (device/usage.py); the point estimate frees at once.
    stream_marks: list[tuple[int, tuple[int, int]]] = field(default_factory=list)

    def stream_mark(self, event: tuple[int, int]) -> None:
        """Record a replay event for the record_stream rule now (after the events so far)."""
        self.stream_marks.append((len(self.events), event))

    def empty_cache(self, iteration: int, by: str, every: int = 1) -> None:
        """Record a call that empties the CUDA cache now (after the events so far)."""
        self.empty_caches.append(EmptyCache(len(self.events), iteration, by, every))

    def streams(self) -> dict[int, int]:
        """Storage id -> the stream it was allocated on, for storages not on the default stream."""
        return {sid: rec.stream for sid, rec in enumerate(self.storages) if rec.stream}

    def held_output_bytes(self, event_index: int) -> int:
        """Bytes of model outputs alive just after ``event_index`` only because the loop keeps them
        (--outputs kept): outputs past the point where a loop that frees them would have."""
        alive = self.live_at(event_index) if self.held_outputs else set()
        sids = {sid for since, held in self.held_outputs if event_index >= since for sid in held if sid in alive}
        return sum(self.storages[sid].nbytes for sid in sids)

    def phase_at(self, event_index: int) -> tuple[int, Phase]:
        starts = [mark[0] for mark in self.phase_marks]
        i = bisect.bisect_right(starts, event_index) - 1
        if i < 0:
            return 0, Phase.SETUP
        return self.phase_marks[i][1], self.phase_marks[i][2]

    def timeline(self) -> list[int]:
        """Live bytes after each event."""
        live, out = 0, []
        for _, delta in self.events:
            live += delta
            out.append(live)
        return out

    def peak(self) -> tuple[int, int]:
        """(peak live bytes, index of the event that reached it first)."""
        live, best, best_i = 0, -1, 0
        for i, (_, delta) in enumerate(self.events):
            live += delta
            if live > best:
                best, best_i = live, i
        return max(best, 0), best_i

    def split_host(self) -> None:
        """Move the events of host storages (``StorageRecord.host``) from ``events`` to
        ``host_events``; phase marks are re-indexed to the remaining (device) events."""
        if not any(rec.host for rec in self.storages):
            return
        device: list[tuple[int, int]] = []
        new_index: list[tuple[int, int]] = []  # old event index -> (device, host) events before it
        for sid, delta in self.events:
            new_index.append((len(device), len(self.host_events)))
            if self.storages[sid].host:
                self.host_events.append((len(device), sid, delta))
            else:
                device.append((sid, delta))
        new_index.append((len(device), len(self.host_events)))
        self.events = device
        self.host_marks = [new_index[i][1] for i, _, _ in self.phase_marks]
        self.phase_marks = [(new_index[i][0], it, phase) for i, it, phase in self.phase_marks]
        self.empty_caches = [dataclasses.replace(c, event=new_index[c.event][0]) for c in self.empty_caches]
        self.stream_marks = [(new_index[i][0], event) for i, event in self.stream_marks]

    def host_peak(self, saved: bool | None = None) -> int:
        """Peak bytes held in host memory (0 without offloading). ``saved``: True counts only the saved tensors'
        copies of --activation-offload, False only the rest (--offload's model state, paged optimizer state)."""
        live = best = 0
        for _, sid, delta in self.host_events:
            if saved is None or self.storages[sid].saved_copy == saved:
                live += delta
                best = max(best, live)
        return best

    def combined_peak(self) -> int:
        """Peak of device + host bytes together, in event order: what a run whose 'device' and
        'host' are the same memory (a CPU run) holds at its peak."""
        merged = [(pos, 1, delta) for pos, _, delta in self.host_events]
        merged += [(i + 1, 0, delta) for i, (_, delta) in enumerate(self.events)]
        merged.sort(key=lambda e: (e[0], e[1]))
        live = best = 0
        for _, _, delta in merged:
            live += delta
            best = max(best, live)
        return best

    def live_at(self, event_index: int) -> set[int]:
        """Storage ids alive just after ``event_index``."""
        alive: set[int] = set()
        for sid, delta in self.events[: event_index + 1]:
            if delta > 0:
                alive.add(sid)
            else:
                alive.discard(sid)
        return alive

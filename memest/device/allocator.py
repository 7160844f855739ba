"""A replay model of PyTorch's CUDA caching allocator (the "native" backend).

Feeds a trace's allocate/free sequence through the same decisions the real allocator makes and reports
what ``torch.cuda.max_memory_reserved()`` (segments held from the driver) and
``torch.cuda.max_memory_allocated()`` (sum of block sizes handed out) would say. Pure Python, no torch.

Source followed (names below are the C++ names, so each rule can be checked against it):
  - ``DeviceCachingAllocator`` in c10/cuda/CUDACachingAllocator.cpp: ``malloc``, ``get_free_block``,
    ``should_split``, ``alloc_block``, ``alloc_found_block``, ``free_block``, ``try_merge_blocks``,
    ``release_available_cached_blocks``, ``release_cached_blocks``, ``release_blocks``,
    ``garbage_collect_cached_blocks``, ``find_expandable_block``, ``try_allocate_expandable_block``,
    ``map_block``, ``unmap_block`` and ``ExpandableSegment::map/unmap``; the same logic in its generic
    form (``CachingDeviceAllocatorImpl``, c10/core/CachingDeviceAllocator.h on pytorch main).
  - c10/core/AllocatorConfig.h/.cpp (``AcceleratorAllocatorConfig``, ``ConfigTokenizer``) and
    c10/cuda/CUDAAllocatorConfig.h for PYTORCH_CUDA_ALLOC_CONF. The headers were read from the installed
    torch 2.13.0 (git cf30153c); the .cpp files from public pytorch snapshots before and after 2.13, which
    agree on every rule modelled here.

Streams: "Allocations are associated with a stream. Once freed, blocks can be re-allocated on the same
stream, but not on any other stream" (the header comment of CUDACachingAllocator.cpp). Each block carries
the stream it was allocated on: the pools order free blocks by (stream, size, address) as
``BlockComparatorSize`` does and unmapped ones by (stream, address) as ``BlockComparatorAddress`` does,
``get_free_block`` and ``release_available_cached_blocks`` look only at the request's stream,
``find_expandable_block`` grows only the request's stream's expandable segment, while
``release_cached_blocks`` (the OOM retry, ``empty_cache``) and ``garbage_collect_cached_blocks`` take free
segments of every stream. A replay is told each storage's stream (``streams``; default: stream 0).

``torch.cuda.empty_cache()`` in the step: an ``EMPTY_CACHE`` event. torch/cuda/memory.py ``empty_cache`` calls
``torch._C._cuda_emptyCache`` (``torch.accelerator.empty_cache``, torch/accelerator/memory.py, reaches the same
allocator through ``_accelerator_emptyCache``), which is ``DeviceCachingAllocator::emptyCache``:
``release_cached_blocks(context, mempool_id)`` under the allocator's lock, the same release the OOM retry runs:
every cached block with no neighbour (a whole free segment, of any stream) is cudaFree'd (``release_blocks``); a
segment with a live block keeps its free parts; an expandable segment unmaps the whole free pages inside each free
block and is released once nothing of it stays mapped. Nothing live moves; the peaks are high-water marks, so
max_memory_reserved keeps what was reserved before the call.

``record_stream`` (FSDP1 frees its unsharded/low-precision/offloaded flat params after
``_no_dispatch_record_stream``): a replay given ``recorded`` storages models the worst case, a GPU far behind the
CPU. DeviceCachingAllocator::free (CUDACachingAllocator.cpp) sets ``block->allocated = false`` and decreases the
allocated/requested stats first, then, for a block with ``stream_uses``, calls ``insert_events`` instead of
``free_block``: the block leaves ``allocated`` at once (max_memory_allocated unchanged) but stays out of the pools,
still reserved, until ``process_events`` (run at every malloc) finds its events complete. Worst case: none completes
until the CPU waits for the GPU: a ``GPU_PASSED`` event (FSDP1's rate limiter, torch/distributed/fsdp/
_runtime_utils.py ``_unshard``: ``_free_event_queue.dequeue_if_needed()`` then ``event.synchronize()`` on the free
event ``_reshard`` recorded; _limiter_utils.py keeps 2 in flight) returns every block freed before that event's
record; ``release_cached_blocks`` (OOM retry, empty_cache) first runs ``synchronize_and_free_events`` (all pending
blocks return); the trace's end returns the rest. Without ``recorded`` every free is immediate (the best case).

Scope: one device, no CUDA graphs/private pools, no free-memory callbacks, no cudaMallocAsync backend. Fragmentation of physical GPU
memory is not modelled: cudaMalloc succeeds whenever the bytes fit under ``device_limit_bytes``. Other
simplifications are marked ``SIMPLIFICATION``.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

# --- constants (c10/core/AllocatorConfig.h and CUDACachingAllocator.cpp) -----------------------------
KIB = 1024
MIB = 1024 * 1024
kMinBlockSize = 512  # all sizes are rounded to at least 512 bytes
kSmallSize = 1 * MIB  # largest "small" allocation is 1 MiB
kSmallBuffer = 2 * MIB  # "small" allocations are packed in 2 MiB blocks; small-pool expandable page
kMinLargeAlloc = 10 * MIB  # allocations between 1 and 10 MiB may use kLargeBuffer
kRoundLarge = 2 * MIB  # round up large allocations to 2 MiB
kLargeBuffer = 20 * MIB  # "large" allocations may be packed in 20 MiB blocks (= default large_segment_size)
# AllocatorConfig.cpp: roundup_power2_divisions has one entry per power-of-two interval 1 MiB .. 64 GiB.
kRoundUpPowerOfTwoIntervals = 16
_LOG2_ROUNDUP_START = 20  # log2(kRoundUpPowerOfTwoStart = 1 MiB)

# Keys torch 2.13 accepts but that do not change what this model computes.
_IGNORED_KEYS = frozenset({
    "release_lock_on_cudamalloc", "release_lock_on_hipmalloc", "pinned_use_cuda_host_register",
    "pinned_use_hip_host_register", "pinned_use_background_threads", "pinned_num_register_threads",
    "pinned_reserve_segment_size_mb", "pinned_free_catch_all", "graph_capture_record_stream_reuse",
    "throw_on_cudamalloc_oom",
})


# --- configuration ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AllocatorConfig:
    """The PYTORCH_CUDA_ALLOC_CONF settings that change allocation decisions. Sizes in bytes."""

    max_split_size: int | None = None  # None = unlimited (SIZE_MAX), torch's default
    expandable_segments: bool = False
    large_segment_size: int = kLargeBuffer  # large_segment_size_mb; segment for 1-10 MiB requests
    max_non_split_rounding_size: int | None = None  # None = large_segment_size (torch's default)
    roundup_power2_divisions: tuple[int, ...] = (0,) * kRoundUpPowerOfTwoIntervals
    garbage_collection_threshold: float = 0.0
    per_process_memory_fraction: float | None = None  # caps reserved at fraction * device_limit_bytes
    backend: str = "native"  # "cudaMallocAsync" is a different allocator: replay refuses it
    ignored_keys: tuple[str, ...] = ()  # accepted by torch, no effect on this model
    unknown_keys: tuple[str, ...] = ()  # not torch 2.13 keys (torch itself would raise on these)

    @property
    def non_split_rounding(self) -> int:
        if self.max_non_split_rounding_size is None:
            return self.large_segment_size
        return self.max_non_split_rounding_size


def _tokenize(text: str) -> list[str]:
    """ConfigTokenizer: ',', ':', '[' and ']' are tokens of their own; whitespace is dropped."""
    tokens: list[str] = []
    buf = ""
    for ch in text:
        if ch in ",:[]":
            if buf:
                tokens.append(buf)
                buf = ""
            tokens.append(ch)
        elif not ch.isspace():
            buf += ch
    if buf:
        tokens.append(buf)
    return tokens


class _Tokens:
    def __init__(self, text: str):
        self.t = _tokenize(text)

    def get(self, i: int) -> str:
        if i >= len(self.t):
            raise ValueError("PYTORCH_CUDA_ALLOC_CONF: unexpected end of settings")
        return self.t[i]

    def expect(self, i: int, token: str) -> None:
        if self.get(i) != token:
            raise ValueError(f"PYTORCH_CUDA_ALLOC_CONF: expected {token!r} at token {i}, got {self.get(i)!r}")

    def size_t(self, i: int) -> int:
        try:
            return int(self.get(i))
        except ValueError:
            raise ValueError(f"PYTORCH_CUDA_ALLOC_CONF: expected an integer, got {self.get(i)!r}") from None

    def boolean(self, i: int) -> bool:
        token = self.get(i)  # ConfigTokenizer::toBool accepts exactly "True" / "False"
        if token not in ("True", "False"):
            raise ValueError(f"PYTORCH_CUDA_ALLOC_CONF: expected 'True' or 'False', got {token!r}")
        return token == "True"

    def skip_key(self, i: int) -> int:
        """ConfigTokenizer::skipKey: index of the value token, or of the closing ']' of a list."""
        self.expect(i + 1, ":")
        i += 2
        if self.get(i) != "[":
            return i
        while self.get(i) != "]":
            i += 1
        return i


def _parse_roundup(tok: _Tokens, i: int, divisions: list[int]) -> int:
    """AcceleratorAllocatorConfig::parseRoundUpPower2Divisions; keys of the list form are MiB."""

    def check_division(value: int) -> None:
        if value != 0 and value & (value - 1):
            raise ValueError("roundup_power2_divisions: the divisions have to be a power of 2 or 0")

    i += 1
    if tok.get(i) != "[":  # single value for every interval (kept for backwards compatibility)
        value = tok.size_t(i)
        if value <= 0 or value & (value - 1):
            raise ValueError("roundup_power2_divisions: the divisions have to be a power of 2")
        divisions[:] = [value] * kRoundUpPowerOfTwoIntervals
        return i
    first, last_index = True, 0
    while tok.get(i + 1) != "]":
        i += 1
        key = tok.get(i)
        tok.expect(i + 1, ":")
        value = tok.size_t(i + 2)
        i += 2
        check_division(value)
        if key == ">":
            divisions[last_index + 1:] = [value] * (kRoundUpPowerOfTwoIntervals - last_index - 1)
        else:
            boundary = tok.size_t(i - 2)
            if boundary <= 0 or boundary & (boundary - 1):
                raise ValueError("roundup_power2_divisions: the intervals have to be powers of 2")
            index = min(boundary.bit_length() - 1, kRoundUpPowerOfTwoIntervals - 1)
            if first:
                divisions[:index] = [value] * index
                first = False
            divisions[index] = value
            last_index = index
        if tok.get(i + 1) != "]":
            tok.expect(i + 1, ",")
            i += 1
    return i + 1


def parse_alloc_conf(text: str | None) -> AllocatorConfig:  # noqa: C901 -- mirrors parseArgs branch for branch
    """Parse a PYTORCH_CUDA_ALLOC_CONF / PYTORCH_ALLOC_CONF string the way torch 2.13 does.

    Invalid values raise ValueError as torch does. Keys torch accepts but that do not matter here land in
    ``ignored_keys``; keys torch does not know land in ``unknown_keys`` (torch would raise on them).
    """
    if not text or not text.strip():
        return AllocatorConfig()
    tok = _Tokens(text)
    # AcceleratorAllocatorConfig::parseArgs reads large_segment_size_mb first: the minimum of
    # max_split_size_mb and the default of max_non_split_rounding_mb depend on it.
    large_segment_size = kLargeBuffer
    i = 0
    while i < len(tok.t):
        if tok.t[i] == "large_segment_size_mb":
            tok.expect(i + 1, ":")
            value = tok.size_t(i + 2)
            if value <= kMinLargeAlloc // MIB:  # parseLargeSegmentSize: must be > kMinLargeAlloc
                raise ValueError(f"large_segment_size_mb must be > {kMinLargeAlloc // MIB} MB")
            large_segment_size = value * MIB
            i += 2
        i += 1
    values: dict = {"large_segment_size": large_segment_size}
    divisions = [0] * kRoundUpPowerOfTwoIntervals
    ignored: list[str] = []
    unknown: list[str] = []
    i = 0
    while i < len(tok.t):
        key = tok.t[i]
        if key in ("max_split_size_mb", "max_non_split_rounding_mb"):
            tok.expect(i + 1, ":")
            i += 2
            mb = tok.size_t(i)
            if mb < large_segment_size // MIB:  # parseMaxSplitSize / parseMaxNonSplitRoundingSize
                raise ValueError(f"{key} too small, must be >= {large_segment_size // MIB}")
            name = "max_split_size" if key == "max_split_size_mb" else "max_non_split_rounding_size"
            values[name] = mb * MIB
        elif key == "garbage_collection_threshold":
            tok.expect(i + 1, ":")
            i += 2
            try:
                threshold = float(tok.get(i))
            except ValueError:
                raise ValueError(f"garbage_collection_threshold: not a number: {tok.get(i)!r}") from None
            if not 0.0 < threshold < 1.0:
                raise ValueError("garbage_collect_threshold is invalid, set it in (0.0, 1.0)")
            values["garbage_collection_threshold"] = threshold
        elif key == "roundup_power2_divisions":
            tok.expect(i + 1, ":")
            i = _parse_roundup(tok, i + 1, divisions)
        elif key == "expandable_segments":
            tok.expect(i + 1, ":")
            i += 2
            values["expandable_segments"] = tok.boolean(i)
        elif key == "per_process_memory_fraction":  # CUDAAllocatorConfig::parsePerProcessMemoryFraction
            tok.expect(i + 1, ":")
            i += 2
            fraction = float(tok.get(i))
            if not 0.0 <= fraction <= 1.0:
                raise ValueError("per_process_memory_fraction must be in [0.0, 1.0]")
            values["per_process_memory_fraction"] = fraction
        elif key == "backend":
            tok.expect(i + 1, ":")
            i += 2
            backend = tok.get(i)
            if backend not in ("native", "cudaMallocAsync"):
                raise ValueError("Unknown allocator backend, options are native and cudaMallocAsync")
            values["backend"] = backend
        elif key == "large_segment_size_mb":
            i = tok.skip_key(i)  # handled in the first pass
        else:
            (ignored if key in _IGNORED_KEYS else unknown).append(key)
            i = tok.skip_key(i)
        if i + 1 < len(tok.t):
            tok.expect(i + 1, ",")
            i += 1
        i += 1
    return AllocatorConfig(
        **values,
        roundup_power2_divisions=tuple(divisions),
        ignored_keys=tuple(ignored),
        unknown_keys=tuple(unknown),
    )


# AcceleratorAllocatorConfig::instance reads the first of these that is set; torchtitan's run_train.sh sets
# PYTORCH_ALLOC_CONF="expandable_segments:True" (https://github.com/pytorch/torchtitan/blob/main/run_train.sh)
ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def alloc_conf_text(environ: Mapping[str, str]) -> tuple[str, str]:
    """(variable, value) of the allocator settings torch reads: the first of ALLOC_CONF_VARS that is set."""
    for var in ALLOC_CONF_VARS:
        if var in environ:
            return var, environ[var]
    return ALLOC_CONF_VARS[0], ""


def alloc_conf_from_env(environ: Mapping[str, str]) -> AllocatorConfig:
    """AcceleratorAllocatorConfig::instance: the first of ALLOC_CONF_VARS that is set wins."""
    return parse_alloc_conf(alloc_conf_text(environ)[1])


# --- size rules ---------------------------------------------------------------------------------------
def roundup_power2_next_division(size: int, divisions: int) -> int:
    """DeviceCachingAllocator::roundup_power2_next_division."""
    if size & (size - 1) == 0:
        return size
    power2_floor = 1 << (size.bit_length() - 1)
    power2_division = power2_floor >> (divisions.bit_length() - 1)
    if power2_division == 0:
        return power2_floor << 1
    round_size_floor = size & ~(power2_division - 1)
    return size if round_size_floor == size else round_size_floor + power2_division


def round_size(size: int, config: AllocatorConfig | None = None) -> int:
    """DeviceCachingAllocator::round_size: the block size a request of ``size`` bytes gets."""
    if size < kMinBlockSize:
        return kMinBlockSize
    if config is not None and any(config.roundup_power2_divisions):
        # AcceleratorAllocatorConfig::roundup_power2_divisions(size): interval index log2(size) - 20
        index = min(max(size.bit_length() - 1 - _LOG2_ROUNDUP_START, 0), kRoundUpPowerOfTwoIntervals - 1)
        divisions = config.roundup_power2_divisions[index]
        if divisions > 1 and size > kMinBlockSize * divisions:
            return roundup_power2_next_division(size, divisions)
    return -(-size // kMinBlockSize) * kMinBlockSize


def get_allocation_size(size: int, large_segment_size: int = kLargeBuffer) -> int:
    """DeviceCachingAllocator::get_allocation_size: the cudaMalloc size for a rounded request."""
    if size <= kSmallSize:
        return kSmallBuffer
    if size < kMinLargeAlloc:
        return large_segment_size
    return -(-size // kRoundLarge) * kRoundLarge


# --- internal state -----------------------------------------------------------------------------------
# A free block's pool key is (stream << 128) | (size << 64) | addr: it orders by (stream, size, address) like
# BlockComparatorSize; an unmapped block's is (stream << 128) | addr, BlockComparatorAddress's order.
_SHIFT = 64
_STREAM_SHIFT = 128
_ADDR_MASK = (1 << _SHIFT) - 1
_NO_LIMIT = 1 << 80  # larger than any total the driver is asked for
_VA_ALIGN = 2 * MIB  # SIMPLIFICATION: each new segment gets a fresh address above all earlier ones

# The event ``(EMPTY_CACHE_ID, 0)`` in a replay's events: torch.cuda.empty_cache() at that point (module docstring).
# No storage has a negative id (device/usage.py's cuBLAS workspaces are -1 and -2).
EMPTY_CACHE_ID = -(1 << 40)
EMPTY_CACHE = (EMPTY_CACHE_ID, 0)
# The event ``(RESET_PEAK_ID, 0)``: torch.cuda.reset_peak_memory_stats() at that point: the peaks restart from the
# current allocated / reserved / requested bytes (DeviceCachingAllocator::resetPeakStats). The replay puts one after
# the events before the step (device/usage.py allocator_events: FSDP1's wrap), so its peaks are the step's, as a
# loop that resets them after the wrap (fsdp_qlora's train.py) reads them; reserved memory never shrinks without
# an empty_cache or an OOM retry, so the peak reserved after it also holds what the wrap left cached.
RESET_PEAK_ID = -(1 << 40) - 1
RESET_PEAK = (RESET_PEAK_ID, 0)
# record_stream (module docstring). ``(RECORD_STREAM_ID, sid)``: storage ``sid`` was used on another stream, its next
# free leaves its block pending. ``(FREE_EVENT_ID, k)``: a CUDA event ``k`` recorded here (FSDP1's ``_reshard``).
# ``(GPU_PASSED_ID, k)``: the CPU synchronised on event ``k`` (FSDP1's rate limiter): the pending blocks freed before
# that event return to their pools.
RECORD_STREAM_ID = -(1 << 40) - 2
FREE_EVENT_ID = -(1 << 40) - 3
GPU_PASSED_ID = -(1 << 40) - 4


class _Segment:
    """One cudaMalloc'd segment, or one ExpandableSegment (a VA range with pages mapped on demand)."""

    __slots__ = ("base", "size", "expandable", "page", "mapped")

    def __init__(self, base: int, size: int, expandable: bool, page: int = 0):
        self.base, self.size, self.expandable, self.page = base, size, expandable, page
        self.mapped = 0  # bytes of mapped pages (expandable only)

    def reserved(self) -> int:
        return self.mapped if self.expandable else self.size


class _Block:
    __slots__ = ("addr", "size", "requested", "allocated", "mapped", "prev", "next", "pool", "seg",
                 "gc_base", "stream", "pending")

    def __init__(self, addr: int, size: int, pool: _Pool, seg: _Segment, mapped: bool = True, stream: int = 0):
        self.addr, self.size, self.pool, self.seg, self.mapped = addr, size, pool, seg, mapped
        self.stream = stream
        self.pending = False  # freed with stream uses, its events not complete (record_stream, module docstring)
        self.requested = 0
        self.allocated = False
        self.prev: _Block | None = None
        self.next: _Block | None = None
        self.gc_base = 0

    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None


class _Pool:
    """BlockPool: free mapped blocks ordered by (stream, size, address); unmapped ones by (stream, address)."""

    __slots__ = ("is_small", "keys", "unmapped", "gc_calls")

    def __init__(self, is_small: bool):
        self.is_small = is_small
        self.keys: list[int] = []
        self.unmapped: list[int] = []
        self.gc_calls = 0  # get_free_blocks_call_count


class OutOfMemory(Exception):
    """The allocator would raise torch.OutOfMemoryError: no cached block fits and the device is full."""

    def __init__(self, size: int, alloc_size: int, reserved: int, allocated: int):
        super().__init__(
            f"out of memory: tried to allocate {alloc_size} bytes (request {size}); "
            f"{allocated} allocated, {reserved} reserved"
        )
        self.size, self.alloc_size, self.reserved, self.allocated = size, alloc_size, reserved, allocated


@dataclass
class ReplayResult:
    peak_allocated: int  # max_memory_allocated(): sum of block sizes (rounded, unsplit remainders)
    peak_reserved: int  # max_memory_reserved(): bytes of segments / mapped pages
    final_reserved: int
    num_segments: int  # segments held at the end (cudaMalloc'd ones + live expandable segments)
    peak_requested: int  # memory_stats()["requested_bytes.all.peak"]: sum of unrounded request sizes
    final_allocated: int = 0
    peak_allocated_event: int = -1  # index of the event that first reached the peak
    peak_reserved_event: int = -1
    num_device_allocs: int = 0  # cudaMalloc + cuMemMap calls (stats.num_device_alloc)
    num_device_frees: int = 0  # cudaFree + unmap calls (OOM retries, empty_cache)
    num_alloc_retries: int = 0
    empty_cache_calls: int = 0  # EMPTY_CACHE events replayed
    empty_cache_released: int = 0  # reserved bytes they returned to the driver, all calls together
    peak_reserved_pending: int = 0  # record_stream'd blocks pending (freed, not reusable) at the reserved peak
    oom: bool = False  # the replay stopped: this request would raise OutOfMemoryError
    oom_event_index: int | None = None
    oom_request_bytes: int | None = None
    segment_sizes: tuple[int, ...] = field(default_factory=tuple)  # final, reserved bytes per segment
    # Device limits [low, high) under which the replay takes exactly this path (same result, OOM or not);
    # high None = no upper end; None = only the limit replayed is known (CachingAllocator.same_replay_limits)
    same_replay_limits: tuple[int, int | None] | None = None


def _stream_range(keys: list[int], stream: int) -> tuple[int, int]:
    """The slice of a pool's sorted keys that holds ``stream``'s blocks."""
    return (bisect.bisect_left(keys, stream << _STREAM_SHIFT),
            bisect.bisect_left(keys, (stream + 1) << _STREAM_SHIFT))


class CachingAllocator:
    """DeviceCachingAllocator for one device, its streams' blocks apart.

    ``device_limit_bytes`` is the memory cudaMalloc can hand out (the GPU minus the CUDA context and
    other processes); None means unlimited, so only the OOM-recovery paths differ.
    """

    def __init__(self, config: AllocatorConfig | None = None, device_limit_bytes: int | None = None):
        self.config = config or AllocatorConfig()
        if self.config.backend != "native":
            raise ValueError(f"backend:{self.config.backend} is not the caching allocator modelled here")
        self.limit = device_limit_bytes
        self.max_split = self.config.max_split_size  # None = SIZE_MAX
        self.expandable = self.config.expandable_segments
        self.rounds_power2 = any(self.config.roundup_power2_divisions)
        # setMemoryFraction: allowed_memory_maximum = fraction * device total; set_fraction also enables
        # garbage_collection_threshold. SIMPLIFICATION: the total is device_limit_bytes (torch multiplies
        # the whole GPU, context included), and any per_process_memory_fraction given counts as set.
        fraction = self.config.per_process_memory_fraction
        self.set_fraction = fraction is not None and device_limit_bytes is not None
        self.allowed_max = int(fraction * device_limit_bytes) if self.set_fraction else 0
        self.gc_enabled = self.set_fraction and self.config.garbage_collection_threshold > 0.0
        # ExpandableSegment reserves VA for 1 1/8 of the GPU's memory. SIMPLIFICATION: the GPU's memory is
        # device_limit_bytes, or 1 TiB when unlimited; only its size relative to blocks matters.
        self.es_va_total = (device_limit_bytes or (1 << 40)) * 9 // 8
        self.small = _Pool(True)
        self.large = _Pool(False)
        self.free_blocks: dict[int, _Block] = {}  # addr -> free mapped block in some pool's keys
        self.unmapped_blocks: dict[int, _Block] = {}  # addr -> unmapped block
        self.segments: set[_Segment] = set()
        self.pending: list[tuple[int, _Block]] = []  # (event freed at, block): record_stream'd, events not complete
        self.pending_bytes = self.peak_reserved_pending = 0  # their bytes; and at the reserved peak
        self.next_va = 1 << 32
        self.event = -1  # set by replay so peaks can be located
        # DeviceStats (aggregate)
        self.allocated = self.reserved = self.requested = 0
        self.peak_allocated = self.peak_reserved = self.peak_requested = 0
        self.peak_allocated_event = self.peak_reserved_event = -1
        self.total_allocated_memory = 0  # bytes obtained from the driver, as torch tracks it
        self.num_device_alloc = self.num_device_free = self.num_alloc_retries = 0
        # the largest total the driver granted and the smallest it refused (see same_replay_limits)
        self.limit_granted_max = 0
        self.limit_refused_min = _NO_LIMIT

    # --- stats -------------------------------------------------------------------------------------
    def reset_peaks(self) -> None:
        """resetPeakStats: every peak restarts from its current value."""
        self.peak_allocated, self.peak_reserved, self.peak_requested = self.allocated, self.reserved, self.requested
        self.peak_allocated_event = self.peak_reserved_event = self.event
        self.peak_reserved_pending = self.pending_bytes

    def _add_reserved(self, n: int) -> None:
        self.total_allocated_memory += n
        self.reserved += n
        if self.reserved > self.peak_reserved:
            self.peak_reserved = self.reserved
            self.peak_reserved_event = self.event
            self.peak_reserved_pending = self.pending_bytes

    def _sub_reserved(self, n: int) -> None:
        self.total_allocated_memory -= n
        self.reserved -= n

    # --- pool bookkeeping --------------------------------------------------------------------------
    def _insert(self, b: _Block) -> None:
        """BlockPool::insert_into_blocks."""
        b.gc_base = b.pool.gc_calls
        bisect.insort(b.pool.keys, (b.stream << _STREAM_SHIFT) | (b.size << _SHIFT) | b.addr)
        self.free_blocks[b.addr] = b

    def _erase(self, b: _Block) -> None:
        keys = b.pool.keys
        keys.pop(bisect.bisect_left(keys, (b.stream << _STREAM_SHIFT) | (b.size << _SHIFT) | b.addr))
        del self.free_blocks[b.addr]

    def _insert_unmapped(self, b: _Block) -> None:
        bisect.insort(b.pool.unmapped, (b.stream << _STREAM_SHIFT) | b.addr)
        self.unmapped_blocks[b.addr] = b

    def _erase_unmapped(self, b: _Block) -> None:
        unmapped = b.pool.unmapped
        unmapped.pop(bisect.bisect_left(unmapped, (b.stream << _STREAM_SHIFT) | b.addr))
        del self.unmapped_blocks[b.addr]

    def _new_va(self, size: int) -> int:
        addr = self.next_va
        self.next_va += -(-size // _VA_ALIGN) * _VA_ALIGN
        return addr

    # --- malloc / free -----------------------------------------------------------------------------
    def malloc(self, orig_size: int, stream: int = 0) -> _Block:
        """DeviceCachingAllocator::malloc on ``stream``."""
        if orig_size <= 0:
            raise ValueError(f"allocation of {orig_size} bytes (zero-byte storages take no block)")
        size = round_size(orig_size, self.config) if self.rounds_power2 else (
            kMinBlockSize if orig_size < kMinBlockSize else (orig_size + kMinBlockSize - 1) & -kMinBlockSize)
        pool = self.small if size <= kSmallSize else self.large  # get_pool
        alloc_size = get_allocation_size(size, self.config.large_segment_size)
        block = self._get_free_block(pool, size, stream)
        if block is None:
            if self.gc_enabled:
                self._garbage_collect_cached_blocks()
            block = (
                self._alloc_block(pool, size, alloc_size, False, stream)
                or (self._release_available_cached_blocks(pool, size, stream)
                    and self._alloc_block(pool, size, alloc_size, False, stream))
                or (self._release_cached_blocks() and self._alloc_block(pool, size, alloc_size, True, stream))
            )
            if not block:
                raise OutOfMemory(orig_size, alloc_size, self.reserved, self.allocated)
        return self._alloc_found_block(block, size, orig_size, self._should_split(block, size))

    def free(self, block: _Block, recorded: bool = False) -> None:
        """DeviceCachingAllocator::free: the stats first; no stream uses: straight to free_block; ``recorded``
        (record_stream'd): ``insert_events``, the block pending (not in a pool) until :meth:`return_pending`."""
        self.allocated -= block.size
        self.requested -= block.requested
        block.allocated = False
        if recorded:
            block.pending = True
            self.pending.append((self.event, block))
            self.pending_bytes += block.size
        else:
            self._free_block(block)

    def return_pending(self, before: int | None = None) -> int:
        """process_events finding complete the events of the pending blocks freed before event ``before`` (all:
        None): free_block each. Returns their bytes."""
        done = [b for i, b in self.pending if before is None or i < before]
        self.pending = [(i, b) for i, b in self.pending if before is not None and i >= before]
        for b in done:
            b.pending = False
            self.pending_bytes -= b.size
            self._free_block(b)
        return sum(b.size for b in done)

    def _get_free_block(self, pool: _Pool, size: int, stream: int = 0) -> _Block | None:
        """get_free_block: best fit = the smallest cached block >= size of the request's stream (lower_bound
        on (stream, size, addr), then ``(*it)->stream != p.stream()`` fails it)."""
        if self.gc_enabled:
            pool.gc_calls += 1
        keys = pool.keys
        i = bisect.bisect_left(keys, (stream << _STREAM_SHIFT) | (size << _SHIFT))
        end = bisect.bisect_left(keys, (stream + 1) << _STREAM_SHIFT, i)
        if i == end:
            return None
        block = self.free_blocks[keys[i] & _ADDR_MASK]
        if block.seg.expandable:
            if self.expandable:
                # Best fit on the size a block can expand to: a block followed by unmapped space (the
                # segment's tail) counts as huge, so a larger ordinary block is preferred to it.
                def expandable_size(b: _Block) -> int:
                    nxt = b.next
                    return b.size + (nxt.size if nxt is not None and not nxt.mapped else 0)

                j = i + 1
                while block.seg.expandable and j < end:
                    nxt_block = self.free_blocks[keys[j] & _ADDR_MASK]
                    if expandable_size(nxt_block) >= expandable_size(block):
                        break
                    block, i, j = nxt_block, j, j + 1
            else:  # expandable segments switched off later: only non-expandable blocks qualify
                i += 1
                while i < end and self.free_blocks[keys[i] & _ADDR_MASK].seg.expandable:
                    i += 1
                if i == end:
                    return None
                block = self.free_blocks[keys[i] & _ADDR_MASK]
        if self.max_split is not None:
            # Do not return an oversized block for a large request
            if size < self.max_split and block.size >= self.max_split:
                return None
            # Allow oversized block size to be rounded up but within a limit
            if size >= self.max_split and block.size >= size + self.config.non_split_rounding:
                return None
        keys.pop(i)
        del self.free_blocks[block.addr]
        return block

    def _should_split(self, block: _Block, size: int) -> bool:
        """should_split."""
        remaining = block.size - size
        if block.pool.is_small or self.expandable:
            return remaining >= kMinBlockSize
        return (self.max_split is None or size < self.max_split) and remaining > kSmallSize

    def _alloc_found_block(self, block: _Block, size: int, orig_size: int, split: bool) -> _Block:
        """alloc_found_block: the front ``size`` bytes become the block; the remainder goes back."""
        if split:
            remaining = block
            block = _Block(remaining.addr, size, remaining.pool, remaining.seg, stream=remaining.stream)
            block.prev = remaining.prev
            if block.prev is not None:
                block.prev.next = block
            block.next = remaining
            remaining.prev = block
            remaining.addr += size
            remaining.size -= size
            self._insert(remaining)
        block.allocated = True
        block.requested = orig_size
        self.allocated += block.size
        if self.allocated > self.peak_allocated:
            self.peak_allocated = self.allocated
            self.peak_allocated_event = self.event
        self.requested += orig_size
        if self.requested > self.peak_requested:
            self.peak_requested = self.requested
        return block

    def _free_block(self, block: _Block) -> None:
        """free_block: merge with free neighbours of the same segment, then cache."""
        self._try_merge(block, block.prev)
        self._try_merge(block, block.next)
        self._insert(block)

    def _try_merge(self, dst: _Block, src: _Block | None) -> int:
        """try_merge_blocks: dst (not in a pool) absorbs its free neighbour src of the same mapped state."""
        # a pending src (stream uses, events outstanding) does not merge either: try_merge_blocks' test
        if src is None or src.allocated or src.pending or dst.mapped != src.mapped:
            return 0
        if src.mapped:
            self._erase(src)
        else:
            self._erase_unmapped(src)
        if dst.prev is src:  # [src dst]
            dst.addr = src.addr
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:  # [dst src]
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size
        return src.size

    # --- getting memory from the driver ------------------------------------------------------------
    def _under_limit(self, total: int) -> bool:
        """Would the driver hand out memory so that ``total`` bytes are held? Every such question is
        recorded: the replay takes the same path for every limit that answers them all the same way."""
        if self.limit is not None and total > self.limit:
            self.limit_refused_min = min(self.limit_refused_min, total)
            return False
        self.limit_granted_max = max(self.limit_granted_max, total)
        return True

    def _alloc_block(self, pool: _Pool, size: int, alloc_size: int, is_retry: bool, stream: int = 0) -> _Block | None:
        """alloc_block: cudaMalloc(alloc_size), or map pages of an expandable segment."""
        if is_retry:
            self.num_alloc_retries += 1
        if self.set_fraction and self.total_allocated_memory + alloc_size > self.allowed_max:
            return None
        if self.expandable:
            return self._try_allocate_expandable_block(pool, size, stream)
        if not self._under_limit(self.total_allocated_memory + alloc_size):
            return None  # cudaMalloc fails with cudaErrorMemoryAllocation
        seg = _Segment(self._new_va(alloc_size), alloc_size, expandable=False)
        self.segments.add(seg)
        self._add_reserved(alloc_size)
        self.num_device_alloc += 1
        return _Block(seg.base, alloc_size, pool, seg, stream=stream)

    def _release_block(self, block: _Block) -> None:
        """release_block: cudaFree an unsplit cached segment."""
        self._erase(block)
        self.segments.discard(block.seg)
        self._sub_reserved(block.size)
        self.num_device_free += 1

    def _release_available_cached_blocks(self, pool: _Pool, size: int, stream: int = 0) -> bool:
        """release_available_cached_blocks: free oversize blocks of the request's stream, only enough to
        satisfy the request."""
        if self.max_split is None:
            return False
        key_size = max(size, self.max_split)
        keys = pool.keys
        i = bisect.bisect_left(keys, (stream << _STREAM_SHIFT) | (key_size << _SHIFT))
        if (i == len(keys) or keys[i] >> _STREAM_SHIFT != stream
                or self.free_blocks[keys[i] & _ADDR_MASK].seg.expandable):
            # No single block is large enough; free multiple oversize blocks, starting with the largest
            if i == 0:
                return False
            released = 0
            i -= 1
            while released < key_size:
                cur = self.free_blocks[keys[i] & _ADDR_MASK]
                if cur.size < self.max_split or cur.stream != stream:
                    break
                is_first = i == 0
                if not is_first:
                    i -= 1
                if not cur.seg.expandable:
                    released += cur.size
                    self._release_block(cur)
                if is_first:
                    break
            return released >= key_size
        self._release_block(self.free_blocks[keys[i] & _ADDR_MASK])
        return True

    def _release_cached_blocks(self) -> bool:
        """release_cached_blocks (also what torch.cuda.empty_cache() does): synchronize_and_free_events first."""
        self.return_pending()
        self._release_blocks(self.large)
        self._release_blocks(self.small)
        return True

    def empty_cache(self) -> int:
        """DeviceCachingAllocator::emptyCache: release_cached_blocks. Returns the reserved bytes released."""
        before = self.reserved
        self._release_cached_blocks()
        return before - self.reserved

    def _release_blocks(self, pool: _Pool) -> None:
        """release_blocks: cudaFree every unsplit cached block; unmap free pages of expandable ones."""
        to_unmap = []
        for key in list(pool.keys):
            block = self.free_blocks[key & _ADDR_MASK]
            if block.seg.expandable:
                to_unmap.append(block)
            elif block.prev is None and block.next is None:
                self._release_block(block)
        for block in to_unmap:
            self._unmap_block(block)
            if not block.mapped and block.prev is None and block.next is None:
                # release_expandable_segment: nothing of the segment is mapped any more
                self._erase_unmapped(block)
                self.segments.discard(block.seg)

    def _garbage_collect_cached_blocks(self) -> None:
        """garbage_collect_cached_blocks: free large unsplit blocks not reused for long (by gc_count)."""
        gc_threshold = int(self.config.garbage_collection_threshold * self.allowed_max)
        if self.total_allocated_memory <= gc_threshold:
            return
        target = self.total_allocated_memory - gc_threshold
        pool = self.large
        blocks = [self.free_blocks[k & _ADDR_MASK] for k in pool.keys]
        ages = [pool.gc_calls - b.gc_base for b in blocks if not b.is_split()]
        total_age, count = sum(ages), len(ages)
        if count == 0:
            return
        reclaimed, freed = 0, True
        while reclaimed < target and freed and count > 0:
            threshold = total_age / count
            freed = False
            for key in list(pool.keys):
                block = self.free_blocks[key & _ADDR_MASK]
                age = pool.gc_calls - block.gc_base
                if not block.is_split() and not block.seg.expandable and age >= threshold:
                    freed = True
                    reclaimed += block.size
                    total_age -= age
                    count -= 1
                    self._release_block(block)

    # --- expandable segments -----------------------------------------------------------------------
    def _find_expandable_block(self, pool: _Pool, size: int, stream: int = 0) -> _Block:
        """find_expandable_block: lowest address of the stream's expandable segments where free + unmapped
        space holds ``size`` bytes; else a new segment for the stream."""

        def has_available_address_space(b: _Block | None) -> bool:
            total = 0
            while total < size and b is not None and not b.allocated and not b.pending:
                total += b.size
                b = b.next
            return total >= size

        lo, hi = _stream_range(pool.unmapped, stream)
        for key in pool.unmapped[lo:hi]:
            c = self.unmapped_blocks[key & _ADDR_MASK]
            if c.prev is not None and not c.prev.allocated and not c.prev.pending:
                c = c.prev  # a free mapped block just before the unmapped range can grow into it
            if has_available_address_space(c):
                return c
        # A new ExpandableSegment: pages of kSmallBuffer for the small pool and kLargeBuffer for the large
        # pool; no memory mapped yet. SIMPLIFICATION: newer sources use large_segment_size() for the
        # large pool; both are 20 MiB unless large_segment_size_mb is set, and this follows the option.
        page = kSmallBuffer if pool.is_small else self.config.large_segment_size
        # unlimited (the unconstrained replay): a GPU as large as the step, so its VA covers any request
        # (a request above 1 1/8 TiB, e.g. --batch 1000000000 on a 7B model, had no room: issue 22, 26)
        va_total = self.es_va_total if self.limit is not None else max(self.es_va_total, size)
        va_size = -(-va_total // page) * page
        seg = _Segment(self._new_va(va_size), va_size, expandable=True, page=page)
        self.segments.add(seg)
        candidate = _Block(seg.base, va_size, pool, seg, mapped=False, stream=stream)
        self._insert_unmapped(candidate)
        return candidate

    def _try_allocate_expandable_block(self, pool: _Pool, size: int, stream: int = 0) -> _Block | None:
        """try_allocate_expandable_block: map just enough pages for ``size`` (the rounded request)."""
        candidate = self._find_expandable_block(pool, size, stream)
        if not candidate.mapped and not self._map_block(candidate, min(candidate.size, size)):
            return None
        while candidate.size < size:
            # invariant: free -> unmapped -> *; map_block maps some of unmapped and merges with free
            nxt = candidate.next
            if nxt is None:  # the request is larger than the segment's address space: cuMemMap cannot grow it
                return None
            if not self._map_block(nxt, min(size - candidate.size, nxt.size)):
                return None
            candidate = nxt
        self._erase(candidate)
        return candidate

    def _map_block(self, to_map: _Block, size: int) -> bool:
        """map_block + ExpandableSegment::map: map whole pages covering [addr, addr + size)."""
        seg = to_map.seg
        page = seg.page
        offset = to_map.addr - seg.base
        assert offset % page == 0, "unmapped ranges are page aligned"
        mapped = -(-(offset + size) // page) * page - offset
        if mapped == 0:
            return False
        if not self._under_limit(self.total_allocated_memory + mapped):
            return False  # cuMemCreate fails: the pages created by this call are released again
        self._erase_unmapped(to_map)
        to_map.mapped = True
        if mapped < to_map.size:
            remaining = _Block(to_map.addr + mapped, to_map.size - mapped, to_map.pool, seg, mapped=False,
                               stream=to_map.stream)
            remaining.prev, remaining.next = to_map, to_map.next
            if to_map.next is not None:
                to_map.next.prev = remaining
            to_map.next = remaining
            self._insert_unmapped(remaining)
            to_map.size = mapped
        self._try_merge(to_map, to_map.prev)
        self._try_merge(to_map, to_map.next)
        self._insert(to_map)
        seg.mapped += mapped
        self._add_reserved(mapped)
        self.num_device_alloc += 1
        return True

    def _unmap_block(self, block: _Block) -> None:
        """unmap_block + ExpandableSegment::unmap: unmap the whole pages inside a free block."""
        seg = block.seg
        page = seg.page
        offset = block.addr - seg.base
        begin = -(-offset // page) * page
        end = (offset + block.size) // page * page
        if begin >= end:
            return
        self._erase(block)
        unmap_addr, unmap_size = seg.base + begin, end - begin
        before = unmap_addr - block.addr
        if before > 0:  # prev? -> before_free -> block
            bf = _Block(block.addr, before, block.pool, seg, stream=block.stream)
            bf.prev, bf.next = block.prev, block
            if block.prev is not None:
                block.prev.next = bf
            block.prev = bf
            self._insert(bf)
        after = block.size - (before + unmap_size)
        if after > 0:  # block -> after_free -> next?
            af = _Block(unmap_addr + unmap_size, after, block.pool, seg, stream=block.stream)
            af.prev, af.next = block, block.next
            if block.next is not None:
                block.next.prev = af
            block.next = af
            self._insert(af)
        block.addr, block.size, block.mapped = unmap_addr, unmap_size, False
        self._try_merge(block, block.prev)
        self._try_merge(block, block.next)
        self._insert_unmapped(block)
        seg.mapped -= unmap_size
        self._sub_reserved(unmap_size)
        self.num_device_free += 1

    # --- inspection --------------------------------------------------------------------------------
    def same_replay_limits(self) -> tuple[int, int | None] | None:
        """The device limits [low, high) under which the replay so far takes exactly the same path.

        Every decision that depends on the limit asks ``_under_limit(total)``, so any limit that answers
        each recorded question the same way (>= every granted total, < every refused one) replays
        identically. None where the limit sizes more than that: per_process_memory_fraction (the allowed
        maximum, the garbage-collection threshold) and expandable segments once a request was refused
        (the address space of a new segment is 9/8 of the limit, which matters once pages are unmapped;
        without refusals nothing is unmapped and every request fits the address space either way).
        """
        refused = None if self.limit_refused_min == _NO_LIMIT else self.limit_refused_min
        if self.config.per_process_memory_fraction is not None or (self.expandable and refused is not None):
            return None
        return self.limit_granted_max, refused

    def segment_sizes(self) -> list[int]:
        """Reserved bytes per segment (mapped bytes for expandable ones), in address order."""
        return [s.reserved() for s in sorted(self.segments, key=lambda s: s.base)]

    def check_invariants(self, live: Iterable[_Block] = ()) -> None:
        """Debug check: every segment is tiled by its blocks and the stats add up. O(blocks)."""
        blocks = (list(self.free_blocks.values()) + list(self.unmapped_blocks.values()) + list(live)
                  + [b for _, b in self.pending])
        by_seg: dict[_Segment, list[_Block]] = {}
        for b in blocks:
            by_seg.setdefault(b.seg, []).append(b)
        assert set(by_seg) <= self.segments
        allocated = 0
        for seg in self.segments:
            chain = sorted(by_seg.get(seg, []), key=lambda b: b.addr)
            assert chain, "every segment holds blocks"
            assert chain[0].addr == seg.base and chain[0].prev is None and chain[-1].next is None
            assert len({b.stream for b in chain}) == 1, "a segment belongs to one stream"
            for a, b in zip(chain, chain[1:], strict=False):
                assert a.addr + a.size == b.addr and a.next is b and b.prev is a
                assert a.allocated or b.allocated or a.pending or b.pending or a.mapped != b.mapped, "free neighbours merge"
            assert sum(b.size for b in chain) == seg.size
            if seg.expandable:
                assert seg.mapped == sum(b.size for b in chain if b.mapped)
            allocated += sum(b.size for b in chain if b.allocated)
        assert allocated == self.allocated
        assert self.reserved == sum(self.segment_sizes()) == self.total_allocated_memory
        for pool in (self.small, self.large):
            assert pool.keys == sorted(pool.keys)


def replay(
    events: Iterable[tuple[int, int]],
    config: AllocatorConfig | None = None,
    *,
    device_limit_bytes: int | None = None,
    streams: Mapping[int, int] | None = None,
) -> ReplayResult:
    """Replay ``(storage_id, delta)`` events (memest Trace.events) through the caching allocator.

    delta > 0 allocates ``delta`` bytes for the storage (on stream ``streams[storage_id]``, 0 when absent),
    delta < 0 frees its block, ``EMPTY_CACHE`` empties the cache (torch.cuda.empty_cache()), ``RESET_PEAK`` restarts
    the peaks (torch.cuda.reset_peak_memory_stats()); ``RECORD_STREAM_ID`` / ``FREE_EVENT_ID`` / ``GPU_PASSED_ID``
    events model record_stream's deferred frees (module docstring). With
    ``device_limit_bytes`` the allocator runs its OOM recovery (free oversize / all unsplit cached
    blocks, then retry) and the replay stops at the first request that would raise OutOfMemoryError.
    """
    alloc = CachingAllocator(config, device_limit_bytes)
    live: dict[int, _Block] = {}
    oom_at = oom_bytes = None
    malloc, free = alloc.malloc, alloc.free
    streams = streams or {}
    emptied = released = 0
    recorded: set[int] = set()  # storages whose next free is pending
    event_at: dict[int, int] = {}  # CUDA event -> the replay's event index it was recorded at
    for i, (sid, delta) in enumerate(events):
        alloc.event = i
        if sid == RECORD_STREAM_ID:
            recorded.add(delta)
        elif sid == FREE_EVENT_ID:
            event_at[delta] = i
        elif sid == GPU_PASSED_ID:
            alloc.return_pending(event_at[delta])
        elif delta > 0:
            if sid in live:
                raise ValueError(f"storage {sid} allocated twice without a free (event {i})")
            try:
                live[sid] = malloc(delta, streams.get(sid, 0))
            except OutOfMemory:
                oom_at, oom_bytes = i, delta
                break
        elif delta < 0:
            block = live.pop(sid, None)
            if block is None:
                raise ValueError(f"storage {sid} freed but not allocated (event {i})")
            free(block, sid in recorded)
            recorded.discard(sid)
        elif sid == EMPTY_CACHE_ID:
            emptied += 1
            released += alloc.empty_cache()
        elif sid == RESET_PEAK_ID:
            alloc.reset_peaks()
    if oom_at is None:
        alloc.return_pending()  # the trace's end: the GPU catches up (no peak moves)
    sizes = alloc.segment_sizes()
    return ReplayResult(
        same_replay_limits=alloc.same_replay_limits(),
        peak_allocated=alloc.peak_allocated,
        peak_reserved=alloc.peak_reserved,
        final_reserved=alloc.reserved,
        num_segments=len(sizes),
        peak_requested=alloc.peak_requested,
        final_allocated=alloc.allocated,
        peak_allocated_event=alloc.peak_allocated_event,
        peak_reserved_event=alloc.peak_reserved_event,
        num_device_allocs=alloc.num_device_alloc,
        num_device_frees=alloc.num_device_free,
        num_alloc_retries=alloc.num_alloc_retries,
        empty_cache_calls=emptied,
        empty_cache_released=released,
        peak_reserved_pending=alloc.peak_reserved_pending,
        oom=oom_at is not None,
        oom_event_index=oom_at,
        oom_request_bytes=oom_bytes,
        segment_sizes=tuple(sizes),
    )


# --- the smallest device limit ------------------------------------------------------------------------
def min_device_limit(
    events: Sequence[tuple[int, int]],
    config: AllocatorConfig | None = None,
    *,
    unconstrained: ReplayResult | None = None,
    every_larger: bool = False,
    streams: Mapping[int, int] | None = None,
) -> int:
    """The smallest ``device_limit_bytes`` under which ``replay(events, config, ...)`` completes.

    ``unconstrained``: the replay without a limit, when the caller has it. The search runs between two
    bounds that need no search: below the peak of the requested bytes every replay raises OOM (the
    allocator never holds more than the limit, and every block is at least its request; the peak
    *allocated* of the unconstrained replay is no bound: a block reused from the cache without splitting
    counts whole, and under a limit the allocator may cut a fresh, smaller one), and at or above the
    unconstrained peak reserved the limit never binds, so the replay completes (with
    per_process_memory_fraction: at or above the peak reserved / fraction, checked by a replay).

    OOM is not monotonic in the limit in this model (nor, presumably, in CUDACachingAllocator.cpp, whose
    rules it follows). Under a smaller limit the allocator frees its cache earlier, and the segments it
    then creates can suit the rest of the step better than the cached ones a larger limit kept: 26 MiB
    allocated and freed, then 28, 20 and 1 MiB run in 50 MiB (the 28 MiB cudaMalloc fails, the cached
    26 MiB segment is freed) but not in 54 or 55 MiB (the cached segment is kept and split for the 20 MiB,
    its 6 MiB remainder stranded; tests/test_min_budget.py). About 1 in 120 random synthetic traces has
    such a window; the real traces checked (gpt2 batch 1-8 seq 512, gpt2-xl, llama-2-7b, bf16-mixed)
    have none. So the default bisection returns *a* boundary: the replay completes at the limit returned
    and raises OOM one byte below it, and every limit from the unconstrained peak reserved up completes;
    the limits between are not each checked. ``every_larger=True`` walks down from the unconstrained
    replay through every distinct replay path instead and returns the smallest limit such that it and
    every larger limit complete (exact, but one replay per path: 120 replays on gpt2-xl batch 2 seq 1024
    where the bisection takes 8 and finds the same limit).

    Each probe certifies the whole range of limits that replay the same way (``same_replay_limits``),
    which makes the bisection exact to the byte in a few replays (gpt2-xl: 8 of 25 ms each). With
    per_process_memory_fraction or expandable segments, where a replay can certify only its own limit,
    it bisects over whole MiB, as the totals asked of the driver are whole MiB (segments and pages): the
    limit returned completes and 1 MiB less raises OOM (``every_larger`` raises ValueError where it
    would take a replay per MiB).
    """
    config = config or AllocatorConfig()
    events = events if isinstance(events, list) else list(events)
    first = unconstrained or replay(events, config, streams=streams)
    oom_at = first.peak_requested - 1  # a limit known to raise OOM
    ok_at = _completing_limit(events, config, first, streams)
    # where replays can certify only their own limit, search whole MiB
    step = MIB if config.per_process_memory_fraction is not None or config.expandable_segments else 1
    if every_larger:
        while ok_at - 1 > oom_at:
            probe = replay(events, config, device_limit_bytes=ok_at - 1, streams=streams)
            if probe.oom:
                break
            if probe.same_replay_limits is None:
                raise ValueError("every_larger: these replays certify only their own limit (see same_replay_limits)")
            ok_at = probe.same_replay_limits[0]
        return ok_at
    while ok_at - oom_at > step:
        mid = (ok_at + oom_at) // 2
        if step == MIB:  # whole MiB: the totals the driver is asked for are whole MiB (segments, pages)
            mid = mid // MIB * MIB if mid // MIB * MIB > oom_at else mid // MIB * MIB + MIB
        probe = replay(events, config, device_limit_bytes=mid, streams=streams)
        same = probe.same_replay_limits
        if same is None or (probe.oom and same[1] is None):
            same = (mid, mid + 1)
        if probe.oom:
            oom_at = same[1] - 1
        else:
            ok_at = same[0]
    return ok_at


def _completing_limit(events: list, config: AllocatorConfig, unconstrained: ReplayResult,
                      streams: Mapping[int, int] | None = None) -> int:
    """A limit under which the replay completes (the lowest that replays the unconstrained path)."""
    fraction = config.per_process_memory_fraction
    if fraction is None:
        return unconstrained.same_replay_limits[0]
    # the allocator may hold fraction * limit: start where that covers the unconstrained peak reserved
    if fraction <= 0.0:
        raise ValueError("PYTORCH_CUDA_ALLOC_CONF per_process_memory_fraction:0 lets the allocator hold nothing")
    limit = -(-int(unconstrained.peak_reserved / fraction) // MIB) * MIB + MIB
    for _ in range(64):  # garbage_collection_threshold can make a limit that covers the peak not enough
        if not replay(events, config, device_limit_bytes=limit, streams=streams).oom:
            return limit
        limit *= 2
    raise ValueError("no device limit found under which the replay completes")


# --- the floor: what any run of these events must hold ------------------------------------------------
def allocator_floor(events: Iterable[tuple[int, int]], config: AllocatorConfig | None = None) -> int:
    """A lower bound on the bytes the caching allocator holds at some point of ``events``, whatever the
    device limit and whatever it caches: the step cannot run in a smaller allocator budget.

    At every moment each live block is at least ``round_size`` of its request (512 B, or the
    roundup_power2_divisions size), blocks of at most kSmallSize (1 MiB) sit in the small pool's
    segments and larger ones in the large pool's, and each pool holds whole granules: small segments
    are kSmallBuffer (2 MiB) each; large cudaMalloc'd segments are multiples of kRoundLarge (2 MiB,
    get_allocation_size); an expandable segment maps pages of kSmallBuffer (small pool) or kLargeBuffer
    (20 MiB, large pool): ``auto segment_size = pool->is_small ? kSmallBuffer : kLargeBuffer`` in
    DeviceCachingAllocator::find_expandable_block, and Note [Expandable Segments]: "we use 2MiB pages
    for our small pool and 20MiB pages for our large pool" (c10/cuda/CUDACachingAllocator.cpp, pytorch main and
    the releases since expandable segments came in, 2.1). So the floor is
    the largest, over the events, of each pool's live rounded bytes rounded up to its granule, summed.

    What it leaves out is fragmentation (free holes a request does not fit), which depends on the event
    order and the allocator's choices; ``min_device_limit`` replays those choices. A real allocator
    near the floor: expandable segments unmap free pages on an OOM retry (release_cached_blocks), so
    their holes shrink to sub-page fringes; without them a hole inside a split segment stays reserved.
    """
    config = config or AllocatorConfig()
    rounds = any(config.roundup_power2_divisions)
    # the replay's pages follow large_segment_size (find_expandable_block above); the C++ uses kLargeBuffer:
    # the smaller of the two bounds both
    large_granule = min(kLargeBuffer, config.large_segment_size) if config.expandable_segments else kRoundLarge
    live: dict[int, int] = {}
    small = large = floor = 0
    for sid, delta in events:
        if delta > 0:
            size = round_size(delta, config if rounds else None)
            live[sid] = size
            if size <= kSmallSize:
                small += size
            else:
                large += size
            held = -(-small // kSmallBuffer) * kSmallBuffer + -(-large // large_granule) * large_granule
            floor = max(floor, held)
        elif delta < 0 and sid in live:
            size = live.pop(sid)
            if size <= kSmallSize:
                small -= size
            else:
                large -= size
    return floor

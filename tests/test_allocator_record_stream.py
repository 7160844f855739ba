"""The replay's record_stream rule (device/allocator.py docstring): a recorded storage's free leaves its block
pending (reserved, not allocated, not reusable) until a sync on a CUDA event recorded after the free, an OOM retry /
empty_cache, or the end."""

from memest.device.allocator import EMPTY_CACHE, FREE_EVENT_ID, GPU_PASSED_ID, MIB, RECORD_STREAM_ID, replay

BIG = 32 * MIB  # a large-pool request: its own 32 MiB segment (over kLargeBuffer, a multiple of kRoundLarge)


def test_pending_block_is_not_reused_until_a_sync():
    immediate = replay([(1, BIG), (1, -BIG), (2, BIG)])
    pending = replay([(1, BIG), (RECORD_STREAM_ID, 1), (1, -BIG), (2, BIG)])
    assert immediate.peak_reserved == BIG  # storage 2 reuses 1's segment
    assert pending.peak_reserved == 2 * BIG  # 1's block is still pending: a second segment
    assert pending.peak_allocated == immediate.peak_allocated == BIG  # allocated drops at free time


def test_pending_block_is_reused_after_a_sync_on_a_later_event():
    events = [(1, BIG), (RECORD_STREAM_ID, 1), (1, -BIG), (FREE_EVENT_ID, 0), (7, BIG), (GPU_PASSED_ID, 0), (2, BIG)]
    result = replay(events)
    assert result.num_device_allocs == 2 and result.peak_reserved == 2 * BIG  # 7 could not reuse it; 2 does
    early = [(1, BIG), (RECORD_STREAM_ID, 1), (FREE_EVENT_ID, 0), (1, -BIG), (GPU_PASSED_ID, 0), (2, BIG)]
    assert replay(early).num_device_allocs == 2  # an event recorded before the free returns nothing


def test_only_the_next_free_is_pending():
    events = [(1, BIG), (RECORD_STREAM_ID, 1), (1, -BIG), EMPTY_CACHE, (1, BIG), (1, -BIG), (2, BIG)]
    assert replay(events).num_device_allocs == 2  # the second free of 1 is immediate: 2 reuses it


def test_empty_cache_returns_pending_blocks_then_releases_them():
    result = replay([(1, BIG), (RECORD_STREAM_ID, 1), (1, -BIG), EMPTY_CACHE, (2, BIG)])
    assert result.empty_cache_released == BIG  # synchronize_and_free_events, then release_cached_blocks
    assert result.final_reserved == BIG


def test_oom_retry_synchronizes_the_pending_blocks():
    events = [(1, BIG), (RECORD_STREAM_ID, 1), (1, -BIG), (2, BIG)]
    assert replay(events).peak_reserved == 2 * BIG
    result = replay(events, device_limit_bytes=2 * BIG - MIB)
    assert not result.oom and result.num_alloc_retries == 1 and result.peak_reserved == BIG


def test_a_pending_neighbour_does_not_merge():
    # two small blocks of one 2 MiB segment; the first pending, the second freed: they stay apart until the sync
    events = [(1, 4096), (2, 4096), (RECORD_STREAM_ID, 1), (1, -4096), (2, -4096), (FREE_EVENT_ID, 0),
              (GPU_PASSED_ID, 0), (3, 8192)]
    assert replay(events).num_device_allocs == 1  # after the sync both merge: 3 fits in the one segment

"""One pool per stream: the caching-allocator replay's stream rules, worked by hand from CUDACachingAllocator.cpp,
and the trace's stream tags where FSDP2 selects its communication streams.

"Allocations are associated with a stream. Once freed, blocks can be re-allocated on the same stream, but not on
any other stream" (the header comment of c10/cuda/CUDACachingAllocator.cpp). Each test names the rule it checks.
"""

import pytest

from memest.device.allocator import AllocatorConfig, CachingAllocator, OutOfMemory, parse_alloc_conf, replay

MiB = 1024 * 1024


def test_a_freed_block_is_reused_only_on_its_stream():
    # get_free_block: lower_bound on (stream, size, ptr), then "(*it)->stream != p.stream()" fails the search.
    # A 4 MiB request takes a 20 MiB segment (get_allocation_size: kLargeBuffer for 1-10 MiB).
    other = replay([(1, 4 * MiB), (1, -4 * MiB), (2, 4 * MiB)], streams={1: 1})
    same = replay([(1, 4 * MiB), (1, -4 * MiB), (2, 4 * MiB)])
    assert same.peak_reserved == 20 * MiB and same.num_device_allocs == 1
    assert other.peak_reserved == 40 * MiB and other.num_device_allocs == 2
    # back on its own stream, the cached block is found again: no third segment
    again = replay([(1, 4 * MiB), (1, -4 * MiB), (2, 4 * MiB), (3, 4 * MiB)], streams={1: 1, 3: 1})
    assert again.peak_reserved == 40 * MiB and again.num_device_allocs == 2


def test_a_split_remainder_stays_with_its_stream():
    # alloc_found_block: the remainder of a split block keeps the block's stream (Block(device, stream, ...)),
    # so a small-pool segment opened by one stream does not serve another's small request.
    r = replay([(1, 600 * 1024), (2, 100 * 1024)], streams={2: 1})
    assert r.peak_reserved == 4 * MiB and r.num_segments == 2
    assert replay([(1, 600 * 1024), (2, 100 * 1024)]).peak_reserved == 2 * MiB


def test_the_oom_retry_frees_every_streams_cache():
    # malloc: cudaMalloc fails -> release_available_cached_blocks (nothing: max_split_size unset) ->
    # release_cached_blocks, which frees the unsplit cached segments of every stream -> retry succeeds.
    alloc = CachingAllocator(device_limit_bytes=30 * MiB)
    alloc.free(alloc.malloc(4 * MiB, stream=1))
    block = alloc.malloc(4 * MiB, stream=0)
    assert alloc.num_alloc_retries == 1 and alloc.reserved == 20 * MiB and block.stream == 0
    alloc.check_invariants([block])


def test_release_available_cached_blocks_looks_only_at_the_requests_stream():
    # release_available_cached_blocks: Block key(device, p.stream(), size); a block of another stream stops the
    # walk ("(*it)->stream == p.stream()"), so only release_cached_blocks (the counted retry) frees it.
    conf = parse_alloc_conf("max_split_size_mb:20")
    alloc = CachingAllocator(conf, device_limit_bytes=40 * MiB)
    alloc.free(alloc.malloc(30 * MiB, stream=1))
    alloc.malloc(30 * MiB, stream=0)
    assert alloc.num_alloc_retries == 1 and alloc.reserved == 30 * MiB
    # the same request on the block's own stream takes the cached block: no cudaMalloc, no retry
    alloc = CachingAllocator(conf, device_limit_bytes=40 * MiB)
    alloc.free(alloc.malloc(30 * MiB, stream=1))
    alloc.malloc(30 * MiB, stream=1)
    assert alloc.num_alloc_retries == 0 and alloc.num_device_alloc == 1


def test_one_expandable_segment_per_stream():
    # find_expandable_block: only segments whose stream is the request's ("(*it)->stream == stream"); else a
    # new ExpandableSegment(device, stream, ...). Two 4 MiB blocks share one 20 MiB page on one stream.
    conf = AllocatorConfig(expandable_segments=True)
    two = replay([(1, 4 * MiB), (2, 4 * MiB)], conf, streams={2: 1})
    one = replay([(1, 4 * MiB), (2, 4 * MiB)], conf)
    assert one.peak_reserved == 20 * MiB and one.num_segments == 1
    assert two.peak_reserved == 40 * MiB and two.num_segments == 2


def test_stream_blocks_under_a_limit_that_one_pool_fits():
    # The smallest budget differs too: one pool runs these in one 20 MiB segment, two streams need two.
    events = [(1, 4 * MiB), (1, -4 * MiB), (2, 4 * MiB)]
    with pytest.raises(OutOfMemory):
        alloc = CachingAllocator(device_limit_bytes=20 * MiB)
        alloc.malloc(4 * MiB, stream=1)
        alloc.malloc(4 * MiB, stream=0)  # the stream-1 block is live: nothing to free, no room
    assert not replay(events, device_limit_bytes=20 * MiB).oom
    # freed first, the stream-1 segment is released by the OOM retry: it runs in 20 MiB with streams too
    assert not replay(events, device_limit_bytes=20 * MiB, streams={1: 1}).oom


def test_fsdp2_trace_tags_its_communication_streams():
    """FSDP2 selects FSDPCommContext's streams with torch.cpu.stream on the trace's cpu mesh where it selects CUDA
    streams on a GPU: the all-gather output on the copy-in stream, the reduce-scatter output on the reduce-scatter
    stream (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py); everything else on the default stream."""
    import memest

    est = memest.estimate("hf:tests/configs/llama-tiny.json", batch=2, seq=64, world_size=2, shard="zero3")
    storages = est.trace.storages
    side = [r for r in storages if r.stream]
    by_stream = {}
    for r in side:
        by_stream.setdefault(r.stream, set()).add(r.op)
    assert set(by_stream) == {1, 2}
    assert all(op.endswith("(FSDP all-gather)") for op in by_stream[1])
    assert all(op.endswith("(FSDP reduce-scatter)") for op in by_stream[2])
    # the reduce-scatter input is allocated before FSDP2 enters the reduce-scatter stream
    assert any(r.op.endswith("(FSDP reduce-scatter)") and r.stream == 0 for r in storages)
    # parameters' all-gather copy-out (the unsharded parameters) is the default stream's
    assert not any(r.stream for r in storages if r.category.value == "activations")
    basis = est.to_dict()["device"]["range_basis"]
    assert any("side stream(s)" in line for line in basis)


def test_ddp_and_single_process_traces_use_the_default_stream_only():
    import memest

    for kwargs in ({}, {"world_size": 2}):
        est = memest.estimate("hf:tests/configs/llama-tiny.json", batch=2, seq=64, **kwargs)
        assert not est.trace.streams()
        assert not any("side stream(s)" in line for line in est.to_dict()["device"]["range_basis"])

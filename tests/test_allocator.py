"""The caching-allocator replay model against sequences worked by hand from CUDACachingAllocator.cpp.

Each test names the rule (C++ function / constant) it checks. Sizes: KiB = 1024, MiB = 1024**2.
"""

import random

import pytest

from memest.device.allocator import (
    AllocatorConfig,
    CachingAllocator,
    OutOfMemory,
    alloc_conf_from_env,
    get_allocation_size,
    parse_alloc_conf,
    replay,
    round_size,
)

KiB = 1024
MiB = 1024 * 1024
EXPANDABLE = AllocatorConfig(expandable_segments=True)


def allocs(*sizes):
    """Events allocating each size in turn under ids 0, 1, 2, ..."""
    return [(i, s) for i, s in enumerate(sizes)]


# --- round_size / get_allocation_size -----------------------------------------------------------------
def test_requests_round_up_to_512_bytes():
    # round_size: size < kMinBlockSize -> kMinBlockSize, else a multiple of kMinBlockSize (512 B)
    assert [round_size(n) for n in (1, 511, 512, 513, 1000, 1024)] == [512, 512, 512, 1024, 1024, 1024]
    r = replay(allocs(1, 513))
    assert r.peak_allocated == 512 + 1024  # allocated bytes are rounded block sizes
    assert r.peak_requested == 514  # requested_bytes keeps the unrounded sizes
    assert r.peak_reserved == 2 * MiB


def test_get_allocation_size():
    # get_allocation_size: <= kSmallSize -> kSmallBuffer; < kMinLargeAlloc -> kLargeBuffer;
    # else round up to kRoundLarge
    assert get_allocation_size(1 * KiB) == 2 * MiB
    assert get_allocation_size(1 * MiB) == 2 * MiB
    assert get_allocation_size(1 * MiB + 512) == 20 * MiB
    assert get_allocation_size(10 * MiB - 512) == 20 * MiB
    assert get_allocation_size(10 * MiB) == 10 * MiB
    assert get_allocation_size(13 * MiB) == 14 * MiB


def test_roundup_power2_divisions():
    # roundup_power2_next_division: 1.2 MiB with 4 divisions of [1, 2) MiB -> 1.25 MiB
    config = parse_alloc_conf("roundup_power2_divisions:4")
    assert round_size(1258291, config) == 1310720
    assert round_size(1258291) == 1258496  # without the option: next multiple of 512
    # round_size only uses divisions when size > kMinBlockSize * divisions (here 2048)
    assert round_size(1200, config) == 1536
    assert round_size(3000, config) == 3072
    assert round_size(4096, config) == 4096  # powers of two stay
    assert replay(allocs(1258291), config).peak_allocated == 1310720


# --- pools and segments -------------------------------------------------------------------------------
def test_small_request_reserves_a_2mib_small_segment():
    # get_pool: size <= kSmallSize -> small pool; alloc_block cudaMallocs kSmallBuffer (2 MiB)
    r = replay(allocs(1 * KiB))
    assert (r.peak_allocated, r.peak_reserved, r.num_segments) == (1 * KiB, 2 * MiB, 1)


def test_small_requests_share_a_small_segment():
    # should_split (small pool): split while remaining >= kMinBlockSize; 3 x 600 KiB fit in 2 MiB
    three = replay(allocs(600 * KiB, 600 * KiB, 600 * KiB))
    assert (three.peak_reserved, three.num_segments) == (2 * MiB, 1)
    # the fourth finds only a 248 KiB free block -> a second kSmallBuffer segment
    four = replay(allocs(*[600 * KiB] * 4))
    assert (four.peak_reserved, four.num_segments) == (4 * MiB, 2)


def test_mid_size_request_reserves_20mib_and_later_ones_split_it():
    # get_allocation_size: 1 MiB < size < kMinLargeAlloc -> kLargeBuffer (20 MiB);
    # should_split (large pool): remaining > kSmallSize, so four 5 MiB requests share the segment
    assert replay(allocs(5 * MiB)).peak_reserved == 20 * MiB
    four = replay(allocs(*[5 * MiB] * 4))
    assert (four.peak_reserved, four.peak_allocated, four.num_segments) == (20 * MiB, 20 * MiB, 1)
    five = replay(allocs(*[5 * MiB] * 5))
    assert (five.peak_reserved, five.num_segments) == (40 * MiB, 2)


def test_large_request_reserves_its_size_rounded_to_2mib():
    # get_allocation_size: >= kMinLargeAlloc -> round up to kRoundLarge (2 MiB)
    r = replay(allocs(12 * MiB))
    assert (r.peak_reserved, r.peak_allocated) == (12 * MiB, 12 * MiB)
    # 13 MiB -> a 14 MiB segment; the 1 MiB remainder is not > kSmallSize, so should_split says no
    # and the whole 14 MiB block counts as allocated
    r = replay(allocs(13 * MiB))
    assert (r.peak_reserved, r.peak_allocated, r.peak_requested) == (14 * MiB, 14 * MiB, 13 * MiB)


def test_unsplit_remainder_counts_as_allocated():
    # 19 MiB -> 20 MiB segment; remaining 1 MiB is not > kSmallSize -> block not split
    r = replay(allocs(19 * MiB))
    assert r.peak_allocated == 20 * MiB


# --- caching ------------------------------------------------------------------------------------------
def test_freed_blocks_are_cached_and_reused():
    # free_block keeps the block in the pool; get_free_block hands it out again: no new cudaMalloc
    r = replay([(0, 12 * MiB), (0, -12 * MiB), (1, 12 * MiB), (1, -12 * MiB), (2, 8 * MiB)])
    assert (r.peak_reserved, r.final_reserved, r.num_device_allocs) == (12 * MiB, 12 * MiB, 1)
    # the 8 MiB request splits the cached 12 MiB block (remaining 4 MiB > kSmallSize)
    assert r.final_allocated == 8 * MiB


def test_best_fit_picks_the_smallest_cached_block_that_fits():
    # get_free_block: lower_bound on (size, address) -> smallest block >= request
    events = [(0, 12 * MiB), (1, 16 * MiB), (0, -12 * MiB), (1, -16 * MiB),
              (2, 11 * MiB),  # takes the 12 MiB block (unsplit: 1 MiB remainder), not the 16 MiB one
              (3, 14 * MiB)]  # so the 16 MiB block is still there for this one (split: 2 MiB left)
    r = replay(events)
    assert (r.peak_reserved, r.num_segments) == (28 * MiB, 2)
    assert r.final_allocated == 12 * MiB + 14 * MiB


def test_adjacent_free_blocks_merge():
    # free_block -> try_merge_blocks with prev and next: B and C (adjacent) merge into 10 MiB, which then
    # holds a 9 MiB request (kept whole: the 1 MiB remainder is not split off)
    ids = allocs(*[5 * MiB] * 4)  # A, B, C, D tile one 20 MiB segment
    r = replay(ids + [(1, -5 * MiB), (2, -5 * MiB), (4, 9 * MiB)])
    assert (r.peak_reserved, r.num_segments) == (20 * MiB, 1)
    assert r.final_allocated == 20 * MiB
    # A and C are not neighbours: two separate 5 MiB free blocks, so 9 MiB needs a new segment
    r = replay(ids + [(0, -5 * MiB), (2, -5 * MiB), (4, 9 * MiB)])
    assert (r.peak_reserved, r.num_segments) == (40 * MiB, 2)


def test_blocks_never_merge_across_segments():
    # try_merge_blocks only follows prev/next links, which stay within one cudaMalloc'd segment
    r = replay([(0, 12 * MiB), (1, 12 * MiB), (0, -12 * MiB), (1, -12 * MiB), (2, 24 * MiB)])
    assert r.peak_reserved == 48 * MiB


# --- max_split_size -----------------------------------------------------------------------------------
def test_max_split_size_keeps_oversize_blocks_for_large_requests():
    config = parse_alloc_conf("max_split_size_mb:20")
    # get_free_block: "Do not return an oversized block for a large request": the cached 20 MiB
    # segment (>= max_split_size) is not used for a 5 MiB request (< max_split_size)
    events = [(0, 5 * MiB), (0, -5 * MiB), (1, 5 * MiB)]
    assert replay(events).peak_reserved == 20 * MiB
    assert replay(events, config).peak_reserved == 40 * MiB


def test_max_split_size_rounding_limit_and_no_split():
    config = parse_alloc_conf("max_split_size_mb:20")
    events = [(0, 30 * MiB), (0, -30 * MiB),
              (1, 12 * MiB),  # < max_split_size: may not take the 30 MiB oversize block -> new 12 MiB
              (2, 24 * MiB)]  # >= max_split_size: takes the 30 MiB block, since 30 < 24 + 20
    r = replay(events, config)
    assert r.peak_reserved == 42 * MiB
    # should_split: size >= max_split_size -> never split, the whole 30 MiB block is allocated
    assert r.final_allocated == 12 * MiB + 30 * MiB
    # max_non_split_rounding_mb (default large_segment_size, 20 MiB): blocks >= size + that limit are
    # not handed out to a request >= max_split_size
    events = [(0, 50 * MiB), (0, -50 * MiB), (1, 24 * MiB)]
    assert replay(events, config).peak_reserved == 74 * MiB  # 50 >= 24 + 20
    loose = parse_alloc_conf("max_split_size_mb:20,max_non_split_rounding_mb:40")
    r = replay(events, loose)
    assert (r.peak_reserved, r.final_allocated) == (50 * MiB, 50 * MiB)  # 50 < 24 + 40


# --- out of memory ------------------------------------------------------------------------------------
def test_oom_releases_unsplit_cached_blocks_and_retries():
    # malloc: alloc_block fails -> release_cached_blocks (cudaFree every unsplit cached block) -> retry
    r = replay([(0, 30 * MiB), (0, -30 * MiB), (1, 36 * MiB)], device_limit_bytes=40 * MiB)
    assert not r.oom
    assert (r.peak_reserved, r.final_reserved, r.num_alloc_retries) == (36 * MiB, 36 * MiB, 1)
    # without a limit the 30 MiB block simply stays cached
    assert replay([(0, 30 * MiB), (0, -30 * MiB), (1, 36 * MiB)]).peak_reserved == 66 * MiB


def test_split_cached_blocks_are_not_released():
    # release_blocks frees only blocks with no prev/next: the 15 MiB free tail of the 20 MiB
    # segment stays, the unsplit cached 12 MiB segment goes
    events = [(0, 5 * MiB), (1, 12 * MiB), (1, -12 * MiB), (2, 16 * MiB)]
    r = replay(events, device_limit_bytes=40 * MiB)
    assert not r.oom
    assert r.final_reserved == 20 * MiB + 16 * MiB
    assert r.segment_sizes == (20 * MiB, 16 * MiB)


def test_release_available_cached_blocks_with_max_split_size():
    # release_available_cached_blocks: with max_split_size set, free just one oversize block big enough
    config = parse_alloc_conf("max_split_size_mb:20")
    events = [(0, 60 * MiB), (0, -60 * MiB), (1, 30 * MiB)]  # 60 >= 30 + 20: not reusable
    r = replay(events, config, device_limit_bytes=64 * MiB)
    assert not r.oom
    assert (r.peak_reserved, r.final_reserved, r.num_alloc_retries) == (60 * MiB, 30 * MiB, 0)


def test_true_oom_stops_the_replay():
    r = replay([(0, 30 * MiB), (1, 20 * MiB), (2, 1 * KiB)], device_limit_bytes=40 * MiB)
    assert r.oom and r.oom_event_index == 1 and r.oom_request_bytes == 20 * MiB
    assert r.peak_reserved == 30 * MiB


def test_per_process_memory_fraction_caps_reserved():
    # alloc_block: set_fraction && total_allocated_memory + alloc_size > allowed_memory_maximum -> fail
    config = parse_alloc_conf("per_process_memory_fraction:0.5")
    assert replay(allocs(30 * MiB, 30 * MiB), config, device_limit_bytes=100 * MiB).oom
    assert not replay(allocs(30 * MiB, 30 * MiB), device_limit_bytes=100 * MiB).oom


def test_garbage_collection_frees_old_cached_blocks():
    # garbage_collect_cached_blocks runs before alloc_block once usage passes threshold * allowed
    # (allowed = 0.9 * 200 MiB = 180 MiB, so collection starts above 0.3 * 180 = 54 MiB)
    config = parse_alloc_conf("per_process_memory_fraction:0.9,garbage_collection_threshold:0.3")
    events = [(0, 70 * MiB), (0, -70 * MiB), (1, 80 * MiB)]
    r = replay(events, config, device_limit_bytes=200 * MiB)
    assert r.final_reserved == 80 * MiB and r.num_device_frees == 1  # the cached 70 MiB was collected
    no_gc = parse_alloc_conf("per_process_memory_fraction:0.9")
    assert replay(events, no_gc, device_limit_bytes=200 * MiB).final_reserved == 150 * MiB


# --- expandable segments ------------------------------------------------------------------------------
def test_expandable_segments_map_pages():
    # find_expandable_block: small pool pages are kSmallBuffer (2 MiB), large pool pages kLargeBuffer
    assert replay(allocs(1 * KiB), EXPANDABLE).peak_reserved == 2 * MiB
    assert replay(allocs(5 * MiB), EXPANDABLE).peak_reserved == 20 * MiB
    # map_block maps whole 20 MiB pages, so one 12 MiB request reserves more than cudaMalloc would
    assert replay(allocs(12 * MiB), EXPANDABLE).peak_reserved == 20 * MiB
    # should_split with expandable segments: any remainder >= kMinBlockSize is split off
    assert replay(allocs(13 * MiB), EXPANDABLE).peak_allocated == 13 * MiB


def test_expandable_segments_grow_in_place_for_growing_requests():
    # Growing requests: cudaMalloc needs a new segment for each (30 + 32 + 34 + 36 MiB); an expandable
    # segment keeps one contiguous free block that every later request fits
    events = [(0, 30 * MiB), (0, -30 * MiB), (1, 32 * MiB), (1, -32 * MiB),
              (2, 34 * MiB), (2, -34 * MiB), (3, 36 * MiB)]
    assert replay(events).peak_reserved == 132 * MiB
    r = replay(events, EXPANDABLE)
    assert (r.peak_reserved, r.num_segments) == (40 * MiB, 1)


def test_expandable_segment_blocks_merge_across_mappings():
    # try_allocate_expandable_block: the free 8 MiB tail grows by one more page and the blocks stay in
    # one address range, so after both frees a 24 MiB request fits
    events = [(0, 12 * MiB), (1, 12 * MiB), (0, -12 * MiB), (1, -12 * MiB), (2, 24 * MiB)]
    assert replay(events).peak_reserved == 48 * MiB
    r = replay(events, EXPANDABLE)
    assert r.peak_reserved == 40 * MiB and r.num_device_allocs == 2


def test_expandable_best_fit_prefers_blocks_not_at_the_tail():
    # get_free_block with expandable segments: a free block followed by unmapped space counts as huge,
    # so a 6 MiB request takes the 16 MiB hole rather than the 8 MiB tail
    alloc = CachingAllocator(EXPANDABLE)
    a = alloc.malloc(16 * MiB)
    b = alloc.malloc(16 * MiB)  # [a 16][b 16][8 free tail] over 40 MiB mapped
    hole = a.addr
    alloc.free(a)
    c = alloc.malloc(6 * MiB)
    assert c.addr == hole and alloc.reserved == 40 * MiB
    alloc.check_invariants([b, c])


def test_expandable_oom_unmaps_free_pages():
    # release_cached_blocks -> release_blocks -> unmap_block: the whole pages inside a free block are
    # unmapped. [A 30][B 10] on two 20 MiB pages; A freed; 50 MiB needs 3 more pages (100 > 80 MiB), so
    # the page under A's first 20 MiB is unmapped (its last 10 MiB shares a page with B) and the retry
    # maps 3 pages at the tail: 20 + 60 = 80 MiB
    events = [(0, 30 * MiB), (1, 10 * MiB), (0, -30 * MiB), (2, 50 * MiB)]
    r = replay(events, EXPANDABLE, device_limit_bytes=80 * MiB)
    assert not r.oom and (r.num_device_frees, r.num_alloc_retries) == (1, 1)
    assert r.final_reserved == r.peak_reserved == 80 * MiB
    assert replay(events, EXPANDABLE).final_reserved == 100 * MiB


# --- parse_alloc_conf ---------------------------------------------------------------------------------
def test_parse_alloc_conf():
    c = parse_alloc_conf("expandable_segments:True,max_split_size_mb:128")
    assert c.expandable_segments and c.max_split_size == 128 * MiB
    assert parse_alloc_conf(None) == AllocatorConfig() == parse_alloc_conf("")
    assert parse_alloc_conf(" expandable_segments : False ").expandable_segments is False
    c = parse_alloc_conf(
        "garbage_collection_threshold:0.6,backend:native,foo:bar,pinned_num_register_threads:8")
    assert c.garbage_collection_threshold == 0.6
    assert c.unknown_keys == ("foo",) and c.ignored_keys == ("pinned_num_register_threads",)
    c = parse_alloc_conf("large_segment_size_mb:40")
    assert c.large_segment_size == 40 * MiB and c.non_split_rounding == 40 * MiB
    assert parse_alloc_conf("backend:cudaMallocAsync").backend == "cudaMallocAsync"


def test_parse_roundup_list():
    # parseRoundUpPower2Divisions: list keys are MiB, interval index = log2(key); the first value also
    # fills the intervals below it, '>' fills the ones after the last key
    c = parse_alloc_conf("roundup_power2_divisions:[256:1,512:2,1024:4,>:8]")
    assert c.roundup_power2_divisions == (1,) * 9 + (2, 4) + (8,) * 5
    assert parse_alloc_conf("roundup_power2_divisions:[64:8]").roundup_power2_divisions == (8,) * 7 + (0,) * 9


@pytest.mark.parametrize("text", [
    "max_split_size_mb:10",  # parseMaxSplitSize: must be >= large_segment_size (20 MiB)
    "expandable_segments:true",  # ConfigTokenizer::toBool accepts only True/False
    "garbage_collection_threshold:1.5",
    "roundup_power2_divisions:3",
    "large_segment_size_mb:10",
    "max_split_size_mb",
])
def test_parse_alloc_conf_rejects_what_torch_rejects(text):
    with pytest.raises(ValueError):
        parse_alloc_conf(text)


def test_alloc_conf_from_env_order():
    env = {"PYTORCH_ALLOC_CONF": "max_split_size_mb:64",
           "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    c = alloc_conf_from_env(env)
    assert c.expandable_segments and c.max_split_size is None
    assert alloc_conf_from_env({}) == AllocatorConfig()


def test_cuda_malloc_async_backend_is_refused():
    with pytest.raises(ValueError):
        replay(allocs(1), parse_alloc_conf("backend:cudaMallocAsync"))


def test_bad_event_sequences():
    with pytest.raises(ValueError):
        replay([(0, 10), (0, 10)])
    with pytest.raises(ValueError):
        replay([(0, -10)])


# --- properties ---------------------------------------------------------------------------------------
def _random_events(rng, n):
    live, events, next_id = [], [], 0
    for _ in range(n):
        if live and rng.random() < 0.45:
            sid, size = live.pop(rng.randrange(len(live)))
            events.append((sid, -size))
            continue
        kind = rng.random()
        if kind < 0.5:
            size = rng.randint(1, 1 * MiB)
        elif kind < 0.8:
            size = rng.randint(1 * MiB + 1, 10 * MiB)
        else:
            size = rng.randint(10 * MiB, 80 * MiB)
        live.append((next_id, size))
        events.append((next_id, size))
        next_id += 1
    return events


CONFIGS = [
    AllocatorConfig(),
    EXPANDABLE,
    parse_alloc_conf("max_split_size_mb:20"),
    parse_alloc_conf("max_split_size_mb:64,expandable_segments:True"),
    parse_alloc_conf("roundup_power2_divisions:[1:2,16:4,>:8]"),
]


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("limit", [None, 400 * MiB])
def test_random_sequences_keep_invariants(config, limit):
    rng = random.Random(1234)
    for _ in range(4):
        events = _random_events(rng, 300)
        alloc = CachingAllocator(config, limit)
        live, requested = {}, 0
        for i, (sid, delta) in enumerate(events):
            alloc.event = i
            if delta > 0:
                try:
                    live[sid] = alloc.malloc(delta)
                except OutOfMemory:
                    assert limit is not None
                    break
                requested += delta
            else:
                alloc.free(live.pop(sid))
                requested += delta
            assert alloc.requested == requested
            assert alloc.reserved >= alloc.allocated >= alloc.requested
            if limit is not None:
                assert alloc.reserved <= limit
            if i % 25 == 0:
                alloc.check_invariants(live.values())
        alloc.check_invariants(live.values())
        r = replay(events, config, device_limit_bytes=limit)
        assert r.peak_reserved >= r.peak_allocated >= r.peak_requested
        assert r.peak_reserved == alloc.peak_reserved and r.peak_allocated == alloc.peak_allocated
        assert r.final_reserved == sum(r.segment_sizes) == alloc.reserved
        assert r.num_segments == len(r.segment_sizes)


def test_replay_of_1e5_events_completes():
    # its speed is measured by scripts/bench_speed.py (whole estimates), not asserted in a timed test
    rng = random.Random(7)
    events = _random_events(rng, 100_000)
    r = replay(events)
    assert r.peak_reserved >= r.peak_allocated

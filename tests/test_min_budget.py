"""The smallest device limit the caching-allocator replay completes under (allocator.min_device_limit)."""

import pytest

from memest.device.allocator import min_device_limit, parse_alloc_conf, replay

MiB = 2**20


def events(*steps):
    """('a', id, MiB) allocates, ('f', id) frees what id holds."""
    sizes, out = {}, []
    for step in steps:
        if step[0] == "a":
            sizes[step[1]] = step[2] * MiB
            out.append((step[1], step[2] * MiB))
        else:
            out.append((step[1], -sizes[step[1]]))
    return out


# 26 MiB cached; 28 MiB needs a second segment; 20 MiB is cut from the cached 26 (6 MiB stranded in a
# split segment, which the allocator cannot free); the 1 MiB request needs a 2 MiB small segment.
STRANDED = events(("a", 0, 26), ("f", 0), ("a", 1, 28), ("a", 2, 20), ("a", 3, 1))


def test_oom_is_not_monotonic_in_the_limit_and_the_search_says_which_boundary():
    assert replay(STRANDED).peak_reserved == 56 * MiB
    # 50 MiB: the 28 MiB cudaMalloc fails, the cached 26 MiB segment is freed, everything then fits
    assert not replay(STRANDED, device_limit_bytes=50 * MiB).oom
    assert replay(STRANDED, device_limit_bytes=50 * MiB - 1).oom
    # 54 and 55 MiB: room for 26 + 28, so the cache is kept, split, and the last 2 MiB do not fit
    assert replay(STRANDED, device_limit_bytes=54 * MiB).oom
    assert replay(STRANDED, device_limit_bytes=55 * MiB).oom
    # the bisection finds a boundary (completes there, OOM one byte below); every_larger the one above
    # which every limit completes
    assert min_device_limit(STRANDED) == 50 * MiB
    assert min_device_limit(STRANDED, every_larger=True) == 56 * MiB


def test_search_floor_is_the_requested_peak_not_the_allocated_one():
    # max_split_size_mb:20: the 25 MiB request takes the cached 30 MiB block whole (no split above
    # max_split), so the unconstrained peak allocated is 31 MiB; under a 30 MiB limit the 2 MiB small
    # segment forces the cached block out and 25 MiB gets a fresh 26 MiB segment: 30 MiB is enough
    conf = parse_alloc_conf("max_split_size_mb:20")
    ev = events(("a", 0, 30), ("f", 0), ("a", 1, 1), ("a", 2, 25))
    assert replay(ev, conf).peak_allocated == 31 * MiB
    assert min_device_limit(ev, conf) == 30 * MiB
    assert not replay(ev, conf, device_limit_bytes=30 * MiB).oom


@pytest.mark.parametrize("conf", ["expandable_segments:True", "per_process_memory_fraction:0.5"])
def test_whole_mib_search_where_a_replay_certifies_only_its_own_limit(conf):
    config = parse_alloc_conf(conf)
    limit = min_device_limit(STRANDED, config)
    assert limit % MiB == 0
    assert not replay(STRANDED, config, device_limit_bytes=limit).oom
    assert replay(STRANDED, config, device_limit_bytes=limit - MiB).oom

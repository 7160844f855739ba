""""Needed" is the smallest device budget the step runs in (the allocator replay with that limit
completes), so fits(budget) <=> needed <= budget <=> headroom >= 0, and the unconstrained usage (what a
GPU with room to spare shows) stays available beside it."""

import pytest

from memest.device.allocator import min_device_limit, parse_alloc_conf, replay
from memest.device.fit import fit_rows
from memest.device.usage import fits_in
from memest.plan.runner import Runner
from memest.plan.whatif import sweep
from memest.spec import RunSpec

from .conftest import model_ref

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


@pytest.fixture(scope="module")
def gpt2():
    """hf:gpt2, seq 256, bf16-mixed: unconstrained usage dips from batch 2 to 3 (cached segments)."""
    run = Runner(RunSpec(model="hf:gpt2", seq=256, optim="adamw", precision="bf16-mixed"))
    return {b: run.run(batch=b) for b in (2, 3, 4)}


def test_needed_rises_with_batch_where_unconstrained_usage_dips(gpt2):
    unconstrained = [gpt2[b].report.device.device_bytes for b in (2, 3, 4)]
    assert unconstrained[1] < unconstrained[0]  # the case this test is about
    needed = [gpt2[b].needed_bytes for b in (2, 3, 4)]
    assert needed[0] < needed[1] < needed[2]
    for b in (2, 3, 4):
        device = gpt2[b].report.device
        assert device.min_budget_bytes == gpt2[b].needed_bytes <= device.device_bytes
        outside = device.device_bytes - device.reserved_peak_bytes  # the same costs outside the allocator
        assert device.min_budget_bytes == device.min_allocator_limit_bytes + outside


def test_fits_at_needed_and_not_one_byte_below_and_a_direct_replay_agrees(gpt2):
    for result in gpt2.values():
        needed, usage = result.needed_bytes, result.report.device
        assert result.fits(needed) and not result.fits(needed - 1)
        assert fits_in(result.trace, usage, needed, env={})
        assert not fits_in(result.trace, usage, needed - 1, env={})
    assert gpt2[2].needed_bytes < gpt2[2].report.device.device_bytes  # so "needed" is not the unconstrained use


def test_headroom_is_non_negative_exactly_when_it_fits(gpt2):
    result = gpt2[2]
    needed, unconstrained = result.needed_bytes, result.report.device.device_bytes
    for budget in (needed - 1, needed, (needed + unconstrained) // 2, unconstrained):
        (row,) = fit_rows(result.needed_bytes, f"{budget}B", None, check=result.fits)
        assert row.fits == (row.headroom_bytes >= 0) == (budget >= needed)
        assert result.headroom_bytes(budget) == row.headroom_bytes


def test_whatif_points_fit_exactly_when_needed_is_within_the_budget():
    run = Runner(RunSpec(model=model_ref("transformer"), batch=2, seq=128, optim="adamw"))
    direct = run.run(batch=12, seq=128)
    capacity = direct.report.device.device_bytes - 1
    assert direct.fits(capacity)  # the allocator's cache release lets batch 12 run below its unconstrained use
    result = sweep(run, [2, 4, 8, 10, 12, 16], [128], capacity=capacity)
    assert not result.fallback
    point = next(p for p in result.points if p.batch == 12)
    assert not point.traced and point.fits  # rebuilt from the fit, and fits below the unconstrained use
    for p in result.points:
        assert p.fits == (p.needed_bytes <= capacity)


@pytest.mark.parametrize("conf", ["expandable_segments:True", "per_process_memory_fraction:0.5"])
def test_whole_mib_search_where_a_replay_certifies_only_its_own_limit(conf):
    config = parse_alloc_conf(conf)
    limit = min_device_limit(STRANDED, config)
    assert limit % MiB == 0
    assert not replay(STRANDED, config, device_limit_bytes=limit).oom
    assert replay(STRANDED, config, device_limit_bytes=limit - MiB).oom

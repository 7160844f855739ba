"""The caching allocator near capacity: the floor no allocator runs a step under, the replay's need
above it, expandable segments, the steady state of several steps, and the three-way verdict on the range
between (device/allocator.allocator_floor, device/usage.py, device/fit.py)."""

from __future__ import annotations

import random

import pytest

from memest.device.allocator import (
    CachingAllocator,
    OutOfMemory,
    allocator_floor,
    min_device_limit,
    parse_alloc_conf,
    replay,
)
from memest.device.fit import verdict
from memest.device.usage import allocator_events, device_usage, fits_in, replay_under
from memest.estimator import estimate
from memest.spec import RunSpec
from memest.spec.choices import Verdict

MIB = 2**20
DEFAULT, EXPANDABLE = parse_alloc_conf(""), parse_alloc_conf("expandable_segments:True")


def fragmenting(n: int = 40, seed: int = 0) -> list[tuple[int, int]]:
    """Large short-lived blocks between long-lived ones of other sizes: the freed holes fit few later
    requests, so the replay holds well over the live bytes."""
    rnd, events, keep, sid = random.Random(seed), [], [], 0
    for _ in range(n):
        short, long = sid, sid + 1
        sid += 2
        events += [(short, rnd.randint(30, 90) * MIB), (long, rnd.randint(10, 60) * MIB), (short, -1)]
        keep.append(long)
    return events + [(k, -1) for k in keep]


def random_trace(seed: int) -> list[tuple[int, int]]:
    rnd, live, events, sid = random.Random(seed), [], [], 0
    for _ in range(120):
        if live and rnd.random() < 0.45:
            events.append((live.pop(rnd.randrange(len(live))), -1))
        else:
            size = rnd.choice([rnd.randint(1, 1 << 20), rnd.randint(1 << 20, 12 << 20), rnd.randint(12 << 20, 90 << 20)])
            events.append((sid, size))
            live.append(sid)
            sid += 1
    return events


@pytest.mark.parametrize("conf", [DEFAULT, EXPANDABLE], ids=["default", "expandable"])
def test_the_floor_is_a_lower_bound_of_every_replay(conf):
    for seed in range(30):
        events = random_trace(seed)
        floor = allocator_floor(events, conf)
        assert replay(events, conf, device_limit_bytes=floor - 1).oom
        assert min_device_limit(events, conf) >= floor
        assert floor <= replay(events, conf).peak_reserved


def test_a_fragmenting_trace_needs_more_than_its_floor_and_the_verdict_between_is_tight():
    events = fragmenting()
    floor, need = allocator_floor(events, DEFAULT), min_device_limit(events, DEFAULT)
    assert need - floor >= 32 * MIB  # the replay's fragmentation (70 MiB on this trace)
    assert replay(events, DEFAULT, device_limit_bytes=need - 1).oom  # the replay says "does not fit" here
    between = (floor + need) // 2
    assert verdict(need, need + 8 * MIB, between, floor) == Verdict.TIGHT
    assert verdict(need, need + 8 * MIB, floor - 1, floor) == Verdict.DOES_NOT_FIT
    assert verdict(need, need + 8 * MIB, need + 8 * MIB, floor) == Verdict.FITS
    assert verdict(need, need + 8 * MIB, between) == Verdict.DOES_NOT_FIT  # the older rule, no floor given


@pytest.mark.parametrize("conf", [DEFAULT, EXPANDABLE], ids=["default", "expandable"])
def test_invariants_hold_under_pressure_just_above_the_floor(conf):
    events = fragmenting()
    floor = allocator_floor(events, conf)
    for limit in (floor, floor + 4 * MIB, floor + 24 * MIB, min_device_limit(events, conf)):
        alloc, live = CachingAllocator(conf, limit), {}
        for sid, delta in events:
            try:
                if delta > 0:
                    live[sid] = alloc.malloc(delta)
                else:
                    alloc.free(live.pop(sid))
            except OutOfMemory:
                break
            alloc.check_invariants(live.values())
            assert alloc.reserved <= limit


@pytest.fixture(scope="module")
def gpt2_steps():
    """hf:gpt2, seq 256, batch 4, bf16-mixed, AdamW, traced for 1, 2 and 3 steps."""
    return {n: estimate(RunSpec(model="hf:gpt2", seq=256, batch=4, optim="adamw", precision="bf16-mixed",
                                iterations=n)) for n in (1, 2, 3)}


def _events(result):
    return allocator_events(result.trace, result.report.device.fixed_costs)


def test_two_traced_steps_are_the_steady_state(gpt2_steps):
    """Step 2 reuses step 1's cache and adds the optimizer state; a third step replays as the second did,
    so the two steps memest traces by default give the peak reserved and the need of a longer run."""
    got = {}
    for n, result in gpt2_steps.items():
        events = _events(result)
        for name, conf in (("default", DEFAULT), ("expandable", EXPANDABLE)):
            run = replay(events, conf)
            got[n, name] = (run.peak_reserved, min_device_limit(events, conf, unconstrained=run))
    for name in ("default", "expandable"):
        assert got[2, name] == got[3, name]
        assert got[1, name][0] < got[2, name][0]


def test_expandable_segments_replay_near_the_floor_on_a_real_step(gpt2_steps):
    events = _events(gpt2_steps[2])
    floor_d, floor_e = allocator_floor(events, DEFAULT), allocator_floor(events, EXPANDABLE)
    need_d, need_e = min_device_limit(events, DEFAULT), min_device_limit(events, EXPANDABLE)
    assert floor_d <= floor_e <= need_e and floor_d <= need_d
    assert need_e - floor_e < need_d - floor_d  # expandable segments fragment less (gpt2: 40 vs 280 MiB)
    assert need_e - floor_e <= 2 * 20 * MIB  # within two large pages of its floor
    # under a limit just above its floor the expandable replay runs, its invariants intact
    alloc, live = CachingAllocator(EXPANDABLE, need_e), {}
    for i, (sid, delta) in enumerate(events):
        if delta > 0:
            live[sid] = alloc.malloc(delta)
        else:
            alloc.free(live.pop(sid))
        if i % 50 == 0:
            alloc.check_invariants(live.values())
    assert alloc.peak_reserved <= need_e


def test_usage_reports_the_floor_and_the_verdict_uses_it(gpt2_steps):
    result = gpt2_steps[2]
    usage = result.report.device
    assert usage.allocator_floor_bytes == allocator_floor(_events(result), DEFAULT)
    assert usage.allocator_floor_bytes < usage.min_allocator_limit_bytes  # the replay fragments here
    outside = usage.min_budget_bytes - usage.min_allocator_limit_bytes
    assert usage.needed_bytes_floor == usage.allocator_floor_bytes + outside
    assert usage.needed_bytes_low <= usage.needed_bytes_floor < usage.needed_bytes_expected
    assert usage.reserved_bytes_low <= usage.allocator_floor_bytes
    between = (usage.needed_bytes_floor + usage.needed_bytes_expected) // 2
    assert not fits_in(result.trace, usage, between, env={})  # the replay under that budget raises OOM
    assert result.verdict(between) == Verdict.TIGHT
    assert result.verdict(usage.needed_bytes_floor - 1) == Verdict.DOES_NOT_FIT
    assert result.verdict(usage.needed_bytes_high) == Verdict.FITS
    assert usage.expandable_limit_bytes is not None
    assert usage.expandable_limit_bytes < usage.min_allocator_limit_bytes
    basis = "\n".join(device_usage(result.trace, (9, 0), env={}).range_basis)  # no allocator settings
    assert "PYTORCH_CUDA_ALLOC_CONF unset" in basis and "allocator floor" in basis
    assert "expandable_segments:True" in basis


def test_pytorch_alloc_conf_is_read_as_torch_reads_it(gpt2_steps):
    """torchtitan's run_train.sh sets PYTORCH_ALLOC_CONF=expandable_segments:True."""
    trace = gpt2_steps[2].trace
    usage = device_usage(trace, (9, 0), env={"PYTORCH_ALLOC_CONF": "expandable_segments:True"})
    plain = device_usage(trace, (9, 0), env={})
    assert usage.allocator_config == "expandable_segments:True"
    assert usage.expandable_limit_bytes is None  # already set
    assert usage.min_allocator_limit_bytes == plain.expandable_limit_bytes
    assert any("PYTORCH_ALLOC_CONF=expandable_segments:True" in line for line in usage.range_basis)
    first = device_usage(trace, (9, 0), env={"PYTORCH_CUDA_ALLOC_CONF": "", "PYTORCH_ALLOC_CONF": "expandable_segments:True"})
    assert first.min_allocator_limit_bytes == plain.min_allocator_limit_bytes  # the first one set wins


def test_reserved_under_a_budget_is_capped_near_it(gpt2_steps):
    result = gpt2_steps[1]  # one step: the default allocator's need is below its unconstrained peak reserved
    usage = result.report.device
    assert usage.min_allocator_limit_bytes < usage.reserved_peak_bytes
    outside = usage.min_budget_bytes - usage.min_allocator_limit_bytes
    under = replay_under(result.trace, usage, usage.min_budget_bytes, env={})
    assert not under.oom
    assert usage.allocator_floor_bytes <= under.peak_reserved <= usage.min_allocator_limit_bytes
    assert under.peak_reserved < usage.reserved_peak_bytes  # what a run on that card shows, not the unconstrained
    assert replay_under(result.trace, usage, outside - 1, env={}) is None


def test_the_cli_says_tight_between_the_floor_and_the_replays_need_and_why():
    from typer.testing import CliRunner

    from memest.cli import app

    args = ["estimate", "examples/transformer.py", "--batch", "2", "--seq", "128", "--optim", "adamw"]
    result = estimate(RunSpec(model="examples/transformer.py", batch=2, seq=128, optim="adamw"))
    usage = result.report.device
    assert usage.needed_bytes_floor < usage.needed_bytes_expected  # the replay fragments (34 MiB)
    budget = f"{(usage.needed_bytes_floor + usage.needed_bytes_expected) // 2}B"
    runner = CliRunner()
    loose = runner.invoke(app, [*args, "--gpu", budget, "--fail-if-not-fits", "--format", "markdown"])
    assert loose.exit_code == 0, loose.output
    assert "TIGHT against budget" in loose.stdout and "over the floor" in loose.stdout
    strict = runner.invoke(app, [*args, "--gpu", budget, "--fail-if-not-fits", "--strict", "--format", "markdown"])
    assert strict.exit_code == 1
    below = runner.invoke(app, [*args, "--gpu", f"{usage.needed_bytes_floor - 1}B", "--fail-if-not-fits"])
    assert below.exit_code == 1

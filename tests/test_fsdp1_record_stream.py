"""FSDP1's record_stream marks (parallel/fsdp1.py ``_stream_marks``) and the high end they make (device/usage.py):
the replay that keeps each record_stream'd block pending until the rate limiter's sync (device/allocator.py)."""

import dataclasses

from memest.device.allocator import FREE_EVENT_ID, GPU_PASSED_ID, RECORD_STREAM_ID, replay
from memest.device.slack import slack_band
from memest.device.usage import allocator_events, device_usage, fixed_costs
from memest.features.registry import trace_step
from memest.sources import load_source
from memest.spec import RunSpec

from .conftest import model_ref


def _trace():
    spec = RunSpec(model=model_ref("transformer"), batch=2, seq=64, precision="fp32", target="cpu", world_size=2,
                   shard="zero3", fsdp_version="1")
    return trace_step(load_source(spec.model), spec)


def test_marks_and_the_high_end_they_make():
    trace = _trace()
    kinds = [kind for _, (kind, _) in trace.stream_marks]
    assert {RECORD_STREAM_ID, FREE_EVENT_ID, GPU_PASSED_ID} <= set(kinds)
    freed = {sid for sid, delta in trace.events if delta < 0}
    recorded = [v for _, (k, v) in trace.stream_marks if k == RECORD_STREAM_ID]
    assert set(recorded) <= freed  # each record_stream'd storage is freed later in the step
    # the rate limiter: each sync waits for an event recorded before it, with at most 2 in flight
    recorded_events, in_flight = set(), 0
    for _, (kind, value) in trace.stream_marks:
        if kind == FREE_EVENT_ID:
            recorded_events.add(value)
            in_flight += 1
        elif kind == GPU_PASSED_ID:
            assert value in recorded_events
            assert in_flight >= 2  # _FreeEventQueue dequeues only at its limit (_limiter_utils.py)
            in_flight -= 1
    costs = fixed_costs((9, 0), 2)
    best = replay(allocator_events(trace, costs), streams=trace.streams())
    worst = replay(allocator_events(trace, costs, deferred=True), streams=trace.streams())
    assert best.peak_reserved_pending == 0 and worst.peak_reserved_pending > 0
    assert worst.peak_reserved > best.peak_reserved
    usage = device_usage(trace, (9, 0), world_size=2)
    plain = device_usage(dataclasses.replace(trace, stream_marks=[]), (9, 0), world_size=2)
    band = slack_band(False)
    assert usage.reserved_peak_bytes == plain.reserved_peak_bytes == best.peak_reserved  # the point stays
    assert usage.reserved_bytes_low == plain.reserved_bytes_low and usage.needed_bytes_low == plain.needed_bytes_low
    high = band.bounds(usage.allocated_peak_bytes, worst.peak_reserved, floor=usage.allocated_peak_bytes)[1]
    assert usage.reserved_bytes_high == max(plain.reserved_bytes_high, high)
    assert usage.needed_bytes_high >= plain.needed_bytes_high
    assert any(line.startswith("record_stream (FSDP1)") for line in usage.range_basis)
    assert not any(line.startswith("record_stream (FSDP1)") for line in plain.range_basis)

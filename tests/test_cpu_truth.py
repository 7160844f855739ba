"""The CPU ground truth's peak (validate/cpu_truth.py) counts the blocks the step allocates, whatever else is freed
while it runs."""

import torch
from torch.profiler import ProfilerActivity, profile

from memest.validate.cpu_truth import _allocation_events, _step_peak


def test_a_block_from_before_the_window_freed_in_it_does_not_lower_the_peak():
    held = {}
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True):  # an earlier run: the allocator learns it
        held["leftover"] = torch.ones(1_000_000, dtype=torch.uint8)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        del held["leftover"]  # freed during the measured step (the collector, in the compiled GPT-2 case)
        step = torch.ones(400_000, dtype=torch.uint8)
        step2 = torch.ones(100_000, dtype=torch.uint8)
        del step, step2
    events = _allocation_events(prof)
    first = events[0].extra_fields
    running_total = max(e.extra_fields.total_allocated for e in events) - (first.total_allocated - first.alloc_size)
    assert running_total < 500_000  # what the allocator's running total gave: the leftover's free hid the step
    assert _step_peak(events)[0] == 500_000

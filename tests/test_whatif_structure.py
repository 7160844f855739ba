"""plan/whatif.py fits storage sizes over (batch, seq) on traces of one structure and copies the rest of its template
whole: the record_stream marks and the events before the step (FSDP1's wrap). A trace whose marks or wrap differ is
another structure (no fit across it)."""

import dataclasses

from memest.plan.whatif import _structure
from memest.trace.events import Trace


def test_marks_and_the_wrap_are_part_of_the_structure():
    base = Trace()
    base.events = [(0, 512), (0, -512)]
    same = dataclasses.replace(base, events=[(0, 1024), (0, -1024)])
    assert _structure(base) == _structure(same)  # sizes are what the fit models
    marked = dataclasses.replace(base, stream_marks=[(1, (-1, 0))])
    wrapped = dataclasses.replace(base, load_events=[(-5, 4096), (-5, -4096)])
    assert _structure(marked) != _structure(base)
    assert _structure(wrapped) != _structure(base)

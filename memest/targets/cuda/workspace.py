"""Kernel workspaces whose size a CUDA library picks at run time: an expected size with a range.

A scratch rule (``CUDA_SCRATCH``, trace/tracker.py) returns byte sizes, allocated before the op's
outputs and freed after them; a :class:`Workspace` is allocated after the outputs (the library's call
comes once PyTorch has allocated them: ConvShared.cpp, cudnn/RNN.cpp) and is such a size (an ``int``: the expected bytes, which the trace and the allocator replay use) that also carries
``low`` and ``high`` bounds. The tracker keeps the bounds in ``Trace.workspace_ranges`` and the device
model replays the trace with each bound (device/usage.py). ``high`` is None where the library may take
whatever the device has free (cuDNN's benchmark search).
"""

from __future__ import annotations


class Workspace(int):
    """Expected bytes (the int value) of a buffer a library sizes at run time, with ``low``/``high``."""

    low: int
    high: int | None
    why: str
    after_outputs: bool  # the kernel allocates it once its outputs exist (cuDNN: PyTorch allocates outputs first)

    def __new__(cls, expected: int, low: int | None = None, high: int | None = -1, why: str = "",
                after_outputs: bool = True) -> Workspace:
        obj = super().__new__(cls, max(int(expected), 0))
        obj.after_outputs = after_outputs
        obj.low = int(expected) if low is None else max(int(low), 0)
        obj.high = int(expected) if high == -1 else (None if high is None else max(int(high), 0))
        obj.why = why
        return obj

    @property
    def has_range(self) -> bool:
        return self.low != int(self) or self.high != int(self)



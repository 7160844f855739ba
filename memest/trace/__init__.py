"""The engine: run a training step on fake tensors and record every storage allocation and free."""

from memest.trace.events import Category, Phase, StorageRecord, Trace
from memest.trace.step import trace_step

__all__ = ["Category", "Phase", "StorageRecord", "Trace", "trace_step"]

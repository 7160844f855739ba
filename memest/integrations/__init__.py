"""Checks inside the user's training loop (issue 25): ``memest.preflight`` for hand-written loops, and callbacks
for Transformers' ``Trainer`` (integrations/transformers.py) and Lightning (integrations/lightning.py).

They sit beside the API (layer rule, docs/ARCHITECTURE.md): they call ``memest.api.estimate`` on a model rebuilt
under fake tensors, never the user's loaded weights, and allocate nothing on a GPU; the GPU is read only after the
user's own steps ran (``Preflight.after_step``)."""

from memest.integrations.check import Preflight, measured_record
from memest.integrations.preflight import preflight

__all__ = ["Preflight", "measured_record", "preflight"]

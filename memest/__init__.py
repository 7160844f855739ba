"""memest: GPU memory estimates for PyTorch training, traced on fake tensors.

    import memest
    est = memest.estimate("hf:gpt2", batch=8, seq=1024, optim="adamw")
    print(est.peak_allocated_bytes, est.fits("11GB"))
"""

from memest.api import estimate, serve_capacity  # the Python API; torch is imported only when it runs
from memest.errors import DoesNotFitError, MemestError
from memest.integrations.preflight import preflight  # hand-written loops; torch is imported only when it runs
from memest.version import __version__

__all__ = ["estimate", "serve_capacity", "preflight", "DoesNotFitError", "MemestError", "__version__"]

"""memest: GPU memory estimates for PyTorch training, traced on fake tensors.

    import memest
    est = memest.estimate("hf:gpt2", batch=8, seq=1024, optim="adamw")
    print(est.peak_allocated_bytes, est.fits("11GB"))
"""

__version__ = "0.1.0"

from memest.api import estimate, serve_capacity  # noqa: E402  (the Python API; torch is imported only when it runs)
from memest.errors import MemestError  # noqa: E402

__all__ = ["estimate", "serve_capacity", "MemestError", "__version__"]

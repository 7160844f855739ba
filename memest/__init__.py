"""memest: GPU memory estimates for PyTorch training, traced on fake tensors."""

__version__ = "0.1.0"

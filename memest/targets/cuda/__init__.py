"""CUDA kernel semantics applied while tracing on fake CPU tensors (--target cuda): the SDPA
backends' saved tensors and scratch (sdpa.py) and CUDA autocast's op policy (autocast.py).
device/ only reads finished traces."""

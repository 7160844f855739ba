"""Kernel rules of the device a step targets: CUDA kernel semantics (cuda/) and CPU kernel scratch (cpu/)."""

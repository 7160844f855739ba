"""GPU realism and the live GPUs. gpustat (NVML) is imported lazily, only in nvml.py."""

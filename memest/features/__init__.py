"""Step features: techniques that change what a step holds (fine-tuning, quantization, loss heads, compile, checkpointing, optimizers, data-dependent bounds)."""

"""Parallelism: data (DDP/ZeRO/FSDP), tensor, sequence, pipeline, expert and context parallel, traced as torch runs them."""

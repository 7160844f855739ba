"""What to estimate: RunSpec (run.py), every choice (spec/choices.py), run configs (config.py), LoRA flags (lora.py)."""

from memest.spec.run import RunSpec

__all__ = ["RunSpec"]

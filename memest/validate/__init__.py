"""Ground truth: the same training step run for real, measured."""

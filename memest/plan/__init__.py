"""Planners: build RunSpecs, run estimates, compare: check, whatif, max-batch, advise."""

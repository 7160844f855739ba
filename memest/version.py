"""The package version (pyproject.toml's; the JSON documents and calibration profiles carry it)."""

__version__ = "0.1.0"

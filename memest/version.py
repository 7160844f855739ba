"""The package version (pyproject.toml's; the JSON documents and calibration profiles carry it)."""

__version__ = "0.1.0"


def versions_line() -> str:
    """`memest --version`: memest's, torch's and transformers' versions, read without importing them."""
    from importlib import metadata

    def installed(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    return f"memest {__version__}, torch {installed('torch')}, transformers {installed('transformers')}"

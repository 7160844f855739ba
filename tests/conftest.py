from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MODELS = Path(__file__).resolve().parent / "models"
CONFIGS = Path(__file__).resolve().parent / "configs"


def model_ref(name: str) -> str:
    """tests/models/NAME.py, examples/NAME.py (NAME:factory for another factory), or hf:tests/configs/NAME.json."""
    if name.startswith("hf:"):
        return f"hf:{CONFIGS / (name[3:] + '.json')}"
    name, sep, factory = name.partition(":")
    for folder in (MODELS, ROOT / "examples"):
        path = folder / f"{name}.py"
        if path.exists():
            return f"{path}{sep}{factory}"
    raise FileNotFoundError(name)


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: traces full-size configs (seconds each)")


@pytest.fixture
def ref():
    return model_ref

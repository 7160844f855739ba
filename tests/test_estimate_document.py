"""The `memest estimate --json` document is the same before and after the report's assembly changed: a golden
copy per case, timings (trace_seconds) left out. Regenerate after a deliberate change of the document with
``python tests/test_estimate_document.py`` (from the repository root)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "golden" / "estimate_documents.json"
TINY = ["--batch", "2", "--seq", "32"]
CASES = {
    "mlp-cpu": ["examples/mlp.py", "--target", "cpu"],
    "mlp-cuda": ["examples/mlp.py", "--target", "cuda"],
    "nanogpt-cpu": ["tests/models/nanogpt.py", "--target", "cpu", "--grad-accum", "2"],
    "nanogpt-cuda-checkpointing": ["tests/models/nanogpt.py", "--target", "cuda", "--checkpointing", "blocks",
                                   "--precision", "bf16-mixed"],
    "llama-fsdp-offload-cuda": ["hf:tests/configs/llama-tiny.json", *TINY, "--world-size", "2", "--shard", "zero3",
                                "--offload", "optimizer", "--target", "cuda"],
    "llama-pp2-cpu": ["hf:tests/configs/llama-tiny.json", *TINY, "--world-size", "2", "--pp", "2", "--target", "cpu"],
    "llama-cp2-cuda": ["hf:tests/configs/llama-tiny.json", *TINY, "--world-size", "2", "--cp", "2", "--shard", "zero3",
                       "--precision", "bf16-mixed", "--target", "cuda"],
    "llama-from-deepspeed-cuda": ["hf:tests/configs/llama-tiny.json", "--seq", "32", "--from",
                                  "tests/configs/trainers/ds_z3_offload.json", "--target", "cuda"],
    "mixtral-ep2-cuda": ["hf:tests/configs/mixtral-tiny.json", *TINY, "--world-size", "2", "--ep", "2", "--shard",
                         "zero3", "--target", "cuda"],
    "qwen2.5-vl-images-cuda": ["hf:tests/configs/qwen2.5-vl-tiny.json", "--batch", "1", "--seq", "16", "--images", "2",
                               "--image-size", "140x250", "--precision", "bf16-mixed", "--target", "cuda"],
}


def _timeless(value):
    """The document without its timings (the only values that change from run to run)."""
    if isinstance(value, dict):
        return {k: _timeless(v) for k, v in value.items() if k != "trace_seconds"}
    if isinstance(value, list):
        return [_timeless(v) for v in value]
    return value


def document(args: list[str]) -> dict:
    """A card named (not a visible GPU), no calibration cache and relative model paths: nothing of this machine."""
    import tempfile

    from memest.cli import app

    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        with tempfile.TemporaryDirectory() as cache:
            result = CliRunner().invoke(app, ["estimate", *args, "--gpu", "h100", "--json"],
                                        env={"XDG_CACHE_HOME": cache})
    finally:
        os.chdir(cwd)
    assert result.exit_code == 0, result.output
    return _timeless(json.loads(result.stdout))


@pytest.mark.parametrize("case", list(CASES))
def test_estimate_document_is_unchanged(case):
    golden = json.loads(GOLDEN.read_text())
    assert document(CASES[case]) == golden[case]


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    GOLDEN.write_text(json.dumps({name: document(args) for name, args in CASES.items()}, indent=1) + "\n")

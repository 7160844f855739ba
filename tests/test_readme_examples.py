"""Issue 22, item 34: README's examples run, and do what the comment beside them says.

README marks its example blocks (<!-- ci:examples ... --> and <!-- ci:python ... -->). Every command line of
the examples block is either run here (no GPU, under ~20 s on the CI machine), asserted on its exit code and
its comment's claim, or listed in SKIPPED with the reason: a new README line that is neither fails this test."""

import json
import os
import re
import shlex

import pytest
from typer.testing import CliRunner

from memest.cli import app

from .conftest import ROOT

README = (ROOT / "README.md").read_text(encoding="utf-8")


def _block(marker: str) -> str:
    start = README.index(f"<!-- ci:{marker}")
    body = README[start:].split("```", 2)[1]
    return body.split("\n", 1)[1]  # drop the fence's language


def _commands() -> dict[str, str]:
    """Each command line (continuations joined) -> its comment."""
    text = re.sub(r"\\\n\s*", " ", _block("examples"))
    out = {}
    for line in text.splitlines():
        if line.strip():
            command, _, comment = line.partition("#")
            out[" ".join(command.split())] = comment.strip()
    return out


SKIPPED = {  # command -> why it is not run here
    "memest estimate hf:gpt2 --batch 8 --seq 1024 --optim adamw": "a full GPT-2 trace: over ~20 s on the CI machine",
    "memest estimate hf:llama-2-7b --batch 1 --seq 4096 --precision bf16-mixed --json": "a 7B trace: over ~20 s",
    "memest estimate model.py --gpu 11GB --fail-if-not-fits": "model.py stands for the reader's own file",
    "memest estimate model.py --batch 32 --plot step.png": "model.py stands for the reader's own file",
    "memest check configs/gpt2-11gb-fits.yaml --gpu 11GB --margin 10%": "a full GPT-2 trace: over ~20 s",
    "memest whatif hf:gpt2 --seq 256,512,1024 --batch 1,2,4,8 --gpu 24GB": "a GPT-2 grid of traces: minutes",
    "memest max-batch hf:gpt2 --seq 1024 --gpu 24GB": "a search over GPT-2 traces: minutes",
    "memest advise hf:gpt2 --batch 16 --seq 1024 --optim adamw --gpu 11GB": "GPT-2 re-traced per remedy: minutes",
    "memest serve hf:llama-3-8b --gpu h100 --max-model-len 8192": "an 8B profile run traced: over ~20 s",
    "memest estimate hf:llama-2-7b --world-size 8 --tp 4 --sp --shard zero3 --precision bf16-mixed":
        "a 7B parallel trace: minutes",
    "memest plan-parallel hf:llama-2-70b --gpus 64 --gpu h100 --seq 4096 --precision bf16-mixed": "many traces: minutes",
    "memest estimate hf:llama-3.1-8b --seq 2048 --precision bf16 --lora r=16,alpha=32,targets=all-linear "
    "--quant nf4 --checkpointing blocks --optim paged-adamw-8bit --gpu 24GB": "an 8B QLoRA trace: minutes",
}


def _run(command: str):
    argv = shlex.split(command)
    assert argv[0] == "memest"
    return CliRunner().invoke(app, argv[1:])


def test_every_readme_example_is_run_or_skipped_with_a_reason():
    commands = _commands()
    assert len(commands) >= 10
    ran = {"memest estimate examples/mlp.py --batch 32 --optim adam", "memest gpus",
           "memest calibrate --out profiles/mycard.json"}
    assert set(commands) == set(SKIPPED) | ran, set(commands) ^ (set(SKIPPED) | ran)


def test_readme_mlp_example_estimates():
    result = _run("memest estimate examples/mlp.py --batch 32 --optim adam --json")  # the README line, as JSON
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["peak_allocated_bytes"] > 0


def test_readme_gpus_example_lists_or_says_why_not():
    result = _run("memest gpus")  # "live NVIDIA GPUs and processes"
    assert result.exit_code == 0, result.stderr
    assert "NVIDIA" in result.stdout or "GPU" in result.stdout


def test_readme_calibrate_example_needs_a_gpu_and_writes_nothing_without_one(tmp_path, monkeypatch):
    from memest.device import nvml

    if nvml.query_gpus().gpus:
        pytest.skip("a GPU is visible: calibrate would measure it")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    result = _run("memest calibrate --out profiles/mycard.json")  # "on a GPU machine: measure the fixed costs"
    assert result.exit_code == 2 and "needs an NVIDIA GPU" in result.stderr
    assert os.listdir(tmp_path) == []


def test_readme_python_example_runs_on_a_small_model():
    code = _block("python")
    assert 'memest.estimate("hf:gpt2"' in code and "est.fits(" in code
    import memest

    est = memest.estimate(str(ROOT / "examples" / "mlp.py"), batch=8, optim="adamw", precision="bf16-mixed")
    for value in (est.peak_allocated_bytes, est.device_bytes, est.needed_bytes):  # "ints (bytes)"
        assert isinstance(value, int) and value > 0
    assert est.fits("11GB") is True and est.fits("rtx2080ti") is True and est.fits(12 * 2**30) is True

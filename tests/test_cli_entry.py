"""How memest starts and behaves as a shell tool (issue 25): `python -m memest`, typer's shell completion under
memest's own name however it is started; and --timeout's error stating each command's true default (issue 22)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MLP = str(ROOT / "examples" / "mlp.py")


def _memest(*args, env=None, cwd=None):
    full = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run([sys.executable, "-m", "memest", *args], capture_output=True, text=True, env=full,
                          cwd=cwd, timeout=300)


def test_python_dash_m_memest_prints_the_versions():
    import torch

    from memest.version import __version__

    proc = _memest("--version")
    assert proc.returncode == 0, proc.stderr
    line = proc.stdout.strip()
    assert line.startswith(f"memest {__version__}, torch {torch.__version__}, transformers "), line


def test_python_dash_m_memest_usage_names_memest():
    proc = _memest("--help")
    assert proc.returncode == 0
    assert "Usage: memest [OPTIONS] COMMAND" in proc.stdout
    assert "--install-completion" in proc.stdout and "--show-completion" in proc.stdout


def test_show_completion_script_uses_memests_variable():
    proc = _memest("--show-completion", "bash", env={"_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION": "1"})
    assert proc.returncode == 0, proc.stderr
    assert "_MEMEST_COMPLETE=complete_bash" in proc.stdout
    assert "complete -o default -F _memest_completion memest" in proc.stdout


@pytest.mark.parametrize("words, cword, expected", [
    ("memest es", 1, "estimate"),
    ("memest plan", 1, "plan-parallel"),
    ("memest estimate --ba", 2, "--batch"),
    ("memest serve --max-m", 2, "--max-model-len"),
])
def test_bash_completion_completes_commands_and_flags(words, cword, expected):
    proc = _memest(env={"_MEMEST_COMPLETE": "complete_bash", "COMP_WORDS": words, "COMP_CWORD": str(cword)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [expected]


def test_install_completion_writes_the_script_under_home(tmp_path):
    env = {"HOME": str(tmp_path), "_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION": "1"}
    proc = _memest("--install-completion", "bash", env=env)
    assert proc.returncode == 0, proc.stderr
    script = tmp_path / ".bash_completions" / "memest.sh"
    assert "_MEMEST_COMPLETE=complete_bash" in script.read_text()
    assert str(script) in (tmp_path / ".bashrc").read_text()


@pytest.mark.parametrize("command, default", [
    ("estimate", "1800"), ("check", "1800"),
    ("whatif", "no limit"), ("max-batch", "no limit"), ("advise", "no limit"), ("plan-parallel", "no limit"),
])
def test_timeout_zero_states_the_commands_own_default(command, default, tmp_path):
    target = MLP
    if command == "check":
        target = tmp_path / "c.yaml"
        target.write_text(f"model: {MLP}\nbatch: 2\ngpu: 24GiB\n")
    extra = ["--gpu", "24GiB"] if command in ("max-batch", "advise", "plan-parallel") else []
    proc = _memest(command, str(target), *extra, "--timeout", "0")
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert proc.stderr.strip().splitlines() == [
        f"memest: error: --timeout must be a number of seconds above 0 (default: {default}), got 0"]


def test_serve_timeout_zero_says_no_limit():
    proc = _memest("serve", "hf:llama-3.2-1b", "--gpu", "24GiB", "--timeout", "0")
    assert proc.returncode == 2
    assert "(default: no limit), got 0" in proc.stderr

"""Issue 22, user code run apart from memest's own output and exit code: writes below ``sys.stdout``
(item 5), a closed stdout (item 6), ``os._exit`` / signals / hangs / segfaults in model code under a worker
process (item 8 and the mechanism), a ``BaseException`` from model code (item 26's last clause). The CLI runs
as a real subprocess where file descriptors, pipes and process exits are what is tested."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from typer.testing import CliRunner

from memest.cli import app

from .conftest import ROOT

runner = CliRunner()

TINY = """
import torch
from torch import nn


def build_model():
{body}
    return nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 10))


def example_inputs(batch_size, seq_len=None):
    return (torch.randn(batch_size, 64),)


def compute_loss(output, inputs):
    return output.float().pow(2).mean()
"""


def model_file(tmp_path, name: str, body: str = "pass", top: str = "") -> str:
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(top) + TINY.format(body=textwrap.indent(textwrap.dedent(body), "    ")))
    return str(path)


def memest(*args, stdout=subprocess.PIPE, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "memest", *map(str, args)], stdout=stdout, stderr=subprocess.PIPE,
                          text=True, env=env, cwd=ROOT, timeout=timeout)


def error_line(proc) -> str:
    """Exit 2 and exactly one line on stderr that starts 'memest: error:', no traceback."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    lines = [line for line in proc.stderr.splitlines() if line.startswith("memest: error")]
    assert len(lines) == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    return lines[0]


# -- item 5: writes below sys.stdout ------------------------------------------------------------------


NOISY = """
import os, subprocess
os.write(1, b"OS-WRITE\\n")
subprocess.run(["echo", "SUBPROCESS-ECHO"], check=True)
os.system("echo OS-SYSTEM")
"""


def test_json_stdout_is_one_document_when_model_code_writes_to_fd_1(tmp_path):
    noisy = model_file(tmp_path, "noisy", NOISY)
    proc = memest("estimate", noisy, "--json", "--gpu", "11GB")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout)["model"] == "noisy"  # nothing but the one document
    for text in ("OS-WRITE", "SUBPROCESS-ECHO", "OS-SYSTEM"):
        assert text not in proc.stdout and text in proc.stderr


def test_check_json_stdout_is_one_document_when_model_code_writes_to_fd_1(tmp_path):
    noisy = model_file(tmp_path, "noisy", NOISY)
    config = tmp_path / "run.yaml"
    config.write_text(f"model: {noisy}\ngpu: 11GB\n")
    proc = memest("check", config, "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    json.loads(proc.stdout)
    assert "OS-WRITE" in proc.stderr and "OS-SYSTEM" in proc.stderr and "SUBPROCESS-ECHO" in proc.stderr


# -- item 26 (last clause): a BaseException subclass from model code -----------------------------------


BOOM_TOP = """
class Boom(BaseException):
    pass
"""


def test_base_exception_from_model_code_is_a_one_line_error_naming_the_file(tmp_path):
    boom = model_file(tmp_path, "boom", 'raise Boom("kaboom")', top=BOOM_TOP)
    line = error_line(memest("estimate", boom))
    assert "boom.py" in line and "Boom" in line and "kaboom" in line


def test_base_exception_from_model_code_in_check_names_the_config_and_file(tmp_path):
    boom = model_file(tmp_path, "boom", 'raise Boom("kaboom")', top=BOOM_TOP)
    config = tmp_path / "boom.yaml"
    config.write_text(f"model: {boom}\ngpu: 11GB\n")
    result = runner.invoke(app, ["check", str(config)])
    assert result.exit_code == 2, (result.exit_code, result.stderr)
    line = [x for x in result.stderr.splitlines() if x.startswith("memest: error")]
    assert len(line) == 1 and "boom.yaml" in line[0] and "boom.py" in line[0] and "Boom" in line[0]


# -- item 6: a closed stdout keeps the command's own exit code -----------------------------------------


def closed_stdout(*args) -> tuple[int, str]:
    """Run memest with stdout a pipe whose reading end is closed before memest writes (as `| head -1` does
    once it has its line): every write gets EPIPE."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "memest", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env, cwd=ROOT)
    proc.stdout.close()
    _, err = proc.communicate(timeout=120)
    return proc.returncode, err.decode()


@pytest.mark.parametrize("fmt", [[], ["--json"], ["--markdown"]])
def test_closed_stdout_exits_with_the_answer_not_does_not_fit(tmp_path, fmt):
    tiny = model_file(tmp_path, "tiny")
    code, err = closed_stdout("estimate", tiny, "--gpu", "11GB", "--fail-if-not-fits", *fmt)
    assert code == 0, err[-2000:]
    assert "Traceback" not in err and "Exception ignored" not in err


def test_closed_stdout_keeps_does_not_fit_and_error_codes(tmp_path):
    tiny = model_file(tmp_path, "tiny")
    code, err = closed_stdout("estimate", tiny, "--gpu", "1MB", "--fail-if-not-fits")
    assert code == 1, err[-2000:]
    code, err = closed_stdout("estimate", tiny, "--gpu", "1MB", "--batch", "0")
    assert code == 2 and err.count("memest: error") == 1, err[-2000:]


def test_closed_stdout_in_check_keeps_its_code(tmp_path):
    tiny = model_file(tmp_path, "tiny")
    fits, too_big = tmp_path / "fits.yaml", tmp_path / "too-big.yaml"
    fits.write_text(f"model: {tiny}\ngpu: 11GB\n")
    too_big.write_text(f"model: {tiny}\ngpu: 1MB\n")
    assert closed_stdout("check", fits)[0] == 0
    assert closed_stdout("check", fits, too_big)[0] == 1


# -- item 8 and the worker: model code that ends the process, crashes or hangs under `check` -----------


def configs(tmp_path, model: str) -> tuple:
    """A config that does not fit (1 MB) and then one whose model is ``model``."""
    tiny = model_file(tmp_path, "tiny")
    too_big = tmp_path / "a-too-big.yaml"
    too_big.write_text(f"model: {tiny}\ngpu: 1MB\n")
    bad = tmp_path / "b-bad.yaml"
    bad.write_text(f"model: {model}\ngpu: 11GB\n")
    return too_big, bad


@pytest.mark.parametrize("name, body, says", [
    ("os_exit", "import os; os._exit(0)", "exit status 0"),
    ("sigkill", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)", "SIGKILL"),
    ("segfault", "import ctypes; ctypes.string_at(0)", "SIGSEGV"),
])
def test_model_code_ending_the_process_after_a_does_not_fit_is_exit_2_naming_the_file(tmp_path, name, body, says):
    too_big, bad = configs(tmp_path, model_file(tmp_path, name, body))
    proc = memest("check", too_big, bad, "--json")
    line = error_line(proc)
    assert "b-bad.yaml" in line and f"{name}.py" in line and says in line
    assert proc.stdout == ""


def test_model_code_exiting_on_import_in_check_is_exit_2(tmp_path):
    exits = model_file(tmp_path, "exits_on_import", top="import os\nos._exit(0)\n")
    too_big, bad = configs(tmp_path, exits)
    line = error_line(memest("check", too_big, bad))
    assert "b-bad.yaml" in line and "exits_on_import.py" in line and "exit status 0" in line


def test_a_hang_past_timeout_is_exit_2_naming_the_file(tmp_path):
    too_big, bad = configs(tmp_path, model_file(tmp_path, "hangs", "import time; time.sleep(600)"))
    proc = memest("check", too_big, bad, "--timeout", "20", timeout=100)
    line = error_line(proc)
    assert "b-bad.yaml" in line and "hangs.py" in line and "--timeout" in line


@pytest.mark.parametrize("value", ["0", "-1", "inf", "nan"])
def test_timeout_must_be_positive_seconds(tmp_path, value):
    config = tmp_path / "run.yaml"
    config.write_text(f"model: {model_file(tmp_path, 'tiny')}\ngpu: 11GB\n")
    result = runner.invoke(app, ["check", str(config), "--timeout", value])
    assert result.exit_code == 2, (result.exit_code, result.stderr)
    assert [x for x in result.stderr.splitlines() if x.startswith("memest: error")][0].count("--timeout") == 1


def test_check_in_a_worker_gives_the_same_rows_as_in_process(tmp_path):
    """The worker changes where the trace runs, not what it finds: every row field equal."""
    from memest.app import run_check

    too_big, _ = configs(tmp_path, "unused")
    fits = tmp_path / "fits.yaml"
    fits.write_text(f"model: {model_file(tmp_path, 'tiny')}\nbatch: 3\ngpu: 11GB\n")
    here = run_check([str(fits), str(too_big)], {}, None, None, worker=False)
    there = run_check([str(fits), str(too_big)], {}, None, None, worker=True)
    assert [r.to_dict() for r in here.rows] == [r.to_dict() for r in there.rows]
    assert [r.verdict for r in there.rows] == ["fits", "does-not-fit"] and not there.fits


def test_what_the_worker_raises_crosses_back_as_itself():
    from memest.errors import TraceError
    from memest.worker import in_worker

    def fails(at):
        raise TraceError("model.py: no")

    with pytest.raises(TraceError, match="model.py: no"):
        in_worker(fails, 60)
    with pytest.raises(Exception) as info:  # not a memest error: the same class name, the child's traceback
        in_worker(lambda at: int("x"), 60)
    assert type(info.value).__name__ == "ValueError" and "invalid literal" in str(info.value)
    assert any("memest's worker process" in note and "int(\"x\")" in note for note in info.value.__notes__)
    assert in_worker(lambda at: {"rows": [1, 2]}, 60) == {"rows": [1, 2]}

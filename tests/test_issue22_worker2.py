"""Issue 22's worker mechanism for `estimate` and the planners: the trace runs in a worker process, which sends
back only the rendered output and the exit code. The output is byte for byte what the in-process path prints
(the timing figures aside), and model code that ends the process, crashes or hangs is exit 2 naming the file.
The CLI runs as a real subprocess where file descriptors and process exits are what is tested."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from memest.cli import app

from .conftest import CONFIGS, ROOT
from .test_issue22_worker import error_line, memest, model_file

TINY_HF = f"hf:{CONFIGS / 'gpt2-tiny.json'}"

# the pre-worker path: the same CLI with `run_command` given no worker, so each command's View is built and
# emitted in memest's own process, exactly as before the worker. One fresh process runs every compared command
# this way, one after another (argv[1]: a JSON list of argument lists; argv[2]: where to write each one's exit code,
# stdout and stderr), so the file pays one interpreter start and one import of memest's stack for them, not one
# each; the worker side (`memest(...)`) stays one real CLI process per command.
IN_PROCESS = """
import json, sys
from typer.testing import CliRunner
import memest.cli as c
c.InWorker = lambda *args: None
runs = []
for args in json.loads(sys.argv[1]):
    r = CliRunner().invoke(c.app, args, prog_name="memest")
    runs.append({"returncode": r.exit_code, "stdout": r.stdout, "stderr": r.stderr})
open(sys.argv[2], "w").write(json.dumps(runs))
"""

# the only figures that differ between two runs of the same command: how long the trace took
_TIMINGS = [(re.compile(r"(traced in[*:\s]+)[0-9.]+ s"), r"\1<t> s"),
            (re.compile(r'("(?:trace_)?seconds": )[0-9.e+-]+'), r"\1<t>")]


def _masked(text: str) -> str:
    for pattern, repl in _TIMINGS:
        text = pattern.sub(repl, text)
    return text


_COMPARED = {
    "mlp-text": ("estimate", "examples/mlp.py"),
    "mlp-json": ("estimate", "examples/mlp.py", "--json"),
    "mlp-markdown": ("estimate", "examples/mlp.py", "--markdown", "--gpu", "11GB"),
    "hf-text": ("estimate", TINY_HF, "--seq", "32"),
    "hf-json-does-not-fit": ("estimate", TINY_HF, "--seq", "32", "--json", "--gpu", "1MB", "--fail-if-not-fits"),
    "whatif": ("whatif", "examples/mlp.py", "--batch", "1,2", "--target", "cpu"),
    "advise-json": ("advise", "examples/mlp.py", "--gpu", "5MB", "--target", "cpu", "--json"),
    "plan-parallel": ("plan-parallel", f"hf:{CONFIGS / 'llama-tiny.json'}", "--gpus", "2", "--gpu", "1GB", "--seq",
                      "32", "--batch", "2", "--target", "cpu", "--json"),
}


@pytest.fixture(scope="module")
def in_process(tmp_path_factory) -> dict[tuple, subprocess.CompletedProcess]:
    """Every compared command's pre-worker output, from one fresh process (IN_PROCESS)."""
    out = tmp_path_factory.mktemp("in_process") / "runs.json"
    argv = [list(map(str, args)) for args in _COMPARED.values()]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    proc = subprocess.run([sys.executable, "-c", IN_PROCESS, json.dumps(argv), str(out)], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return {args: subprocess.CompletedProcess(list(args), **run)
            for args, run in zip(_COMPARED.values(), json.loads(out.read_text()), strict=True)}


@pytest.mark.parametrize("args", [v for k, v in _COMPARED.items() if k != "plan-parallel"],
                         ids=[k for k in _COMPARED if k != "plan-parallel"])
def test_worker_output_is_byte_identical_to_the_in_process_output(args, in_process):
    before, after = in_process[args], memest(*args)
    assert before.returncode == after.returncode, (before.stderr[-2000:], after.stderr[-2000:])
    assert before.stdout.strip() and after.returncode in (0, 1), after.stderr[-2000:]
    assert _masked(after.stdout) == _masked(before.stdout)
    if "--json" in args:
        json.loads(after.stdout)  # one document


def test_masking_hides_only_the_timing_figures():
    """The comparison above is not vacuous: a changed byte elsewhere shows."""
    text = 'traced in                  0.62 s\n- **traced in**: 1.14 s\n  "trace_seconds": 0.79,\n "needed_bytes": 123'
    assert _masked(text) == ('traced in                  <t> s\n- **traced in**: <t> s\n  "trace_seconds": <t>,\n'
                             ' "needed_bytes": 123')
    assert _masked(text) != _masked(text.replace("123", "124"))


@pytest.mark.parametrize("name, body, says", [
    ("os_exit", "import os; os._exit(0)", "exit status 0"),
    ("sigkill", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)", "SIGKILL"),
    ("segfault", "import ctypes; ctypes.string_at(0)", "SIGSEGV"),
])
@pytest.mark.parametrize("fmt", [(), ("--json",)], ids=["text", "json"])
def test_estimate_model_code_ending_the_process_is_exit_2_naming_the_file(tmp_path, name, body, says, fmt):
    proc = memest("estimate", model_file(tmp_path, name, body), "--gpu", "11GB", "--fail-if-not-fits", *fmt)
    line = error_line(proc)
    assert f"{name}.py" in line and says in line, line
    assert proc.stdout == ""


def test_estimate_hang_past_timeout_is_exit_2_naming_the_file(tmp_path):
    proc = memest("estimate", model_file(tmp_path, "hangs", "import time; time.sleep(600)"), "--json",
                  "--timeout", "5", timeout=100)  # the model never returns: any limit is passed; 5 s waits least
    line = error_line(proc)
    assert "hangs.py" in line and "--timeout" in line and "after 5 s" in line
    assert proc.stdout == ""


@pytest.mark.parametrize("command, extra", [
    ("whatif", ("--batch", "1,2")),
    ("max-batch", ("--gpu", "11GB")),
    ("advise", ("--gpu", "1MB")),
])
def test_planner_model_code_ending_the_process_is_exit_2_naming_the_file(tmp_path, command, extra):
    proc = memest(command, model_file(tmp_path, "os_exit", "import os; os._exit(0)"), "--target", "cpu", *extra)
    line = error_line(proc)
    assert "os_exit.py" in line and "exit status 0" in line, line
    assert proc.stdout == ""


def test_planner_hang_past_timeout_is_exit_2(tmp_path):
    proc = memest("whatif", model_file(tmp_path, "hangs", "import time; time.sleep(600)"), "--batch", "1,2",
                  "--timeout", "5", timeout=100)  # as above: the model never returns
    line = error_line(proc)
    assert "hangs.py" in line and "--timeout" in line and "after 5 s" in line


@pytest.mark.parametrize("command", ["estimate", "whatif"])
@pytest.mark.parametrize("value", ["0", "-1", "inf", "nan"])
def test_timeout_must_be_positive_seconds(tmp_path, command, value):
    extra = ("--batch", "1,2") if command == "whatif" else ()
    result = CliRunner().invoke(app, [command, model_file(tmp_path, "tiny"), *extra, "--timeout", value])
    assert result.exit_code == 2, (result.exit_code, result.stderr)
    assert [x for x in result.stderr.splitlines() if x.startswith("memest: error")][0].count("--timeout") == 1


def test_user_warnings_and_progress_from_the_worker_reach_stderr(tmp_path):
    """What the child writes to stderr crosses back: the model code's own warning (shown once, as in-process)
    and memest's notes; stdout stays the one JSON document."""
    warns = model_file(tmp_path, "warns", "import warnings; warnings.warn('MODEL-WARNING-42')")
    plot = tmp_path / "step.html"
    proc = memest("estimate", warns, "--json", "--plot", plot)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stderr.count("UserWarning: MODEL-WARNING-42") == 1, proc.stderr
    assert f"memest: wrote {plot}" in proc.stderr and plot.stat().st_size > 0
    assert json.loads(proc.stdout)["model"] == "warns"


def test_tight_warning_and_exit_code_cross_back_under_the_cli_runner(tmp_path):
    """Under typer's CliRunner (sys.stdout a captured stream, not fd 1) the parent writes the child's text into
    it: the same document the app layer gives in-process, and the exit code of --fail-if-not-fits."""
    from memest.app import run_estimate
    from memest.report.emit import json_text
    from memest.report.views import estimate_view

    tiny = model_file(tmp_path, "tiny")
    result = CliRunner().invoke(app, ["estimate", tiny, "--json", "--gpu", "1MB", "--fail-if-not-fits"])
    assert result.exit_code == 1, result.stderr
    here = json_text(estimate_view(run_estimate({"model": tiny}, "1MB")).doc)
    assert _masked(result.stdout) == _masked(here + "\n")


def test_python_api_runs_in_the_callers_process(tmp_path):
    """The API stays in-process (documented): the model code sees the caller's pid."""
    import memest

    marker = tmp_path / "pid.txt"
    tiny = model_file(tmp_path, "pid", f"import os; open({str(marker)!r}, 'w').write(str(os.getpid()))")
    memest.estimate(tiny, batch=2)
    assert int(marker.read_text()) == os.getpid()


def test_cli_runs_model_code_in_another_process(tmp_path):
    marker = tmp_path / "pid.txt"
    tiny = model_file(tmp_path, "pid", f"import os; open({str(marker)!r}, 'w').write(str(os.getpid()))")
    result = CliRunner().invoke(app, ["estimate", tiny, "--json"])
    assert result.exit_code == 0, result.stderr
    assert int(marker.read_text()) != os.getpid()


def test_a_worker_forked_after_real_parallel_kernels_does_not_hang(tmp_path):
    """GNU OpenMP's pool does not survive fork: a process that ran a real parallel matmul (this pytest process, an
    API caller) forked a worker whose own real matmul hung (stopped at 100 s on main before the fix). The worker
    runs on one thread and models its parent's thread count (worker.modelled_threads)."""
    import torch

    from memest import worker

    a = torch.randn(1500, 1500)
    assert float((a @ a).sum()) == float((a @ a).sum())  # a real parallel region in this process
    path = tmp_path / "realcompute.py"
    path.write_text(
        "import torch\n"
        "_W = torch.randn(1500, 1500)\n"
        "_ = (_W @ _W).sum()  # a real parallel kernel at import, in the worker\n"
        "def build_model():\n    return torch.nn.Linear(64, 64)\n"
        "def example_inputs(batch, seq):\n    return (torch.randn(batch, 64),)\n"
    )
    result = CliRunner().invoke(app, ["estimate", str(path), "--target", "cpu", "--json", "--timeout", "120"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["model"] == "realcompute"
    parent = torch.get_num_threads()
    got = worker.in_worker(lambda at: (worker.modelled_threads(torch.get_num_threads()), torch.get_num_threads()), 60)
    assert got == (parent, 1)
    assert worker.modelled_threads(7) == 7  # this process is no worker


def test_plan_parallel_in_a_worker_gives_the_in_process_document(in_process):
    args = _COMPARED["plan-parallel"]
    before, after = in_process[args], memest(*args, timeout=600)
    assert before.returncode == after.returncode == 0, (before.stderr[-2000:], after.stderr[-2000:])
    assert _masked(after.stdout) == _masked(before.stdout)


def test_a_worker_starts_its_own_forkserver_when_its_parent_ran_one():
    """plan-parallel's pool uses a forkserver; in a worker forked from a process whose forkserver was running (a
    test session that ran gloo ranks), multiprocessing waited on the parent's server, not the worker's child:
    ChildProcessError, exit 2 (CI, test_plan_parallel). The worker forgets the parent's server."""
    import multiprocessing

    from memest import worker

    server = multiprocessing.get_context("forkserver").Process(target=int)
    server.start()
    server.join()

    def work(at):
        child = multiprocessing.get_context("forkserver").Process(target=int)
        child.start()
        child.join()
        return child.exitcode

    assert worker.in_worker(work, 120) == 0

"""Issue 22, what is left of items 30 and 35: installed libraries' chatter kept off stderr unless --debug
(item 30: bitsandbytes' "Failed to load CPU gemm_4bit_forward ..." opened every --lora run's CI log), and the
plots drawing the budget and the needed line, a pipeline plot's title naming its rank (item 35)."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import sys
import textwrap
import warnings

import pytest

from memest.exits import library_noise_hidden
from memest.imports import keep_library_message, library_output_kept, quiet_library_import

from .conftest import ROOT

TINY_LLAMA = "hf:tests/configs/llama-tiny.json"
FAILED = "Failed to load CPU gemm_4bit_forward"

# bitsandbytes logs FAILED while peft imports it, on a CPU with AVX512-BF16 and without the `kernels` package
# (bitsandbytes/backends/cpu/ops.py, 0.50.x). This machine's CPU has no AVX512-BF16, so the subprocess gets a
# sitecustomize that makes bitsandbytes' own probe (functional.has_avx512bf16) answer True: bitsandbytes then
# runs its real branch and logs its real message. It also writes one line straight to file descriptor 2 while
# bitsandbytes.functional loads, as a C extension's fprintf would.
SITECUSTOMIZE = textwrap.dedent('''
    import importlib.abc, importlib.util, os, sys

    class AVX512BF16(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != "bitsandbytes.functional":
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                module.has_avx512bf16 = lambda: True
                os.write(2, b"FD2-WRITE-FROM-A-LIBRARY\\n")

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, AVX512BF16())
''')


def _memest(tmp_path, *args) -> subprocess.CompletedProcess:
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{ROOT}", "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "memest", *map(str, args)], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=300)


@pytest.mark.skipif(not all(importlib.util.find_spec(m) for m in ("peft", "bitsandbytes")),
                    reason="needs peft and bitsandbytes")
@pytest.mark.skipif(importlib.util.find_spec("kernels") is not None, reason="bitsandbytes logs it without `kernels`")
def test_lora_run_keeps_bitsandbytes_noise_off_stderr_unless_debug(tmp_path):
    args = ["estimate", TINY_LLAMA, "--batch", "1", "--seq", "16", "--lora", "r=4", "--json"]
    quiet = _memest(tmp_path, *args)
    assert quiet.returncode == 0, quiet.stderr
    json.loads(quiet.stdout)  # stdout: one JSON document
    assert "Failed" not in quiet.stderr
    assert "FD2-WRITE-FROM-A-LIBRARY" not in quiet.stderr
    assert "Warning" not in quiet.stderr  # transformers' FutureWarning from its own files

    debug = _memest(tmp_path, *args, "--debug")
    assert debug.returncode == 0, debug.stderr
    assert json.loads(debug.stdout)["peak_allocated_bytes"] == json.loads(quiet.stdout)["peak_allocated_bytes"]
    assert FAILED in debug.stderr
    assert "FD2-WRITE-FROM-A-LIBRARY" in debug.stderr


def test_lora_error_still_reaches_stderr(tmp_path):
    """memest's own error is never kept away: one line, exit 2."""
    pytest.importorskip("peft")
    proc = _memest(tmp_path, "estimate", TINY_LLAMA, "--batch", "1", "--seq", "16", "--lora", "r=100000")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith("memest: error:") and "r=100000" in lines[-1], proc.stderr
    assert not any(FAILED in line for line in lines)


def test_fd2_writes_during_a_library_import_are_kept(capfd):
    with library_output_kept() as kept:
        with quiet_library_import():
            os.write(2, b"written by C code\n")
            print("printed to sys.stderr", file=sys.__stderr__, flush=True)  # the CLI's sys.stderr: fd 2
    assert capfd.readouterr().err == ""
    assert "written by C code" in "".join(kept) and "printed to sys.stderr" in "".join(kept)


def test_without_keeping_a_library_import_writes_through(capfd):
    with quiet_library_import():
        os.write(2, b"written by C code\n")
    assert "written by C code" in capfd.readouterr().err


def test_an_import_that_fails_shows_what_it_wrote(capfd):
    with library_output_kept() as kept, pytest.raises(ImportError):
        with quiet_library_import():
            os.write(2, b"why it failed\n")
            raise ImportError("no module named x")
    assert "why it failed" in capfd.readouterr().err
    assert kept == []


def test_library_log_records_and_warnings_are_kept_errors_shown(capfd):
    with library_noise_hidden(debug=False):
        logging.getLogger("bitsandbytes.backends.cpu.ops").warning("Failed to load something: %s", "x")
        logging.getLogger("peft.tuners").error("peft error record")
        warnings.warn_explicit("a library's warning", FutureWarning, "/x/site-packages/lib/mod.py", 3)
        warnings.warn_explicit("the user's warning", UserWarning, "/home/user/model.py", 7)
    err = capfd.readouterr().err
    assert "Failed to load something" not in err and "a library's warning" not in err
    assert "peft error record" in err and "the user's warning" in err
    assert logging.getLogger("bitsandbytes").propagate and not logging.getLogger("bitsandbytes").handlers


def test_keep_outside_the_cli_keeps_nothing():
    assert keep_library_message("x") is False


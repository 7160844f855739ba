"""Issue 25, "install like a real tool": build the sdist and the wheel from a copy of the source tree
(`python -m build`: the wheel is built from the sdist, so the sdist must hold what a build needs), install the
wheel into a clean venv with its runtime dependencies (torch pinned to this session's version, so pip takes the
same CPU build), and run `memest --version` and one estimate from that venv, outside the source tree. The venv
has no pytest, matplotlib or transformers: a run-time import of test-only code fails the run.

Slow by nature (a venv and torch's install): 88 s to 185 s for the three tests on this project's 2 shared cores
(the fourth, `python -m memest` from the same venv, adds one estimate),
most of it pip installing torch (the CPU wheel, from the local wheel directory pip is configured with).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SKIP = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache",
                              ".ruff_cache", "*.pyc")


def _run(cmd, cwd, env=None, timeout=900):
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd} -> {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def _clean_env():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if ".venv" not in p)
    return env


def _package_files():
    """memest's sources and package data as paths relative to the repository root."""
    py = {p.relative_to(ROOT).as_posix() for p in (ROOT / "memest").rglob("*.py")}
    data = {p.relative_to(ROOT).as_posix() for p in (ROOT / "memest" / "data" / "models").glob("*.json")}
    assert data, "no bundled model configs found under memest/data/models"
    return py, data


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    pytest.importorskip("build", reason="`build` is in the dev extra (pip install -e .[dev])")
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=SKIP)
    dist = tmp / "dist"
    _run([sys.executable, "-m", "build", "--outdir", str(dist), str(src)], cwd=tmp)
    sdists, wheels = list(dist.glob("memest-*.tar.gz")), list(dist.glob("memest-*.whl"))
    assert len(sdists) == 1 and len(wheels) == 1, list(dist.iterdir())
    return tmp, sdists[0], wheels[0]


def test_sdist_holds_what_a_build_needs(built):
    _, sdist, _ = built
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    py, data = _package_files()
    missing = sorted(({"pyproject.toml", "README.md"} | py | data) - names)
    assert not missing, f"the sdist lacks {missing}"


def test_wheel_holds_the_package_and_its_data(built):
    _, _, wheel = built
    with zipfile.ZipFile(wheel) as whl:
        names = set(whl.namelist())
        entry = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        assert entry and "memest = memest.cli:main" in whl.read(entry[0]).decode()
    py, data = _package_files()
    missing = sorted((py | data) - names)
    assert not missing, f"the wheel lacks {missing}"
    assert not [n for n in names if n.startswith("tests/")], "tests shipped in the wheel"


@pytest.fixture(scope="module")
def installed(built):
    """The wheel installed in a clean venv; a working directory outside the source tree holding examples/mlp.py."""
    tmp, _, wheel = built
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], cwd=tmp)
    bindir = venv / ("Scripts" if os.name == "nt" else "bin")
    py = bindir / "python"
    pins = tmp / "constraints.txt"
    pins.write_text(f"torch=={torch.__version__}\n")  # the same torch build as this session (CPU here)
    env = _clean_env()
    _run([str(py), "-m", "pip", "install", "--quiet", "-c", str(pins), str(wheel)], cwd=tmp, env=env)

    work = tmp / "elsewhere"  # outside the source tree: nothing can come from ROOT
    work.mkdir()
    shutil.copy(ROOT / "examples" / "mlp.py", work / "mlp.py")
    return venv, bindir, py, env, work


def test_wheel_installs_in_a_clean_venv_and_runs(installed):
    venv, bindir, py, env, work = installed
    memest = str(bindir / "memest")

    version = _run([memest, "--version"], cwd=work, env=env).stdout.strip()
    from memest.version import __version__
    assert version == f"memest {__version__}, torch {torch.__version__}, transformers not installed", version

    # where memest, its package data and its imports come from, in that venv
    probe = ("import json, sys, memest, memest.cli, memest.app\n"
             "from importlib import resources\n"
             "models = sorted(p.name for p in resources.files('memest').joinpath('data/models').iterdir())\n"
             "test_only = sorted(m for m in ('pytest', 'matplotlib', '_pytest') if m in sys.modules)\n"
             "print(json.dumps({'file': memest.__file__, 'models': models, 'test_only': test_only}))\n")
    seen = json.loads(_run([str(py), "-c", probe], cwd=work, env=env).stdout)
    assert Path(seen["file"]).resolve().is_relative_to(venv.resolve()), seen["file"]
    assert seen["models"] == sorted(Path(p).name for p in _package_files()[1])
    assert seen["test_only"] == []

    # one real estimate from the venv, the same figure as from the source tree
    args = ["estimate", "mlp.py", "--batch", "2", "--json"]
    installed = json.loads(_run([memest, *args], cwd=work, env=env).stdout)
    here = json.loads(_run([sys.executable, "-m", "memest", *args], cwd=work,
                           env={**os.environ, "PYTHONPATH": str(ROOT)}).stdout)
    assert installed["memest_version"] == __version__
    for key in ("param_count", "peak_allocated_bytes", "needed_bytes"):
        assert installed[key] == here[key] > 0, key

    # hf: bundled configs are package data; without transformers memest says what to install
    proc = subprocess.run([memest, "estimate", "hf:llama-3.2-1b", "--batch", "2"], cwd=work, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "transformers" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_python_m_memest_runs_from_the_wheel(installed):
    """`python -m memest` (memest/__main__.py) from the installed wheel: the console script's version line, and one
    estimate with the figures of memest.estimate in this process."""
    import memest

    _, bindir, py, env, work = installed
    version = _run([str(py), "-m", "memest", "--version"], cwd=work, env=env).stdout
    assert version == _run([str(bindir / "memest"), "--version"], cwd=work, env=env).stdout
    by_module = json.loads(_run([str(py), "-m", "memest", "estimate", "mlp.py", "--batch", "2", "--json"], cwd=work,
                                env=env).stdout)
    here = memest.estimate(str(work / "mlp.py"), batch=2).to_dict()
    for key in ("param_count", "peak_allocated_bytes", "needed_bytes"):
        assert by_module[key] == here[key] > 0, key

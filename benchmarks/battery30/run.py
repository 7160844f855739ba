"""Run battery 30's rows (rows.txt) and check each mechanically: exit code in {0, 1, 2}; no Traceback; exit 2
prints exactly one `memest: error` line; --json stdout is one JSON document or empty. Writes results.json.
Usage (in the folder files.sh filled): R=/path/to/repo PYTHONPATH=$R python run.py [ids...]; ROWS=FILE runs another
battery's rows (benchmarks/battery31/rows.txt).
CLI rows run in this one process through typer's CliRunner (memest's `app`, the same entry `python -m memest`
calls; its worker process still forks per command), API rows as Python in this process: on a shared 2-core
machine a fresh interpreter per row cost ~50 s of imports. SUBPROCESS=1 runs each row as `python -m memest`."""

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

R = os.environ["R"]
T = f"{R}/tests/configs"
L = f"hf:{T}/llama-tiny.json"
HERE = Path(__file__).resolve().parent
ENV = {**os.environ, "PYTHONPATH": R}


def rows():
    for line in Path(os.environ.get("ROWS", HERE / "rows.txt")).read_text().splitlines():
        if line.startswith("#") or not line.strip():
            continue
        rid, expected, command = line.split("|", 2)
        yield rid, expected, command


def run_inprocess(command: str):
    """(rc, stdout, stderr) of one row in this process."""
    import contextlib
    import io
    import shlex

    if command.startswith("API:"):
        import torch

        import memest

        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                exec(command[4:], {"memest": memest, "torch": torch, "L": L, "T": T})
                print("ok")
            except memest.MemestError as e:
                print(f"{type(e).__name__}: {e}")
            except Exception as e:  # a raw exception is a defect: kept as a traceback marker
                print(f"Traceback: {type(e).__name__}: {e}")
        return 0, out.getvalue(), err.getvalue()
    from typer.testing import CliRunner

    from memest.cli import app

    cmd = command.replace("$L", L).replace("$T", T).replace("$R", R)
    res = CliRunner().invoke(app, shlex.split(cmd))
    return res.exit_code, res.stdout, res.stderr


def run(row):
    rid, expected, command = row
    start = time.time()
    if not os.environ.get("SUBPROCESS"):
        rc, stdout, stderr = run_inprocess(command)

        class p:  # noqa: N801 - the subprocess result's shape
            returncode, stdout, stderr = rc, "", ""
        p.stdout, p.stderr = stdout, stderr
    elif command.startswith("API:"):
        code = ("import memest, torch\n"
                f"L = {L!r}\nT = {T!r}\n"
                "try:\n    " + command[4:] + "\n    print('ok')\n"
                "except memest.MemestError as e:\n    print(f'{type(e).__name__}: {e}')\n")
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=600)
    else:
        cmd = command.replace("$L", L).replace("$T", T).replace("$R", R)
        import shlex
        p = subprocess.run([sys.executable, "-m", "memest", *shlex.split(cmd)], capture_output=True, text=True,
                           env=ENV, timeout=600)
    problems = []
    if p.returncode not in (0, 1, 2):
        problems.append(f"rc {p.returncode}")
    if "Traceback" in p.stderr or "Traceback" in p.stdout:
        problems.append("traceback")
    if "internal error" in p.stderr:
        problems.append("internal error")
    if not command.startswith("API:") and p.returncode == 2:
        errs = [x for x in p.stderr.splitlines() if x.startswith("memest: error")]
        if len(errs) != 1:
            problems.append(f"{len(errs)} error lines")
        elif len(p.stderr.strip().splitlines()) != 1:
            problems.append("stderr holds more than the error line")
    if "--json" in command and p.stdout.strip():
        try:
            json.loads(p.stdout)
        except ValueError:
            problems.append("--json stdout not one JSON document")
    return {"id": rid, "expected": expected, "command": command, "rc": p.returncode, "stdout": p.stdout[-3000:],
            "stderr": p.stderr[-3000:], "problems": problems, "seconds": round(time.time() - start, 1)}


if __name__ == "__main__":
    want = set(sys.argv[1:])
    todo = [r for r in rows() if not want or r[0] in want]
    out = Path(os.environ.get("OUT", "results.json"))  # in the folder files.sh filled
    done = json.loads(out.read_text()) if out.exists() else {}
    with ThreadPoolExecutor(int(os.environ.get("JOBS", "1" if not os.environ.get("SUBPROCESS") else "3"))) as pool:
        for res in pool.map(run, todo):
            done[res["id"]] = res
            print(res["id"], res["rc"], res["problems"], res["seconds"], flush=True)
            out.write_text(json.dumps(done, indent=1))

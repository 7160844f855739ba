"""Issue 22: a property test of the CLI contract over generated argument vectors and YAML configs.

A seeded generator (no extra dependency) builds argument vectors for every command from the options table
(spec/options.py), mostly edge values (0, -1, 1, huge, floats, strings, unicode, empty, unknown keys), and
YAML run configs for ``check``. For every case: the exit code is 0, 1 or 2; exit 2 prints exactly one error
line on stderr (memest's own ``memest: ...`` progress and warnings aside) and no traceback; no "internal
error"; ``--json`` stdout is one JSON document or empty; no file is written on exit 2. A second property:
the same step through the CLI, a YAML config and the Python API gives the same verdict.

CI runs a fixed budget (MEMEST_PROPERTY_CASES, default 40; seed MEMEST_PROPERTY_SEED, default 22); run
``MEMEST_PROPERTY_CASES=2000 pytest tests/test_cli_contract_property.py`` locally to search further."""

import json
import os
import random

import pytest
import yaml
from typer.testing import CliRunner

from memest.cli import app
from memest.spec import options
from memest.spec.choices import Choice

from .conftest import ROOT

CASES = int(os.environ.get("MEMEST_PROPERTY_CASES", "40"))
SEED = int(os.environ.get("MEMEST_PROPERTY_SEED", "22"))
COMMANDS = ("estimate", "check", "whatif", "max-batch", "advise", "plan-parallel", "serve", "gpus", "calibrate")
MLP = str(ROOT / "examples" / "mlp.py")
TINY_LM = "hf:" + str(ROOT / "tests" / "configs" / "llama-tiny.json")
MODELS = (MLP, MLP, MLP, TINY_LM, "hf:gpt2", "", "nonexistent.py", "ünï.py", "hf:", "hf:no-such-model", "-1",
          str(ROOT / "README.md"))
EDGE = ("0", "-1", "1", "2", "3", "4", "1e9", "99999999999999999999", "0.5", "2.7", "nan", "inf", "-inf", "",
        " ", "abc", "ü", "日本語", "1,2", "0,0", "a,b", "None", "null", "true", "8GB", "1.5", "1TiB", "h100",
        "rtx2080ti", "-5%", "10%", "1000000000", "1,2,4", "x" * 300)
BUDGETS = ("11GB", "1MiB", "1KB", "100TB", "24GiB", "0GB", "-1GB", "h100", "rtx2080ti", "a100", "0", "24",
           "24.0", "0.5", "nan", "11XB", "", "ü")
YAML_EDGE = (0, -1, 1, 2, 4, 10**12, 0.5, 2.7, float("nan"), float("inf"), "", "abc", "ü", True, False, None,
             [1, 2], {"a": 1}, "8GB", "10%", [], {})


def _flag_values(opt, rng: random.Random, tmp):
    """An argument vector for one option: mostly edge values, sometimes a valid one."""
    if opt.kind is bool:
        on, _, off = opt.flags[0].partition("/")
        return [rng.choice([on, on, off or on])]
    if opt.name == "gpu":
        value = rng.choice(BUDGETS + EDGE[:6])
    elif opt.name == "plot":
        value = str(tmp / rng.choice(["step.png", "step.html", "step.svg", "step.txt", "no/dir/step.png", "ü.html"]))
    elif opt.name == "out":
        value = str(tmp / rng.choice(["p.json", "new/p.json", "p"]))
    elif opt.name == "calibration":
        value = str(tmp / rng.choice(["garbage.json", "missing.json", "empty.json"]))
    elif isinstance(opt.kind, type) and issubclass(opt.kind, Choice) and rng.random() < 0.5:
        value = rng.choice([c.value for c in opt.kind])
    else:
        value = rng.choice(EDGE)
    return [opt.flag, value]


def _yaml_config(rng: random.Random, tmp, index: int):
    keys = [o.name for o in options.for_command("check") if o.spec_field]
    doc = {"model": rng.choice(MODELS[:5] + (None, 3, [MLP]))}
    for key in rng.sample(keys, k=rng.randint(0, 3)):
        doc[key] = rng.choice(YAML_EDGE + (rng.choice(EDGE),))
    if rng.random() < 0.7:
        doc["gpu"] = rng.choice(BUDGETS + (0.5, 24, 11.0, None))
    if rng.random() < 0.2:
        doc[rng.choice(["bach", "ü", "serve", "gpus", ""])] = rng.choice(YAML_EDGE)
    if rng.random() < 0.2:
        doc["serve"] = {k: rng.choice(YAML_EDGE) for k in rng.sample(options.serve_names(), k=2)}
        doc["model"] = TINY_LM
    path = tmp / f"c{index}.yaml"
    text = yaml.safe_dump(doc, allow_unicode=True) if rng.random() < 0.9 else rng.choice(["", ":", "[1, 2", "- a"])
    path.write_text(text, encoding="utf-8")
    return path


def generate(rng: random.Random, tmp, index: int) -> list[str]:
    command = rng.choice(COMMANDS)
    argv = [command]
    opts = [o for o in options.for_command(command) if not o.argument and o.name != "debug"]  # --debug: tracebacks by design
    if command == "check":
        argv += [str(_yaml_config(rng, tmp, index)) for _ in range(rng.randint(1, 2))]
    elif command == "serve":
        argv.append(rng.choice((TINY_LM, TINY_LM, MLP, "hf:bert-base-uncased", "")))
    elif any(o.argument for o in options.for_command(command)):
        argv.append(rng.choice(MODELS))
    for opt in rng.sample(opts, k=min(len(opts), rng.randint(0, 3))):
        argv += _flag_values(opt, rng, tmp)
    if command != "calibrate" or rng.random() < 0.5:
        argv += rng.choice([["--json"], ["--json"], [], ["--markdown"], ["--format", "json"]])
    if rng.random() < 0.1:
        argv.insert(rng.randint(1, len(argv)), rng.choice(["--bogus", "-z", "--json=1", "ü"]))
    return argv


def _files(folder) -> set:
    return {p.relative_to(folder) for p in folder.rglob("*")}


def _contract(argv, result, before, after) -> list[str]:
    """What this run broke of the contract (empty: nothing)."""
    broken = []
    if result.exit_code not in (0, 1, 2):
        broken.append(f"exit code {result.exit_code}")
    stderr = result.stderr
    if "Traceback" in stderr:
        broken.append("traceback on stderr")
    if "internal error" in stderr:
        broken.append("internal error: " + [s for s in stderr.splitlines() if "internal error" in s][0][:300])
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        broken.append(f"uncaught {type(result.exception).__name__}: {result.exception}")
    if result.exit_code == 2:
        errors = [line for line in stderr.splitlines() if line.startswith("memest: error: ")]
        others = [line for line in stderr.splitlines() if line.strip() and not line.startswith("memest: ")]
        if len(errors) != 1 or others:
            broken.append(f"exit 2 without exactly one error line: {stderr[-500:]!r}")
        if after - before:
            broken.append(f"exit 2 wrote {sorted(map(str, after - before))}")
    json_asked = "--json" in argv or ("--format" in argv and argv[argv.index("--format") + 1] == "json")
    if json_asked and result.stdout.strip():
        try:
            json.loads(result.stdout)
        except ValueError as exc:
            broken.append(f"--json stdout is not one JSON document ({exc}): {result.stdout[:200]!r}")
    return broken


def test_cli_contract_holds_over_generated_inputs(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    (tmp_path / "garbage.json").write_text("{not json", encoding="utf-8")
    (tmp_path / "empty.json").write_text("", encoding="utf-8")
    rng = random.Random(SEED)
    runner = CliRunner()
    failures = []
    for index in range(CASES):
        argv = generate(rng, tmp_path, index)
        before = _files(tmp_path)
        result = runner.invoke(app, argv)
        after = _files(tmp_path)
        for broken in _contract(argv, result, before, after):
            failures.append(f"memest {' '.join(argv)!s}: {broken}")
        for new in after - before:  # each case starts from the same files
            path = tmp_path / new
            if path.is_file() and path.parent == tmp_path and path.suffix != ".yaml":
                path.unlink()
    assert not failures, f"{len(failures)} of {CASES} cases broke the contract:\n" + "\n".join(failures[:20])


# -- the same inputs through the CLI, a YAML config and the Python API give the same verdict ------------

SAME = [(4, "11GB"), (32, "1MiB"), (0, "11GB"), (-1, "11GB"), (2, "0.5"), (8, "24GiB")]
if CASES > 40:
    SAME += [(random.Random(SEED + i).choice([1, 3, 64, 10**9, 0]),
              random.Random(SEED - i).choice(BUDGETS)) for i in range(CASES // 40)]


def _api_verdict(batch, budget):
    import memest
    from memest.errors import MemestError

    try:
        est = memest.estimate(MLP, batch=batch, target="cpu")
        return str(est.verdict(budget).value)
    except MemestError:
        return "error"


@pytest.mark.parametrize(("batch", "budget"), SAME)
def test_cli_yaml_and_api_give_the_same_verdict(tmp_path, batch, budget):
    runner = CliRunner()
    cli = runner.invoke(app, ["estimate", MLP, "--batch", str(batch), "--target", "cpu", "--gpu", budget,
                              "--fail-if-not-fits", "--json"])
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"model": MLP, "batch": batch, "target": "cpu", "gpu": budget}))
    check = runner.invoke(app, ["check", str(config), "--json"])
    verdicts = []
    for result in (cli, check):
        if result.exit_code == 2:
            verdicts.append("error")
        else:
            doc = json.loads(result.stdout)
            verdicts.append(doc["verdict"] if "verdict" in doc else doc["configs"][0]["verdict"])
    verdicts.append(_api_verdict(batch, budget))
    assert len(set(verdicts)) == 1, (verdicts, cli.stderr, check.stderr)
    assert cli.exit_code == check.exit_code, (cli.stderr, check.stderr)

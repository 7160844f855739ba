"""whatif, max-batch and advise: fits checked against direct traces, exact boundaries, bad input."""

import json

import pytest
from typer.testing import CliRunner

from memest.cli import app
from memest.plan.advise import command_line
from memest.plan.runner import Runner
from memest.plan.search import largest_fitting
from memest.plan.whatif import sweep
from memest.spec import RunSpec

from .conftest import model_ref

runner = CliRunner()
MiB = 2**20


@pytest.mark.parametrize("name", ["transformer", "hf:gpt2-tiny"])
def test_whatif_fit_within_1pct_of_direct_traces_on_every_point(name):
    ref = model_ref(name)
    run = Runner(RunSpec(model=ref, batch=2, seq=64, optim="adamw"))
    result = sweep(run, [1, 2, 4, 8], [32, 64, 96, 128], capacity=2 * 2**30)
    assert not result.fallback
    fitted = [p for p in result.points if not p.traced]
    assert len(fitted) >= 4 and result.traces < len(result.points)  # the fit saved traces (batch 1 is traced)
    for p in result.points:
        direct = run.run(batch=p.batch, seq=p.seq)
        assert abs(p.peak_bytes - direct.report.peak_allocated_bytes) <= 0.01 * direct.report.peak_allocated_bytes
        assert abs(p.needed_bytes - direct.needed_bytes) <= 0.01 * direct.needed_bytes
        assert p.fits == direct.fits(2 * 2**30)


def test_whatif_cli_reports_fit_error_and_largest_sizes():
    result = runner.invoke(app, ["whatif", model_ref("transformer"), "--seq", "32,64,96,128", "--batch", "2,4,8",
                                 "--gpu", "2GiB", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert abs(doc["verification"]["peak_error"]) <= 0.01
    assert doc["largest_batch"] >= 8 and doc["largest_seq"] >= 128
    assert any("1k tokens" in w for w in doc["plain_words"])


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--seq", "512,abc"], "not a whole number"),
        (["--batch", "0,2"], "not a whole number"),
        (["--seq", ",".join(str(i) for i in range(1, 101)), "--batch", ",".join(str(i) for i in range(1, 11))], "too many"),
        ([], "needs sizes"),
        (["--seq", "64,128", "--gpu", "nocard"], "known card"),
    ],
)
def test_whatif_bad_input_exit_2(args, needle):
    result = runner.invoke(app, ["whatif", model_ref("transformer"), *args])
    assert result.exit_code == 2, result.output
    assert needle in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_max_batch_is_exact_at_the_boundary():
    ref = model_ref("mlp")
    run = Runner(RunSpec(model=ref, optim="sgd", target="cpu"))
    capacity = 200 * MiB
    result = largest_fitting(run, "batch", capacity)
    assert result.value > 1 and not result.hit_limit
    assert run.run(batch=result.value).fits(capacity)
    assert not run.run(batch=result.value + 1).fits(capacity)


def test_max_batch_cli_and_nothing_fits():
    # 2 GiB: the process overhead alone (CUDA context + cuBLAS, device/overheads.py) is about 0.75 GiB on sm90
    ok = runner.invoke(app, ["max-batch", model_ref("mlp"), "--gpu", "2GiB", "--json"])
    assert ok.exit_code == 0, ok.output
    doc = json.loads(ok.stdout)
    # "needed" is the smallest budget the step runs in (fits <=> needed <= capacity)
    assert doc["value"] >= 1 and doc["needed_bytes"] <= 2 * 2**30 < doc["next_needed_bytes"]
    none = runner.invoke(app, ["max-batch", model_ref("mlp"), "--gpu", "10MiB"])
    assert none.exit_code == 0 and "even batch 1 does not fit" in none.stdout


def test_advise_finds_a_fitting_combination_and_its_command_reproduces_it():
    ref = model_ref("transformer")
    result = runner.invoke(app, ["advise", ref, "--batch", "32", "--seq", "256", "--gpu", "1500MiB", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert not doc["base_fits"]
    combo = doc["combination"]
    assert combo["fits"]
    # the printed command line, run, gives the same estimate
    args = doc["command"].split()[1:]
    again = json.loads(runner.invoke(app, [*args, "--json", "--gpu", "1500MiB"]).stdout)
    assert again["gpus"]["compared_bytes"] == combo["needed_bytes"]
    fits_first = [r["fits"] for r in doc["remedies"]]
    assert fits_first == sorted(fits_first, reverse=True)


def test_command_line_round_trip():
    spec = RunSpec(model="hf:gpt2", batch=4, seq=1024, optim="adamw", precision="bf16-mixed", grad_accum=8,
                   checkpointing="blocks")
    assert command_line(spec) == ("memest estimate hf:gpt2 --batch 4 --seq 1024 --optim adamw --precision bf16-mixed "
                                  "--grad-accum 8 --checkpointing blocks")

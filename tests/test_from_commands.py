"""issue 25: ``--from FILE`` on the planners (whatif, max-batch, advise, plan-parallel) with estimate's semantics:
the file's run, flags beside it over it, MODEL beside it replacing the file's, the mapping in the output (JSON
``from``) and unknown keys warned on stderr. whatif is traced both ways and the documents compared; max-batch,
advise and plan-parallel (each traces many steps: minutes on this 2-core machine) are compared at the app layer's
door: the RunSpec each run_* receives (with its own options), which is all it reads of the command line."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch  # noqa: F401  (imported before the CLI forks its worker: the child need not import it each time)
from typer.testing import CliRunner

ROOT = Path(__file__).resolve().parents[1]
TINY = "hf:tests/configs/llama-tiny.json"
LF = "tests/configs/trainers/llamafactory-lora.yaml"  # batch 1, seq 64, accum 8, bf16, blocks, adamw, LoRA r=8
LF_FLAGS = [TINY, "--grad-accum", "8", "--precision", "bf16", "--checkpointing", "blocks", "--optim", "adamw",
            "--lora", "r=8,targets=all-linear"]


def invoke(args: list[str]):
    from memest.cli import app

    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        return CliRunner().invoke(app, args)
    finally:
        os.chdir(cwd)


def document(args: list[str]) -> dict:
    result = invoke([*args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def same_document(from_args: list[str], flag_args: list[str]) -> dict:
    got, want = document(from_args), document(flag_args)
    assert "from" not in want and got["from"]["format"] == "llamafactory"
    assert {k: v for k, v in got.items() if k != "from"} == want
    return got


def test_whatif_from_matches_the_flags():
    doc = same_document(["whatif", "--from", LF, "--seq", "32", "--gpu", "h100"],
                        ["whatif", *LF_FLAGS, "--batch", "1", "--seq", "32", "--gpu", "h100"])
    assert any(m["source"] == "cutoff_len = 64" for m in doc["from"]["mapping"])


@pytest.fixture
def captured(monkeypatch):
    """The RunSpec (and the command's own options) that the app layer's run_* receives, sent back as the JSON
    document in place of the run (the work runs in a forked worker: what it returns is what crosses back)."""
    import memest.cli as cli
    from memest.report.emit import View
    from memest.spec.run import RunSpec

    def fake(spec_args, *args, **kwargs):
        return {"spec": RunSpec(**spec_args).to_dict(), "args": [str(a) for a in args],
                "kwargs": {k: str(v) for k, v in kwargs.items() if k != "progress"}}

    for name in ("whatif", "max_batch", "advise", "plan_parallel"):
        monkeypatch.setattr(cli, f"run_{name}", fake)
        monkeypatch.setattr(cli, f"{name}_view", lambda run: View({"run": run}))


def test_whatif_takes_the_files_batch_as_the_fixed_size(captured):
    """The file's batch (2) is the fixed size when only --seq is swept (run_whatif's base batch); --batch beside
    it is the grid."""
    got = document(["whatif", "--from", "tests/configs/trainers/axolotl-qlora.yml", "--seq", "32,64", "--gpu", "h100"])
    assert got["run"]["spec"]["batch"] == 2 and got["run"]["args"][:2] == ["None", "[32, 64]"]
    grid = document(["whatif", "--from", "tests/configs/trainers/axolotl-qlora.yml", "--batch", "1,4", "--gpu", "h100"])
    assert grid["run"]["args"][:2] == ["[1, 4]", "None"] and grid["run"]["spec"]["seq"] == 64


def test_max_batch_from_hands_the_app_layer_the_flags_run(captured):
    got = same_document(["max-batch", "--from", LF, "--seq", "32", "--gpu", "1GB", "--limit", "2"],
                        ["max-batch", *LF_FLAGS, "--seq", "32", "--gpu", "1GB", "--limit", "2"])
    assert got["run"]["spec"]["seq"] == 32 and got["run"]["spec"]["grad_accum"] == 8


def test_advise_from_hands_the_app_layer_the_flags_run(captured):
    got = same_document(["advise", "--from", LF, "--gpu", "1GB"], ["advise", *LF_FLAGS, "--seq", "64", "--gpu", "1GB"])
    assert got["run"]["spec"]["lora"] is not None and got["run"]["spec"]["seq"] == 64


def test_a_flag_and_model_beside_from_override_the_file(captured):
    wide = "hf:tests/configs/llama-tiny-wide.json"
    flags = [wide, *LF_FLAGS[1:]]
    flags[flags.index("--checkpointing") + 1] = "none"
    same_document(["advise", wide, "--from", LF, "--checkpointing", "none", "--gpu", "1GB"],
                  ["advise", *flags, "--seq", "64", "--gpu", "1GB"])


def test_plan_parallel_drops_the_files_layout_with_a_note(captured):
    ds = "tests/configs/trainers/ds_z3_offload.json"  # ZeRO-3 over 2 ranks: plan-parallel searches the layout
    got = document(["plan-parallel", TINY, "--from", ds, "--seq", "32", "--gpu", "1GB"])
    want = document(["plan-parallel", TINY, "--seq", "32", "--batch", "2", "--grad-accum", "4", "--optim", "adamw",
                     "--precision", "bf16-mixed", "--offload", "optimizer", "--gpu", "1GB"])
    assert {k: v for k, v in got.items() if k != "from"} == want
    assert any("shard: zero3" in n and "world_size: 2" in n and "not used" in n for n in got["from"]["notes"])


def test_plan_parallel_from_matches_the_flags(captured):
    same_document(["plan-parallel", "--from", LF, "--gpus", "4", "--gpu", "1GB"],
                  ["plan-parallel", *LF_FLAGS, "--seq", "64", "--gpus", "4", "--gpu", "1GB"])


def test_unknown_keys_are_warned_and_the_mapping_shown_in_the_table(tmp_path, captured):
    config = tmp_path / "lf.yaml"
    config.write_text((ROOT / LF).read_text().replace("../llama-tiny.json", str(ROOT / "tests/configs/llama-tiny.json"))
                      + "flash_attn: fa2\n")
    result = invoke(["advise", "--from", str(config), "--gpu", "1GB"])
    assert result.exit_code == 0, result.output
    assert "1 key(s) not understood" in result.stderr and "flash_attn" in result.stderr
    assert f"from {config} (llamafactory):" in result.stdout and "not understood (1): flash_attn" in result.stdout


@pytest.mark.parametrize("command", ["whatif", "max-batch", "advise", "plan-parallel"])
def test_no_model_and_no_from_is_a_one_line_error(command):
    result = invoke([command, "--gpu", "1GB", "--seq", "32"])
    assert result.exit_code == 2
    assert f"{command} needs a MODEL" in result.stderr and "--from FILE" in result.stderr

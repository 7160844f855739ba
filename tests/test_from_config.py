"""issue 25 part A: ``memest estimate --from FILE`` reads axolotl YAML, LLaMA-Factory YAML and DeepSpeed JSON.
Each realistic config (tests/configs/trainers/, modelled on the library's own example named in its first line)
gives the same estimate as the hand-written flags, lists the keys it did not understand, and flags beside it
override it; a file no reader claims exits 2 naming the formats."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from memest.errors import MemestError
from memest.spec.config import config_from_dict
from memest.spec.trainers import READERS
from memest.spec.trainers.load import read_trainer_config

ROOT = Path(__file__).resolve().parents[1]
TRAINERS = ROOT / "tests" / "configs" / "trainers"
TINY = "hf:tests/configs/llama-tiny.json"


def run(args: list[str]):
    from memest.cli import app

    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        return CliRunner().invoke(app, ["estimate", *args, "--gpu", "h100", "--json"])
    finally:
        os.chdir(cwd)


def document(args: list[str]) -> dict:
    result = run(args)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def same_estimate(from_args: list[str], flag_args: list[str]) -> dict:
    """The --from run's document, after checking its figures equal the hand-written flags' run."""
    got, want = document(from_args), document(flag_args)
    for key in ("peak_allocated_bytes", "needed_bytes", "needed_bytes_low", "needed_bytes_high", "breakdown_at_peak",
                "param_count", "trainable_param_count"):
        assert got[key] == want[key], key
    assert got["spec"] == want["spec"]
    assert "from" not in want
    return got


AXOLOTL_FLAGS = [TINY, "--batch", "2", "--seq", "64", "--grad-accum", "4", "--optim", "paged-adamw-32bit",
                 "--precision", "bf16", "--checkpointing", "blocks", "--lora",
                 "r=32,alpha=16,dropout=0.05,targets=all-linear", "--quant", "nf4", "--prepare-kbit"]


def test_axolotl_qlora_matches_the_flags_and_lists_unknown_keys():
    doc = same_estimate(["--from", "tests/configs/trainers/axolotl-qlora.yml"], AXOLOTL_FLAGS)
    assert doc["from"]["format"] == "axolotl"
    assert doc["from"]["unknown"] == ["flash_attention", "loss_watchdog_threshold", "loss_watchdog_patience"]
    sources = [m["source"] for m in doc["from"]["mapping"]]
    assert "micro_batch_size = 2" in sources and "load_in_4bit = True" in sources
    assert any("prepare_model_for_kbit_training" in n for n in doc["from"]["notes"])


def test_a_flag_beside_from_overrides_the_file():
    override = ["--batch", "1", "--checkpointing", "none"]
    flags = list(AXOLOTL_FLAGS)
    flags[flags.index("--batch") + 1] = "1"
    flags[flags.index("--checkpointing") + 1] = "none"
    doc = same_estimate(["--from", "tests/configs/trainers/axolotl-qlora.yml", *override], flags)
    assert doc["spec"]["batch"] == 1 and doc["spec"]["checkpointing"] == "none"


def test_llamafactory_lora_matches_the_flags():
    doc = same_estimate(["--from", "tests/configs/trainers/llamafactory-lora.yaml"],
                        [TINY, "--batch", "1", "--seq", "64", "--grad-accum", "8", "--precision", "bf16",
                         "--checkpointing", "blocks", "--optim", "adamw", "--lora", "r=8,targets=all-linear"])
    assert doc["from"]["format"] == "llamafactory"
    assert doc["from"]["unknown"] == []
    assert any("cast_trainable_params_to_fp32" in n for n in doc["from"]["notes"])


def test_deepspeed_json_matches_the_flags():
    doc = same_estimate([TINY, "--seq", "32", "--from", "tests/configs/trainers/ds_z3_offload.json"],
                        [TINY, "--seq", "32", "--batch", "2", "--grad-accum", "4", "--optim", "adamw", "--precision",
                         "bf16-mixed", "--shard", "zero3", "--offload", "optimizer", "--world-size", "2"])
    assert doc["from"]["format"] == "deepspeed"
    assert doc["from"]["unknown"] == ["gradient_clipping", "zero_optimization.overlap_comm", "zero_optimization.contiguous_gradients",
                                      "zero_optimization.stage3_gather_16bit_weights_on_model_save"]


def test_unknown_keys_are_warned_on_stderr_and_shown_in_the_table():
    from memest.cli import app

    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        result = CliRunner().invoke(app, ["estimate", "--from", "tests/configs/trainers/axolotl-qlora.yml",
                                          "--target", "cpu", "--seq", "16"])
    finally:
        os.chdir(cwd)
    assert result.exit_code == 0, result.output
    assert "3 key(s) not understood" in result.stderr and "flash_attention" in result.stderr
    assert "micro_batch_size = 2 -> batch: 2" in result.stdout
    assert "not understood (3): flash_attention" in result.stdout


def test_an_unknown_format_exits_2_naming_the_formats(tmp_path):
    odd = tmp_path / "run.json"
    odd.write_text('{"epochs": 3}')
    result = run(["--from", str(odd)])
    assert result.exit_code == 2
    for reader in READERS:
        assert reader.FORMAT in result.stderr
    result = run([])
    assert result.exit_code == 2 and "--from FILE" in result.stderr


def test_an_include_is_read_relative_to_the_including_file():
    config = read_trainer_config(TRAINERS / "axolotl-deepspeed.yml")
    assert config.includes == [TRAINERS / "ds_z3_offload.json"]
    # the DeepSpeed file's layout, the axolotl file's own micro-batch and accumulation
    assert config.keys["shard"] == "zero3" and config.keys["offload"] == "optimizer"
    assert config.keys["batch"] == 1 and config.keys["grad_accum"] == 2 and config.keys["fused"] is True
    assert "ds_z3_offload.json: zero_optimization.overlap_comm" in config.unknown
    assert "ds_z3_offload.json: gradient_clipping" in config.unknown


def test_a_check_config_takes_from_relative_to_itself(tmp_path):
    config = config_from_dict({"from": "trainers/axolotl-qlora.yml", "batch": 1, "gpu": "24GB"},
                              ROOT / "tests" / "configs" / "run.yaml")
    assert config.values["batch"] == 1  # the memest config's own key wins
    assert config.values["quant"] == "nf4" and config.values["seq"] == 64
    assert config.trainer.format == "axolotl"


def test_an_unsupported_optimizer_or_hub_model_is_refused_with_the_fix(tmp_path):
    bad = tmp_path / "axolotl.yml"
    bad.write_text(f"base_model: {ROOT / 'tests/configs/llama-tiny.json'}\nmicro_batch_size: 1\n"
                   "optimizer: lion_8bit\n")
    with pytest.raises(MemestError, match="lion_8bit"):
        read_trainer_config(bad)
    hub = tmp_path / "hub.yml"
    hub.write_text("base_model: meta-llama/Meta-Llama-3-8B\nmicro_batch_size: 1\n")
    with pytest.raises(MemestError, match="no network"):
        read_trainer_config(hub)


def test_the_deepspeed_mapping_agrees_with_deepspeeds_own_parser(monkeypatch):
    """DeepSpeed's DeepSpeedConfig reads the same file: the stage, offload, bf16, micro-batch and accumulation
    memest took, and its batch assertion (train_batch_size = micro x accum x ranks) holds at the world size
    memest derived. Skipped where deepspeed is not installed (it is not a memest dependency)."""
    pytest.importorskip("deepspeed")
    import deepspeed.runtime.config as ds_config

    path = TRAINERS / "ds_z3_offload.json"
    ours = read_trainer_config(path).keys

    class DataParallel:  # DeepSpeed reads the data-parallel world size from the model-parallel unit
        def get_data_parallel_world_size(self):
            return ours["world_size"]

    monkeypatch.setattr(ds_config.dist, "get_rank", lambda: 0)  # no process group in a test
    theirs = ds_config.DeepSpeedConfig(json.loads(path.read_text()), mpu=DataParallel())
    assert {0: "none", 1: "zero1", 2: "zero2", 3: "zero3"}[theirs.zero_optimization_stage] == ours["shard"]
    device = theirs.zero_config.offload_optimizer.device
    assert getattr(device, "value", device) == "cpu" and ours["offload"] == "optimizer"
    assert theirs.zero_config.offload_param is None
    assert theirs.bfloat16_config.enabled and ours["precision"] == "bf16-mixed"
    assert theirs.train_micro_batch_size_per_gpu == ours["batch"]
    assert theirs.gradient_accumulation_steps == ours["grad_accum"]
    assert theirs.world_size == ours["world_size"]
    assert theirs.optimizer_name == ours["optim"]


def test_check_reports_the_from_mapping_and_warns_of_unknown_keys(tmp_path):
    from memest.cli import app

    config = tmp_path / "run.yaml"
    config.write_text(f"from: {TRAINERS / 'axolotl-qlora.yml'}\nseq: 16\ngpu: 24GB\n")
    result = CliRunner().invoke(app, ["check", str(config), "--json"])
    assert result.exit_code == 0, result.output
    row = json.loads(result.stdout)["configs"][0]
    assert row["from"]["format"] == "axolotl" and row["seq"] == 16  # the config's own seq over the file's 64
    assert row["from"]["unknown"] == ["flash_attention", "loss_watchdog_threshold", "loss_watchdog_patience"]
    assert "3 key(s) not understood" in result.stderr
    table = CliRunner().invoke(app, ["check", str(config)])
    assert "micro_batch_size = 2 -> batch: 2" in table.stdout

"""issue 25: ``--from train.py``, a Python script that builds TrainingArguments or a trl config, read with ``ast``
(never run). A realistic trl SFT script gives the same run as the JSON dump of the same arguments built by trl
itself; non-literal arguments are listed with their line; several calls, or several models, are errors that say
what to do."""

from __future__ import annotations

import dataclasses
import json
import textwrap
from pathlib import Path

import pytest

from memest.errors import MemestError
from memest.spec.config import spec_from_trainer
from memest.spec.trainers import training_script
from memest.spec.trainers.load import read_trainer_config

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "tests" / "configs" / "llama-tiny.json"

# in the style of trl's docs (docs/source/sft_trainer.md's quick start, examples/scripts/sft.py): SFTConfig built
# in the script, the model loaded by name, a dataset from the hub; the script's own defaults left to trl
SFT_SCRIPT = '''
import torch
from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import SFTConfig, SFTTrainer

model_id = "{model}"
MAX_LEN = 64

dataset = load_dataset("trl-lib/Capybara", split="train")
tokenizer = AutoTokenizer.from_pretrained("Qwen/Qwen2.5-0.5B")
model = AutoModelForCausalLM.from_pretrained(model_id)

training_args = SFTConfig(
    output_dir="Qwen2.5-0.5B-SFT",
    per_device_train_batch_size=2,
    gradient_accumulation_steps=8,
    max_length=MAX_LEN,
    packing=True,
    learning_rate=2.0e-5,
    optim="adamw_torch_fused",
    logging_steps=25,
    report_to="none",
    seed=torch.initial_seed(),
)
trainer = SFTTrainer(model=model, args=training_args, train_dataset=dataset, processing_class=tokenizer)
trainer.train()
'''
SFT_KWARGS = dict(output_dir="Qwen2.5-0.5B-SFT", per_device_train_batch_size=2, gradient_accumulation_steps=8,
                  max_length=64, packing=True, learning_rate=2.0e-5, optim="adamw_torch_fused", logging_steps=25,
                  report_to="none")


def _script(tmp_path: Path, text: str = SFT_SCRIPT, name: str = "train.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text).replace("{model}", str(TINY)))
    return path


def _sft_dump(tmp_path: Path, monkeypatch) -> Path:
    """trl's own SFTConfig with the script's literal arguments, dumped as Trainer saves it. trl's bf16 default
    (True unless fp16) needs a bf16 GPU to construct (transformers checks the device): the check answers as a
    GPU machine's does."""
    trl = pytest.importorskip("trl")
    import transformers.training_args as ta

    monkeypatch.setattr(ta, "is_torch_bf16_gpu_available", lambda *a, **k: True)
    args = trl.SFTConfig(**{**SFT_KWARGS, "output_dir": str(tmp_path / "out")})
    path = tmp_path / "sft_args.json"
    path.write_text(args.to_json_string())
    return path


def test_an_sft_script_reads_as_the_json_dump_of_its_arguments(tmp_path, monkeypatch):
    script = read_trainer_config(_script(tmp_path))
    dump = read_trainer_config(_sft_dump(tmp_path, monkeypatch))
    assert script.format == "training-script" and dump.format == "training-args"
    assert {k: v for k, v in script.keys.items() if k != "model"} == dump.keys
    assert script.keys["model"] == f"hf:{TINY.relative_to(Path.cwd())}" if TINY.is_relative_to(Path.cwd()) else True
    assert script.keys["checkpointing"] == "blocks" and script.keys["precision"] == "bf16-mixed"  # trl's defaults
    assert script.unknown == ["seed = torch.initial_seed() (line 24: not a literal)"]


def test_the_cli_estimate_from_the_script_equals_the_dumps(tmp_path, monkeypatch):
    import os

    from typer.testing import CliRunner

    from memest.cli import app

    script, dump = _script(tmp_path), _sft_dump(tmp_path, monkeypatch)
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        got = CliRunner().invoke(app, ["estimate", "--from", str(script), "--gpu", "h100", "--json"])
        want = CliRunner().invoke(app, ["estimate", f"hf:{TINY}", "--from", str(dump), "--gpu", "h100", "--json"])
    finally:
        os.chdir(cwd)
    assert got.exit_code == 0 and want.exit_code == 0, got.output + want.output
    got, want = json.loads(got.stdout), json.loads(want.stdout)
    for key in ("peak_allocated_bytes", "needed_bytes", "needed_bytes_low", "needed_bytes_high", "param_count"):
        assert got[key] == want[key], key
    assert {k: v for k, v in got["spec"].items() if k != "model"} == \
        {k: v for k, v in want["spec"].items() if k != "model"}
    assert got["from"]["format"] == "training-script" and got["from"]["unknown"][0].startswith("seed = ")


def test_trl_defaults_are_the_installed_trls():
    trl = pytest.importorskip("trl")
    transformers = pytest.importorskip("transformers")
    base = {f.name: f.default for f in dataclasses.fields(transformers.TrainingArguments)}
    for name in ("SFTConfig", "DPOConfig", "KTOConfig", "RewardConfig", "GRPOConfig", "RLOOConfig"):
        fields = {f.name: f.default for f in dataclasses.fields(getattr(trl, name))}
        for key, value in training_script.TRL_DEFAULTS.items():
            assert fields[key] == value != base[key], (name, key)
        assert fields["bf16"] is None  # _BaseConfig.__post_init__: not fp16
        if name in training_script.TRL_MAX_LENGTH:
            assert fields["max_length"] == training_script.TRL_MAX_LENGTH[name], name
        else:
            assert "max_length" not in fields, name


def test_transformers_training_arguments_by_attribute_and_a_followed_name(tmp_path):
    path = _script(tmp_path, '''
        import transformers
        BATCH = 4
        args = transformers.TrainingArguments(output_dir="out", per_device_train_batch_size=BATCH, bf16=True,
                                              gradient_checkpointing=True, optim="adamw_torch")
        model = transformers.AutoModelForCausalLM.from_pretrained(pretrained_model_name_or_path="{model}")
    ''')
    cfg = read_trainer_config(path)
    assert cfg.keys["batch"] == 4 and cfg.keys["checkpointing"] == "blocks" and cfg.keys["optim"] == "adamw"
    assert "seq" not in cfg.keys and cfg.unknown == []  # TrainingArguments' own defaults: no trl ones
    assert not any("own defaults" in n for n in cfg.notes)


def test_a_rebound_name_is_not_followed_and_a_splat_is_listed(tmp_path):
    path = _script(tmp_path, '''
        from trl import SFTConfig
        batch = 2
        batch = 4
        extra = dict(report_to="none")
        args = SFTConfig(per_device_train_batch_size=batch, max_length=128, **extra)
        model_name = "{model}"
    ''')
    cfg = read_trainer_config(path)
    assert cfg.unknown == ["per_device_train_batch_size = batch (line 6: not a literal)", "**extra (line 6: not read)"]
    assert cfg.keys["batch"] == 8  # TrainingArguments' default, with a note to give --batch
    assert any("give its memest flag" in n for n in cfg.notes)


def test_several_argument_calls_are_an_error_naming_the_lines(tmp_path):
    path = _script(tmp_path, '''
        from transformers import TrainingArguments
        from trl import DPOConfig
        a = TrainingArguments(output_dir="a")
        b = DPOConfig(output_dir="b")
    ''')
    with pytest.raises(MemestError, match="TrainingArguments at line 4, DPOConfig at line 5"):
        read_trainer_config(path)


def test_no_call_is_an_error_naming_the_fix(tmp_path):
    path = _script(tmp_path, '''
        from transformers import HfArgumentParser
        from trl import ModelConfig, SFTConfig
        parser = HfArgumentParser((SFTConfig, ModelConfig))
    ''')
    with pytest.raises(MemestError, match="to_json_string"):
        read_trainer_config(path)


def test_a_lora_or_bnb_config_is_not_taken_for_training_arguments(tmp_path):
    path = _script(tmp_path, '''
        from peft import LoraConfig
        from transformers import BitsAndBytesConfig, TrainingArguments
        q = BitsAndBytesConfig(load_in_4bit=True)
        lora = LoraConfig(r=8)
        args = TrainingArguments(output_dir="o", per_device_train_batch_size=1)
    ''')
    assert read_trainer_config(path).keys["batch"] == 1


def test_several_models_need_model_on_the_command_line(tmp_path):
    path = _script(tmp_path, '''
        from transformers import AutoModelForCausalLM, TrainingArguments
        policy = AutoModelForCausalLM.from_pretrained("{model}")
        ref = AutoModelForCausalLM.from_pretrained("other/model")
        args = TrainingArguments(output_dir="o", per_device_train_batch_size=1)
    ''')
    flags = {"model": None, "batch": 1, "seq": None}
    with pytest.raises(MemestError, match="several models .*'other/model'.* pass the one to estimate as MODEL"):
        spec_from_trainer(path, flags, set())
    _, spec = spec_from_trainer(path, {**flags, "model": f"hf:{TINY}"}, {"model"})
    assert spec["model"] == f"hf:{TINY}" and spec["batch"] == 1


def test_a_hub_model_name_needs_model_beside_the_script(tmp_path):
    path = _script(tmp_path, '''
        from trl import SFTConfig, SFTTrainer
        trainer = SFTTrainer(model="Qwen/Qwen2.5-0.5B", args=SFTConfig(output_dir="o", max_length=32))
    ''')
    with pytest.raises(MemestError, match="memest reads no network"):
        spec_from_trainer(path, {"model": None}, set())
    _, spec = spec_from_trainer(path, {"model": f"hf:{TINY}", "seq": None}, {"model"})
    assert spec["seq"] == 32


def test_a_dpo_config_takes_trls_defaults_and_says_the_step_is_not_dpo(tmp_path):
    path = _script(tmp_path, '''
        from trl import DPOConfig
        args = DPOConfig(output_dir="o", per_device_train_batch_size=1, beta=0.1)
        model_name = "{model}"
    ''')
    cfg = read_trainer_config(path)
    assert cfg.keys["seq"] == 1024 and cfg.keys["checkpointing"] == "blocks"  # DPOConfig's max_length, trl's default
    assert cfg.unknown == ["beta = 0.1"] and any("--preference dpo" in n for n in cfg.notes)

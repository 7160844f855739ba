"""issue 25: the Transformers MemestCallback reads what the live run holds beyond batch and optimizer: a peft-wrapped
model (real ``get_peft_model`` on the CPU: its base config and LoraConfig), a bitsandbytes 4-bit base (a real
``from_pretrained(quantization_config=BitsAndBytesConfig(...))`` on the CPU), and the arguments' DeepSpeed, FSDP
and world size. Each is estimated as ``memest estimate`` estimates the equivalent flags."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from memest.integrations.hf_model import layout_settings

LLAMA = Path(__file__).parent / "configs" / "llama-tiny.json"
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


def _model():
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**json.loads(LLAMA.read_text()))
    return transformers.AutoModelForCausalLM.from_config(config)


def _args(tmp_path, **kw):
    return transformers.TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2,
                                          report_to=[], use_cpu=True, optim="adamw_torch", **kw)


def _begin(model, args):
    """The callback at train start, as Trainer calls it (on_train_begin with the trainer's model)."""
    from memest.integrations.transformers import MemestCallback

    cb = MemestCallback(gpu="a100", seq=32)
    cb.on_train_begin(args, transformers.TrainerState(), transformers.TrainerControl(), model=model)
    return cb.result


def _cli(flags: list[str]) -> dict:
    from typer.testing import CliRunner

    from memest.cli import app

    result = CliRunner().invoke(app, ["estimate", f"hf:{LLAMA}", "--batch", "2", "--seq", "32", "--optim", "adamw",
                                      *flags, "--gpu", "a100", "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def _same(result, flags: list[str]) -> None:
    doc = _cli(flags)
    assert result.estimate.peak_allocated_bytes == doc["peak_allocated_bytes"]
    assert result.needed_bytes == doc["needed_bytes"]
    assert result.estimate.to_dict()["trainable_param_count"] == doc["trainable_param_count"]


def test_a_peft_lora_model_is_estimated_as_its_flags(tmp_path):
    model = peft.get_peft_model(_model(), peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.05,
                                                          target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    result = _begin(model, _args(tmp_path))
    assert result.settings["lora"] == {"r": 8, "alpha": 16, "dropout": 0.05, "targets": ["q_proj", "v_proj"]}
    assert "quant" not in result.settings
    _same(result, ["--lora", "r=8,alpha=16,dropout=0.05,targets=q_proj,v_proj"])


def test_a_bitsandbytes_4bit_base_with_all_linear_lora(tmp_path):
    pytest.importorskip("bitsandbytes")
    _model().save_pretrained(tmp_path / "tiny")
    bnb = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                          bnb_4bit_compute_dtype=torch.bfloat16)
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "tiny", quantization_config=bnb,
                                                             dtype=torch.bfloat16, device_map="cpu")
    assert base.is_loaded_in_4bit  # a real bitsandbytes Linear4bit base, on the CPU
    model = peft.get_peft_model(base, peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear",
                                                      task_type="CAUSAL_LM"))
    result = _begin(model, _args(tmp_path))
    assert result.settings["quant"] == "nf4" and result.settings["double_quant"] is False
    assert result.settings["precision"] == "bf16"
    assert result.settings["lora"]["targets"] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj",
                                                  "v_proj"]  # peft's all-linear, resolved: every linear but the head
    _same(result, ["--quant", "nf4", "--no-double-quant", "--precision", "bf16", "--lora",
                   "r=8,alpha=16,targets=all-linear"])


class _World:
    """TrainingArguments as one of ``world`` ranks sees them (args.world_size reads the live process group)."""

    def __init__(self, args, world: int):
        self._args, self.world_size = args, world

    def __getattr__(self, name):
        return getattr(self._args, name)


def test_deepspeed_dict_and_world_size(tmp_path):
    ds = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}, "bf16": {"enabled": "auto"},
          "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"}
    args = _World(_args(tmp_path, deepspeed=ds), 2)
    assert layout_settings(args) == {"shard": "zero3", "offload": "optimizer", "world_size": 2}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    assert layout_settings(_World(_args(tmp_path, deepspeed=str(path)), 2)) == layout_settings(args)
    _same(_begin(_model(), args), ["--shard", "zero3", "--offload", "optimizer", "--world-size", "2"])


@pytest.mark.parametrize(("fsdp", "config", "expected"), [
    ("full_shard offload", None, {"shard": "zero3", "offload": "params"}),
    ("shard_grad_op", None, {"shard": "zero2"}),
    (True, {"reshard_after_forward": False, "activation_checkpointing": True}, {"shard": "zero2",
                                                                                 "checkpointing": "blocks"}),
])
def test_fsdp_options(tmp_path, fsdp, config, expected):
    args = _args(tmp_path, fsdp=fsdp, fsdp_config=config)
    assert layout_settings(_World(args, 4)) == {**expected, "world_size": 4}


def test_a_transformers_5_fsdp_dump_reads_through_from(tmp_path):
    """transformers 5 turns `fsdp="full_shard offload"` into fsdp=True and fsdp_config keys (reshard_after_forward,
    cpu_offload): its JSON dump reads as the same layout."""
    from memest.spec.trainers import training_args

    data = json.loads(_args(tmp_path, fsdp="full_shard offload").to_json_string())
    assert data["fsdp"] is True
    cfg = training_args.read(tmp_path / "args.json", data)
    assert cfg.keys["shard"] == "zero3" and cfg.keys["offload"] == "params" and cfg.unknown == []


def test_an_unmodelled_adapter_is_refused(tmp_path):
    from memest.errors import MemestError

    model = peft.get_peft_model(_model(), peft.LoraConfig(r=4, target_modules=["q_proj"], use_dora=True))
    with pytest.raises(MemestError, match="use_dora=True is not modelled"):
        _begin(model, _args(tmp_path))

"""issue 25: the Transformers MemestCallback tells when peft's ``prepare_model_for_kbit_training`` (trl's SFTTrainer,
axolotl and LLaMA-Factory call it on a 4/8-bit base) has run, from what it leaves on the live model (peft 0.21.2,
peft/utils/other.py): the non-quantized weights cast to fp32, gradient checkpointing on with torch's reentrant
default, the input embeddings' require-grads hook. Checked on a real bitsandbytes 4-bit base (it loads and runs on
the CPU) prepared by peft's own function, each result estimated as ``memest estimate`` estimates the equivalent
flags (``--prepare-kbit`` itself is checked against real runs in tests/test_finetune.py and test_quant_int8.py)."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from memest.integrations.hf_model import checkpointing_settings, kbit_prepared_dtype

from .test_integrations_peft import LLAMA, _args, _begin, _same

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
QV = "r=8,alpha=16,targets=q_proj,v_proj"


def _plain():
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**json.loads(LLAMA.read_text()))
    return transformers.AutoModelForCausalLM.from_config(config)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("kbit") / "tiny"
    _plain().save_pretrained(path)
    return path


def _base(saved, dtype=torch.bfloat16):
    pytest.importorskip("bitsandbytes")
    bnb = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype)
    base = transformers.AutoModelForCausalLM.from_pretrained(saved, quantization_config=bnb, dtype=dtype,
                                                             device_map="cpu")
    assert base.is_loaded_in_4bit
    return base


def _lora(base):
    return peft.get_peft_model(base, peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                                     task_type="CAUSAL_LM"))


def _prepared(saved, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's "pass use_reentrant explicitly", transformers' deprecations
        return _lora(peft.prepare_model_for_kbit_training(_base(saved), **kw))


def test_peft_prepared_4bit_base_without_autocast(tmp_path, saved):
    """peft's defaults: fp32 non-quantized weights over a bf16 load, reentrant checkpointing (peft passes no
    use_reentrant; torch 2.13's default is True). Without the fix the callback read precision fp32 (the model's
    first parameter, the fp32 embedding) and no checkpointing."""
    result = _begin(_prepared(saved), _args(tmp_path))
    assert {k: result.settings[k] for k in ("precision", "prepare_kbit", "checkpointing", "quant")} == {
        "precision": "bf16", "prepare_kbit": True, "checkpointing": "blocks-reentrant", "quant": "nf4"}
    _same(result, ["--quant", "nf4", "--no-double-quant", "--precision", "bf16", "--prepare-kbit",
                   "--checkpointing", "blocks-reentrant", "--lora", QV])


def test_peft_prepared_4bit_base_under_bf16_autocast(tmp_path, saved):
    """TrainingArguments(bf16=True) over the prepared base: bf16-mixed (fp32 weights, bf16 autocast), as
    docs/finetuning.md says to estimate trl's QLoRA run; no checkpointing when prepare was told not to."""
    result = _begin(_prepared(saved, use_gradient_checkpointing=False), _args(tmp_path, bf16=True))
    assert result.settings["precision"] == "bf16-mixed" and result.settings["prepare_kbit"] is True
    assert "checkpointing" not in result.settings
    _same(result, ["--quant", "nf4", "--no-double-quant", "--precision", "bf16-mixed", "--prepare-kbit",
                   "--lora", QV])


def test_an_unprepared_4bit_base_is_not_taken_for_a_prepared_one(saved):
    base = _base(saved)
    assert kbit_prepared_dtype(base) is None and checkpointing_settings(base) == {}
    assert kbit_prepared_dtype(_plain()) is None  # not quantized: prepare's cast is not memest's --prepare-kbit
    fp32 = _base(saved, torch.float32)  # loaded in fp32: prepare casts nothing, no difference to tell
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert kbit_prepared_dtype(peft.prepare_model_for_kbit_training(fp32)) is None


def test_the_trainers_own_checkpointing_is_non_reentrant():
    """The Trainer's switch (gradient_checkpointing=True) passes use_reentrant=False; a user's choice is read back."""
    model = _plain()
    model.gradient_checkpointing_enable()
    assert checkpointing_settings(model) == {"checkpointing": "blocks"}
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    assert checkpointing_settings(model) == {"checkpointing": "blocks-reentrant"}


def test_what_memest_cannot_model_is_warned_about():
    model = _plain()
    model.gradient_checkpointing_enable()
    model.model.layers[1].gradient_checkpointing = False  # every other layer (transformers' every_n_layers=2)
    with pytest.warns(UserWarning, match="checkpointing .* is not modelled"):
        assert checkpointing_settings(model) == {}
    model = _plain()
    model.enable_input_require_grads()  # prepare's hook, left on with checkpointing off
    with pytest.warns(UserWarning, match="enable_input_require_grads"):
        assert checkpointing_settings(model) == {}

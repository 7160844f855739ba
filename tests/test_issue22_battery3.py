"""Issue 22's third new-user battery (benchmarks/battery-29.md): new kinds of bad input against the features added
since the second (--from, preflight and the callbacks, --preference, --images, --fp8, --activation-offload,
--optim-in-backward, selective checkpointing, python -m memest). Each test failed on main ffc9fdd."""

import pytest
from typer.testing import CliRunner

import memest
from memest.cli import app
from memest.errors import MemestError

from .conftest import ROOT
from .conftest import one_line_error as error_line

runner = CliRunner()
MLP = str(ROOT / "examples" / "mlp.py")
TINY = "hf:" + str(ROOT / "tests" / "configs" / "llama-tiny.json")


def test_preference_on_a_model_without_an_lm_head_is_a_one_line_error():
    # was: AttributeError 'Sequential' object has no attribute 'config' (trl's add_fused_lm_head), an internal error
    line = error_line(runner.invoke(app, ["estimate", MLP, "--preference", "dpo"]), traceback=True, internal=True)
    assert "--preference dpo" in line and "LM head" in line and "Sequential" in line


def test_preference_on_a_model_without_an_lm_head_through_the_api():
    with pytest.raises(MemestError, match="preference dpo traces a causal LM") as err:
        memest.estimate(MLP, preference="dpo")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("keywords,named", [
    ({"lora": "bad value"}, "lora 'bad value'"),
    ({"lora": {"r": 0}}, "lora: bad value for r"),
    ({"pp": 2, "pp_split": "a,b"}, "pp_split a,b"),
])
def test_api_errors_name_the_keyword_not_the_flag(keywords, named):
    # was: "--lora 'bad value': ..." / "--pp-split a,b: ..." from memest.estimate(lora=..., pp_split=...)
    with pytest.raises(MemestError) as err:
        memest.estimate(TINY, seq=32, **keywords)
    text = str(err.value)
    assert text.startswith("memest.estimate(): " + named), text
    assert "--lora" not in text and "--pp-split" not in text


def test_the_cli_still_names_the_flag():
    line = error_line(runner.invoke(app, ["estimate", TINY, "--seq", "32", "--lora", "bad value"]))
    assert "--lora 'bad value'" in line


def _from_error(tmp_path, name: str, text: str) -> str:
    """The one error line of `estimate --from FILE` (the reader refuses before any model is built)."""
    path = tmp_path / name
    path.write_text(text)
    return error_line(runner.invoke(app, ["estimate", "--from", str(path)]), alone=True)


AXOLOTL = f"base_model: {ROOT / 'tests' / 'configs' / 'llama-tiny.json'}\nsequence_len: 32\nmicro_batch_size: 2\n"
FACTORY = (f"model_name_or_path: {ROOT / 'tests' / 'configs' / 'llama-tiny.json'}\nfinetuning_type: full\n"
           "cutoff_len: 32\nper_device_train_batch_size: 2\n")


def test_axolotl_lora_target_modules_of_the_wrong_type_is_an_error_not_an_internal_one(tmp_path):
    # was: "internal error: TypeError: 'int' object is not iterable"
    line = _from_error(tmp_path, "ax.yml", AXOLOTL + "adapter: lora\nlora_r: 8\nlora_target_modules: 5\n")
    assert "lora_target_modules: expected module names" in line and "got 5" in line


@pytest.mark.parametrize("key", ["gradient_checkpointing", "bf16", "load_in_4bit", "lora_target_linear"])
def test_axolotl_switches_are_true_or_false_not_truthy(tmp_path, key):
    # was: gradient_checkpointing: sometimes turned checkpointing on silently (exit 0)
    line = _from_error(tmp_path, "ax.yml", AXOLOTL + f"{key}: sometimes\n")
    assert f"{key} = 'sometimes': expected true or false" in line


def test_llamafactory_switches_are_true_or_false(tmp_path):
    line = _from_error(tmp_path, "lf.yaml", FACTORY + "disable_gradient_checkpointing: 'no'\n")
    assert "disable_gradient_checkpointing = 'no': expected true or false" in line


@pytest.mark.parametrize("name,base", [("ax.yml", AXOLOTL), ("lf.yaml", FACTORY)])
def test_bf16_and_fp16_both_true_is_refused_not_the_last_kept(tmp_path, name, base):
    # was: exit 0 with whichever of the two keys came last
    assert "bf16 and fp16 are both true" in _from_error(tmp_path, name, base + "bf16: true\nfp16: true\n")


@pytest.mark.parametrize("stage", ["ppo", "rm", "dpo", "kto"])
def test_llamafactory_stages_other_than_sft_are_refused(tmp_path, stage):
    # was: stage was "no effect on memory": a PPO or DPO run estimated as plain SFT, exit 0
    line = _from_error(tmp_path, "lf.yaml", FACTORY + f"stage: {stage}\n")
    assert f"stage = '{stage}'" in line and "sft and pt" in line


def test_llamafactory_sft_stage_still_reads():
    from memest.spec.trainers.load import read_trainer_config

    cfg = read_trainer_config(ROOT / "tests" / "configs" / "trainers" / "llamafactory-lora.yaml")
    assert ("stage = sft", "one model trained on next-token loss") in cfg.mapping


def test_a_json_key_given_twice_is_refused(tmp_path):
    # was: json kept the last value silently (the YAML loader already refused it)
    line = _from_error(tmp_path, "ds.json", '{"train_micro_batch_size_per_gpu": 2, "train_micro_batch_size_per_gpu": 64,'
                                            ' "zero_optimization": {"stage": 0}}')
    assert "'train_micro_batch_size_per_gpu' is given twice" in line


@pytest.mark.parametrize("text", ["!!python/object/apply:os.system ['echo x']\n", "a: [1, 2\n", AXOLOTL + "x: {\n"])
def test_a_malformed_yaml_trainer_config_is_one_line(tmp_path, text):
    # was: four lines on stderr (PyYAML's snippet and caret) after "memest: error:"
    line = _from_error(tmp_path, "bad.yml", text)
    assert "malformed YML" in line and "(line " in line


@pytest.mark.parametrize("value,said", [("5", "got 5"), ("[a.yml]", "got ['a.yml']")])
def test_check_from_key_of_the_wrong_type_names_the_key(tmp_path, value, said):
    # was: "--from '5': not found or unreadable" (a flag the user did not pass, the value stringified)
    config = tmp_path / "run.yaml"
    config.write_text(f"from: {value}\ngpu: 24GB\n")
    line = error_line(runner.invoke(app, ["check", str(config)]), alone=True)
    assert f"{config}: from: expected the path of a trainer config, {said}" in line and "--from" not in line


def test_check_from_key_missing_file_names_the_key_and_config(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("from: nothere.yml\ngpu: 24GB\n")
    line = error_line(runner.invoke(app, ["check", str(config)]), alone=True)
    assert str(config) in line and "from: " in line and "not found" in line and "--from" not in line


@pytest.mark.parametrize("kwargs,said", [
    ({"margin": "x"}, "margin='x'"), ({"gpu": [1]}, "gpu: a budget is a size"), ({"bach": 3}, "did you mean 'batch'"),
    ({"checkpointing": 3}, "checkpointing"),
])
def test_the_transformers_callback_checks_its_arguments_when_made(kwargs, said):
    # was: accepted; the error (or a TypeError for margin='x') came only at trainer.train()'s first callback
    from memest.integrations.transformers import MemestCallback

    with pytest.raises(MemestError, match=said):
        MemestCallback(**kwargs)


def test_the_lightning_callback_checks_its_arguments_when_made():
    pytest.importorskip("lightning")
    from memest.integrations.lightning import MemestCallback

    with pytest.raises(MemestError, match="margin='x'"):
        MemestCallback(margin="x")


def test_preflight_margin_of_the_wrong_type_is_a_memest_error():
    # was: TypeError "'<=' not supported between instances of 'int' and 'str'"
    import torch

    model = torch.nn.Linear(3, 3)
    with pytest.raises(MemestError, match="margin='x'"):
        memest.preflight(model, None, torch.zeros(2, 3), gpu="1GB", margin="x")


def test_inference_with_checkpointing_names_only_what_was_given():
    # was: "--grad-accum and --checkpointing are training techniques" with no --grad-accum given
    line = error_line(runner.invoke(app, ["estimate", MLP, "--checkpointing", "blocks", "--mode", "inference"]),
                      alone=True)
    assert "--checkpointing blocks" in line and "--grad-accum" not in line and "--mode inference" in line


@pytest.mark.parametrize("value", ["four", 0, -2, True])
def test_accelerate_num_processes_is_a_whole_number_at_least_one(tmp_path, value):
    # was: 'four' an internal error (TypeError), 0 read as 1 and -2 ignored, both blamed on shard:/world_size:
    path = tmp_path / "acc.yaml"
    path.write_text(f"compute_environment: LOCAL_MACHINE\ndistributed_type: FSDP\nnum_processes: {value}\n"
                    "mixed_precision: bf16\n")
    line = error_line(runner.invoke(app, ["estimate", TINY, "--from", str(path)]), alone=True)
    assert f"num_processes = {value!r}: a whole number of processes, at least 1" in line


def test_an_inline_deepspeed_mapping_is_named_as_such(tmp_path):
    # was: "deepspeed = {...}: no such file beside the config ({...})"
    line = _from_error(tmp_path, "ax.yml", AXOLOTL + "deepspeed: {zero_optimization: {stage: 3}}\n")
    assert "deepspeed: expected the path of a DeepSpeed JSON" in line and "no such file" not in line


def test_an_axolotl_config_without_base_model_says_so(tmp_path):
    # was: "not a trainer config memest reads (known formats: ...)", naming nothing missing
    line = _from_error(tmp_path, "ax.yml", "sequence_len: 32\nmicro_batch_size: 2\n")
    assert "axolotl config without base_model" in line

"""Issue 25 part B: the torchtitan TOML, transformers TrainingArguments JSON and accelerate config YAML readers
(memest/spec/trainers/). Each reads a realistic file of its format (the library's own object where it installs
here), maps exact memest keys, lists what it did not understand, and an estimate from its keys equals the one from
the hand-written options."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import tomllib
import yaml

import memest
from memest.spec.config import config_from_dict
from memest.spec.trainers import READERS, accelerate_config, torchtitan, training_args

TINY = Path(__file__).parent / "configs" / "llama-tiny.json"

# torchtitan/models/llama3/train_configs/llama3_8b.toml at 238fa9953e4aec2a62582121564273d7cbb1e9f1, verbatim
# but for its comments
LLAMA3_8B_TOML = """
[job]
dump_folder = "./outputs"
description = "Llama 3 8B training"
[profiling]
enable_profiling = true
save_traces_folder = "profile_trace"
profile_freq = 100
[metrics]
log_freq = 10
enable_tensorboard = true
save_tb_folder = "tb"
[model]
name = "llama3"
flavor = "8B"
hf_assets_path = "./assets/hf/Llama-3.1-8B"
[optimizer]
name = "AdamW"
lr = 3e-4
eps = 1e-8
[lr_scheduler]
warmup_steps = 200
[training]
local_batch_size = 1
seq_len = 8192
max_norm = 1.0
steps = 1000
dataset = "c4"
[parallelism]
data_parallel_replicate_degree = 1
data_parallel_shard_degree = -1
tensor_parallel_degree = 1
pipeline_parallel_degree = 1
context_parallel_degree = 1
[checkpoint]
enable = false
folder = "checkpoint"
interval = 500
last_save_model_only = true
export_dtype = "float32"
async_mode = "disabled"
[compile]
enable=false
components = ["model", "loss"]
[activation_checkpoint]
mode = "selective"
selective_ac_option = "op"
[quantize.linear.float8]
enable_fsdp_float8_all_gather = false
precompute_float8_dynamic_scale_for_fsdp = false
filter_fqns = ["output"]
[validation]
enable = false
dataset = "c4_validation"
freq = 500
steps = 1200
"""

# the same layout on a tiny model: hf_assets_path holds its config.json (as the HF download does), 2-way FSDP,
# full AC, a global batch that accumulates, and keys memest does not know
TINY_TOML = """
[job]
dump_folder = "./outputs"
description = "Llama 3 tiny"
[model]
name = "llama3"
flavor = "tiny"
hf_assets_path = "./assets/tiny"
converters = ["float8"]
[optimizer]
name = "AdamW"
lr = 8e-4
implementation = "fused"
[training]
local_batch_size = 2
global_batch_size = 8
seq_len = 64
max_norm = 1.0
steps = 10
dataset = "c4_test"
[training.dataloader]
num_workers = 2
[parallelism]
data_parallel_replicate_degree = 1
data_parallel_shard_degree = 2
tensor_parallel_degree = 1
pipeline_parallel_degree = 1
pipeline_parallel_schedule = "Interleaved1F1B"
context_parallel_degree = 1
[activation_checkpoint]
mode = "full"
[quantize.linear.float8]
filter_fqns = ["output"]
[float8_experimental]
whatever = 1
"""


def _toml(tmp_path: Path, text: str) -> tuple[Path, dict]:
    path = tmp_path / "train.toml"
    path.write_text(text)
    assets = tmp_path / "assets" / "tiny"
    assets.mkdir(parents=True)
    shutil.copy(TINY, assets / "config.json")
    return path, tomllib.loads(text)


def _training_args(tmp_path: Path) -> tuple[Path, dict]:
    """transformers' own TrainingArguments, dumped as Trainer users save it, plus trl SFTConfig's keys
    (max_length, packing: trl/trainer/sft_config.py). bf16=True needs a bf16 GPU to construct (transformers
    checks the device), so it is set in the dump, as a GPU machine writes it."""
    transformers = pytest.importorskip("transformers")
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, gradient_accumulation_steps=4,
        activation_checkpointing=True, optim="adamw_torch_fused", learning_rate=2e-5, logging_steps=10,
        neftune_noise_alpha=5.0, report_to="none")
    data = json.loads(args.to_json_string())
    assert data["bf16"] is False
    data.update(bf16=True, max_length=64, packing=True)
    path = tmp_path / "training_args.json"
    path.write_text(json.dumps(data))
    return path, data


def _accelerate(tmp_path: Path) -> tuple[Path, dict]:
    """accelerate's own ClusterConfig written as `accelerate config` writes it; the fsdp_config is accelerate's
    examples/config_yaml_templates/fsdp.yaml's, plus a key memest does not know."""
    config_args = pytest.importorskip("accelerate.commands.config.config_args")
    fsdp = {"fsdp_activation_checkpointing": False, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_backward_prefetch": "BACKWARD_PRE", "fsdp_cpu_ram_efficient_loading": True,
            "fsdp_forward_prefetch": False, "fsdp_offload_params": False, "fsdp_sharding_strategy": "FULL_SHARD",
            "fsdp_state_dict_type": "SHARDED_STATE_DICT", "fsdp_sync_module_states": True,
            "fsdp_use_orig_params": True, "fsdp_limit_all_gathers": True}
    cluster = config_args.ClusterConfig(compute_environment="LOCAL_MACHINE", distributed_type="FSDP",
                                        mixed_precision="bf16", use_cpu=False, debug=False, num_processes=2,
                                        fsdp_config=fsdp)
    path = tmp_path / "default_config.yaml"
    cluster.to_yaml_file(str(path))
    loaded = config_args.load_config_from_file(str(path))  # accelerate reads back what it wrote
    assert loaded.distributed_type == "FSDP" and loaded.num_processes == 2
    return path, yaml.safe_load(path.read_text())


# --- torchtitan ------------------------------------------------------------------------------------------------


def test_torchtitan_llama3_8b_preset(tmp_path):
    path = tmp_path / "llama3_8b.toml"
    path.write_text(LLAMA3_8B_TOML)
    cfg = torchtitan.read(path, tomllib.loads(LLAMA3_8B_TOML))
    assert cfg.keys == {"model": "hf:llama-3.1-8b", "batch": 1, "seq": 8192, "shard": "zero3",
                        "precision": "bf16-mixed", "checkpointing": "selective", "optim": "adamw", "fused": True}
    assert cfg.unknown == []
    assert any("data_parallel_shard_degree = -1" in n and "--world-size" in n for n in cfg.notes)
    assert any(n.startswith("ignored: no memory effect:") and "metrics.log_freq" in n for n in cfg.notes)


def test_torchtitan_tiny(tmp_path):
    path, data = _toml(tmp_path, TINY_TOML)
    cfg = torchtitan.read(path, data)
    assert cfg.keys == {"model": f"hf:{(tmp_path / 'assets' / 'tiny' / 'config.json').resolve()}", "batch": 2,
                        "seq": 64, "world_size": 2, "shard": "zero3", "precision": "bf16-mixed",
                        "grad_accum": 2, "checkpointing": "blocks", "optim": "adamw", "fused": True,
                        "fp8": "tensorwise", "fp8_skip": "lm_head"}  # torchtitan's "output" is transformers' lm_head
    assert cfg.unknown == ["training.dataloader.num_workers = 2", "float8_experimental.whatever = 1"]


@pytest.mark.parametrize(("ac", "expected"), [
    ('mode = "none"', "none"), ('mode = "full"', "blocks"), ('mode = "selective"\nselective_ac_option = "op"', "selective"),
    ('mode = "selective"\nselective_ac_option = "2"', "every:2"), ("", "every:2"),  # job_config.py's default
])
def test_torchtitan_checkpointing(tmp_path, ac, expected):
    text = f'[model]\nhf_assets_path = "./assets/tiny"\n[training]\nlocal_batch_size = 1\n[activation_checkpoint]\n{ac}\n'
    path, data = _toml(tmp_path, text)
    assert torchtitan.read(path, data).keys["checkpointing"] == expected


def test_torchtitan_precision_follows_the_layout(tmp_path):
    """Mixed precision through fully_shard with FSDP, autocast alone, none with TP and no FSDP (maybe_enable_amp)."""
    base = '[model]\nhf_assets_path = "./assets/tiny"\n[parallelism]\n'
    path, data = _toml(tmp_path, base + "data_parallel_shard_degree = 1\n")
    assert torchtitan.read(path, data).keys["precision"] == "bf16-mixed"
    data = tomllib.loads(base + "data_parallel_shard_degree = 1\ntensor_parallel_degree = 2\n")
    keys = torchtitan.read(path, data).keys
    assert (keys["precision"], keys["tp"], keys["sp"], keys["world_size"]) == ("fp32", 2, True, 2)
    data = tomllib.loads(base + '[training]\ndtype = "bfloat16"\n')
    assert torchtitan.read(path, data).keys["precision"] == "bf16"


def test_torchtitan_pipeline_and_tensor_parallel(tmp_path):
    text = ('[model]\nhf_assets_path = "./assets/tiny"\n[training]\nlocal_batch_size = 4\nseq_len = 64\n'
            '[parallelism]\ndata_parallel_shard_degree = 2\ntensor_parallel_degree = 2\npipeline_parallel_degree = 2\n'
            'pipeline_parallel_schedule = "GPipe"\npipeline_parallel_microbatch_size = 2\ndisable_loss_parallel = true\n'
            '[activation_checkpoint]\nmode = "none"\n')
    path, data = _toml(tmp_path, text)
    cfg = torchtitan.read(path, data)
    assert {k: v for k, v in cfg.keys.items() if k != "model"} == {
        "batch": 2, "seq": 64, "world_size": 8, "shard": "zero2", "tp": 2, "pp": 2, "sp": True, "loss_parallel": False,
        "pp_schedule": "gpipe", "microbatches": 2, "precision": "bf16-mixed", "checkpointing": "none", "optim": "adamw",
        "fused": True}
    assert cfg.unknown == []
    config_from_dict(cfg.keys, path)  # a layout RunSpec accepts


def test_torchtitan_older_layout_keys_are_reported(tmp_path):
    """torchtitan's 2024 TOMLs kept the degrees under [training] and pipeline parallel under [experimental]; this
    reader follows job_config.py at its cited commit, so those keys are listed as unknown, never dropped."""
    text = ('[model]\nhf_assets_path = "./assets/tiny"\n[training]\nbatch_size = 4\ndata_parallel_shard_degree = 2\n'
            '[experimental]\npipeline_parallel_degree = 2\n[debug]\nmoe_force_load_balance = true\n')
    path, data = _toml(tmp_path, text)
    cfg = torchtitan.read(path, data)
    assert cfg.keys["batch"] == 4
    assert cfg.unknown == ["training.data_parallel_shard_degree = 2", "experimental.pipeline_parallel_degree = 2",
                           "debug.moe_force_load_balance = True"]


def test_torchtitan_unknown_flavor_names_the_fix(tmp_path):
    text = '[model]\nname = "llama3"\nflavor = "70B"\n[training]\nlocal_batch_size = 1\n'
    cfg = torchtitan.read(tmp_path / "x.toml", tomllib.loads(text))
    assert "model" not in cfg.keys
    assert any("hf_assets_path" in n and "70B" in n for n in cfg.notes)


# --- TrainingArguments -----------------------------------------------------------------------------------------


def test_training_args_dump(tmp_path):
    path, data = _training_args(tmp_path)
    cfg = training_args.read(path, data)
    assert cfg.keys == {"batch": 2, "grad_accum": 4, "seq": 64, "precision": "bf16-mixed", "checkpointing": "blocks",
                        "optim": "adamw", "fused": True, "outputs": "freed"}
    assert cfg.unknown == ["neftune_noise_alpha = 5.0"]
    assert any("no memory effect" in n and "logging_steps" in n for n in cfg.notes)


def test_training_args_every_default_key_is_known(tmp_path):
    """Every key of transformers' own TrainingArguments is mapped or documented as memory-neutral: a key
    transformers adds or renames shows up here, not as an unknown key in a user's report."""
    transformers = pytest.importorskip("transformers")
    data = json.loads(transformers.TrainingArguments(output_dir=str(tmp_path)).to_json_string())
    assert training_args.read(tmp_path / "a.json", data).unknown == []


@pytest.mark.parametrize(("optim", "expected"), [
    ("adamw_torch", ("adamw", None)), ("adamw_torch_fused", ("adamw", True)), ("adamw_bnb_8bit", ("adam8bit", None)),
    ("paged_adamw_8bit", ("paged-adamw-8bit", None)), ("adafactor", ("adafactor", None)), ("sgd", ("sgd", None)),
])
def test_training_args_optimizers(tmp_path, optim, expected):
    transformers = pytest.importorskip("transformers")
    data = json.loads(transformers.TrainingArguments(output_dir=str(tmp_path), optim=optim).to_json_string())
    keys = training_args.read(tmp_path / "a.json", data).keys
    assert (keys["optim"], keys.get("fused")) == expected


def test_training_args_refuses_an_unmodelled_optimizer(tmp_path):
    transformers = pytest.importorskip("transformers")
    data = json.loads(transformers.TrainingArguments(output_dir=str(tmp_path), optim="lion_8bit").to_json_string())
    with pytest.raises(memest.MemestError, match="lion_8bit"):
        training_args.read(tmp_path / "a.json", data)


def test_training_args_fsdp_and_deepspeed(tmp_path):
    ds = tmp_path / "ds_config.json"
    ds.write_text("{}")
    data = {"per_device_train_batch_size": 1, "gradient_accumulation_steps": 1, "fsdp": "full_shard auto_wrap offload",
            "fsdp_config": {"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
                            "activation_checkpointing": True}, "deepspeed": "ds_config.json", "bf16": True,
            "model_init_kwargs": {"dtype": "bfloat16"}}
    cfg = training_args.read(tmp_path / "args.json", data)
    assert cfg.keys == {"batch": 1, "precision": "bf16", "optim": "adamw", "fused": True, "outputs": "freed",
                        "shard": "zero3", "offload": "params", "checkpointing": "blocks"}
    assert cfg.includes == [ds]
    assert cfg.unknown == []


def test_trl_activation_offloading_maps_to_the_trl_rules(tmp_path):
    """trl's SFTConfig(activation_offloading=True), dumped as trl writes it: memest's --activation-offload trl."""
    trl = pytest.importorskip("trl")
    on = json.loads(trl.SFTConfig(output_dir=str(tmp_path), bf16=False, activation_offloading=True).to_json_string())
    off = json.loads(trl.SFTConfig(output_dir=str(tmp_path), bf16=False).to_json_string())
    cfg = training_args.read(tmp_path / "a.json", on)
    assert cfg.keys["activation_offload"] == "trl"
    assert not any("activation_offloading" in u for u in cfg.unknown)
    assert any("activation_offloading = True" in src and "trl" in meaning for src, meaning in cfg.mapping)
    assert "activation_offload" not in training_args.read(tmp_path / "a.json", off).keys
    assert config_from_dict({**cfg.keys, "model": f"hf:{TINY}"}, tmp_path / "a.json").values["activation_offload"] \
        == "trl"
    with pytest.raises(memest.MemestError, match="expected true or false"):
        training_args.read(tmp_path / "a.json", {**on, "activation_offloading": "yes"})


# --- accelerate ------------------------------------------------------------------------------------------------


def test_accelerate_fsdp(tmp_path):
    path, data = _accelerate(tmp_path)
    cfg = accelerate_config.read(path, data)
    assert cfg.keys == {"world_size": 2, "precision": "bf16-mixed", "shard": "zero3"}
    assert cfg.unknown == ["fsdp_config.fsdp_limit_all_gathers = True"]


def test_accelerate_fsdp1_flat_parameters_read_as_fsdp_version_1(tmp_path):
    """accelerate's FSDP1 default, use_orig_params False (peft's FSDP guide's config), is --fsdp-version 1, with CPU
    offload too; with use_orig_params True or HYBRID_SHARD it stays FSDP2's trace, with a note saying so."""
    data = {"distributed_type": "FSDP", "mixed_precision": "bf16", "num_processes": 2,
            "fsdp_config": {"fsdp_sharding_strategy": "SHARD_GRAD_OP", "fsdp_use_orig_params": False}}
    cfg = accelerate_config.read(tmp_path / "c.yaml", data)
    assert cfg.keys == {"world_size": 2, "precision": "bf16-mixed", "shard": "zero2", "fsdp_version": "1"}
    assert config_from_dict({**cfg.keys, "model": f"hf:{TINY}", "target": "cpu"}, tmp_path / "c.yaml").values[
        "fsdp_version"] == "1"
    offload = accelerate_config.read(tmp_path / "c.yaml", {**data, "fsdp_config": {
        "fsdp_sharding_strategy": "FULL_SHARD", "fsdp_offload_params": True}})
    assert offload.keys["fsdp_version"] == "1" and offload.keys["offload"] == "params"
    for extra in ({"fsdp_use_orig_params": True}, {"fsdp_sharding_strategy": "HYBRID_SHARD"}):
        cfg = accelerate_config.read(tmp_path / "c.yaml", {**data, "fsdp_config": {**data["fsdp_config"], **extra}})
        assert "fsdp_version" not in cfg.keys and any("traced as FSDP2" in n for n in cfg.notes)


def test_training_args_fsdp1_without_orig_params_is_fsdp_version_1(tmp_path):
    data = {"per_device_train_batch_size": 1, "fsdp": "full_shard auto_wrap",
            "fsdp_config": {"use_orig_params": False, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}}
    cfg = training_args.read(tmp_path / "a.json", data)
    assert cfg.keys["shard"] == "zero3" and cfg.keys["fsdp_version"] == "1"
    default = training_args.read(tmp_path / "a.json", {**data, "fsdp_config": {}})
    assert "fsdp_version" not in default.keys and any("use_orig_params=True" in n for n in default.notes)


def test_fsdp1_no_shard_reads_as_fsdp_version_1_not_ddp(tmp_path):
    """FSDP1's NO_SHARD keeps full replicas as one flat parameter per unit (fsdp_qlora's --sharding_strategy ddp,
    accelerate's NO_SHARD, TrainingArguments' no_shard): --shard none --fsdp-version 1, not DDP's buckets; with
    use_orig_params True it stays DDP's trace, with a note; under FSDP2 transformers refuses no_shard."""
    data = {"distributed_type": "FSDP", "mixed_precision": "no", "num_processes": 2,
            "fsdp_config": {"fsdp_sharding_strategy": "NO_SHARD", "fsdp_use_orig_params": False,
                            "fsdp_sync_module_states": True}}
    cfg = accelerate_config.read(tmp_path / "c.yaml", data)
    assert cfg.keys == {"world_size": 2, "precision": "fp32", "shard": "none", "fsdp_version": "1",
                        "fsdp_sync_module_states": True}
    values = config_from_dict({**cfg.keys, "model": f"hf:{TINY}", "target": "cpu"}, tmp_path / "c.yaml").values
    assert values["shard"] == "none" and values["fsdp_version"] == "1"
    orig = accelerate_config.read(tmp_path / "c.yaml", {**data, "fsdp_config": {"fsdp_sharding_strategy": "NO_SHARD",
                                                                                "fsdp_use_orig_params": True}})
    assert "fsdp_version" not in orig.keys and any("traced as DDP" in n for n in orig.notes)
    args = {"per_device_train_batch_size": 1, "fsdp": "no_shard auto_wrap", "fsdp_config": {"use_orig_params": False}}
    cfg = training_args.read(tmp_path / "a.json", args)
    assert cfg.keys["shard"] == "none" and cfg.keys["fsdp_version"] == "1" and cfg.keys["fsdp_sync_module_states"]
    v2 = training_args.read(tmp_path / "a.json", {**args, "fsdp_config": {"version": 2}})
    assert "shard" not in v2.keys and any("no_shard" in u for u in v2.unknown)


def test_accelerate_every_cluster_config_field_is_known():
    """Every field of accelerate's ClusterConfig (and BaseConfig) is mapped, a plugin reported when set, or
    documented as memory-neutral: a field accelerate adds or renames fails here, not in a user's report."""
    config_args = pytest.importorskip("accelerate.commands.config.config_args")
    import dataclasses

    fields = {f.name for f in dataclasses.fields(config_args.ClusterConfig)}
    known = set(accelerate_config.MAPPED) | set(accelerate_config.PLUGINS) | accelerate_config.NEUTRAL
    assert sorted(fields - known) == []


def test_accelerate_deepspeed_and_fsdp2(tmp_path):
    data = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "DEEPSPEED", "mixed_precision": "fp16",
            "num_processes": 4, "deepspeed_config": {"zero_stage": 2, "offload_optimizer_device": "cpu",
                                                     "offload_param_device": "none", "zero3_init_flag": False,
                                                     "gradient_accumulation_steps": 4}}
    cfg = accelerate_config.read(tmp_path / "c.yaml", data)
    assert cfg.keys == {"world_size": 4, "precision": "fp16-mixed", "shard": "zero2", "offload": "optimizer",
                        "grad_accum": 4}
    assert cfg.unknown == []
    data = {"distributed_type": "FSDP", "mixed_precision": "no", "num_processes": 8,
            "fsdp_config": {"fsdp_version": 2, "fsdp_reshard_after_forward": False,
                            "fsdp_activation_checkpointing": True}}
    assert accelerate_config.read(tmp_path / "c.yaml", data).keys == {
        "world_size": 8, "precision": "fp32", "shard": "zero2", "checkpointing": "blocks"}


# --- detection --------------------------------------------------------------------------------------------------


def test_each_reader_detects_its_own_files_only(tmp_path):
    toml_path, toml_data = _toml(tmp_path, TINY_TOML)
    files = {"torchtitan": (toml_path, toml_data), "training-args": _training_args(tmp_path),
             "accelerate": _accelerate(tmp_path)}
    # the other readers' formats (issue 25 part A), as their documentation writes them: none is ours
    files["axolotl"] = (tmp_path / "qlora.yml", {  # axolotl examples/llama-3/qlora.yml
        "base_model": "NousResearch/Meta-Llama-3-8B", "load_in_4bit": True, "adapter": "qlora", "lora_r": 32,
        "sequence_len": 4096, "sample_packing": True, "gradient_accumulation_steps": 4, "micro_batch_size": 2,
        "optimizer": "paged_adamw_32bit", "bf16": "auto", "gradient_checkpointing": True})
    files["llamafactory"] = (tmp_path / "llama3_lora_sft.yaml", {  # LLaMA-Factory examples/train_lora/llama3_lora_sft.yaml
        "model_name_or_path": "meta-llama/Meta-Llama-3-8B-Instruct", "stage": "sft", "do_train": True,
        "finetuning_type": "lora", "lora_target": "all", "cutoff_len": 2048, "per_device_train_batch_size": 1,
        "gradient_accumulation_steps": 8, "learning_rate": 1.0e-4, "bf16": True, "output_dir": "saves/llama3-8b"})
    files["deepspeed"] = (tmp_path / "ds_z3_config.json", {  # a DeepSpeed ZeRO-3 JSON as trainers ship it
        "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 3, "overlap_comm": True}})
    for fmt, (path, data) in files.items():
        found = [r.FORMAT for r in (torchtitan, training_args, accelerate_config) if r.detect(path, data)]
        assert found == ([fmt] if fmt in ("torchtitan", "training-args", "accelerate") else []), fmt
    assert {torchtitan, training_args, accelerate_config} <= set(READERS)


# --- the same estimate from the file's keys as from hand-written options ----------------------------------------


def _figures(est) -> tuple:
    return est.peak_allocated_bytes, est.needed_range


def _peak(values: dict) -> tuple:
    values = dict(values)
    return _figures(memest.estimate(values.pop("model"), **values))


def test_torchtitan_estimate_matches_flags(tmp_path):
    path, data = _toml(tmp_path, TINY_TOML)
    keys = torchtitan.read(path, data).keys
    from_file = _peak(config_from_dict(keys, path).values)
    by_hand = _figures(memest.estimate(f"hf:{tmp_path / 'assets' / 'tiny' / 'config.json'}", batch=2, seq=64, world_size=2,
                              shard="zero3", precision="bf16-mixed", grad_accum=2, checkpointing="blocks",
                              optim="adamw", fused=True))
    assert from_file == by_hand


def test_training_args_estimate_matches_flags(tmp_path):
    path, data = _training_args(tmp_path)
    keys = training_args.read(path, data).keys
    from_file = _peak(config_from_dict({**keys, "model": f"hf:{TINY}"}, path).values)
    by_hand = _figures(memest.estimate(f"hf:{TINY}", batch=2, seq=64, grad_accum=4, precision="bf16-mixed",
                              checkpointing="blocks", optim="adamw", fused=True, outputs="freed"))
    assert from_file == by_hand


def test_accelerate_estimate_matches_flags(tmp_path):
    path, data = _accelerate(tmp_path)
    keys = accelerate_config.read(path, data).keys
    from_file = _peak(config_from_dict({**keys, "model": f"hf:{TINY}", "batch": 2, "seq": 64}, path).values)
    by_hand = _figures(memest.estimate(f"hf:{TINY}", batch=2, seq=64, world_size=2, shard="zero3",
                              precision="bf16-mixed"))
    assert from_file == by_hand


# --- the same through the CLI: `memest estimate --from FILE` (issue 25: a test per format) ------------------------


def _cli(args: list[str]) -> dict:
    from typer.testing import CliRunner

    from memest.cli import app

    result = CliRunner().invoke(app, ["estimate", *args, "--gpu", "h100", "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def _same(from_args: list[str], flag_args: list[str], fmt: str) -> dict:
    got, want = _cli(from_args), _cli(flag_args)
    for key in ("peak_allocated_bytes", "needed_bytes", "needed_bytes_low", "needed_bytes_high", "param_count"):
        assert got[key] == want[key], key
    assert got["spec"] == want["spec"]
    assert got["from"]["format"] == fmt and "from" not in want
    return got


def test_cli_from_torchtitan_toml_matches_flags(tmp_path):
    path, _ = _toml(tmp_path, TINY_TOML)
    model = f"hf:{tmp_path / 'assets' / 'tiny' / 'config.json'}"
    doc = _same(["--from", str(path)], [model, "--batch", "2", "--seq", "64", "--world-size", "2", "--shard", "zero3",
                                        "--precision", "bf16-mixed", "--grad-accum", "2", "--checkpointing", "blocks",
                                        "--optim", "adamw", "--fused", "--fp8", "tensorwise", "--fp8-skip",
                                        "lm_head"], torchtitan.FORMAT)
    assert doc["from"]["unknown"]  # [float8_experimental] is listed, not dropped


def test_cli_from_training_args_json_matches_flags(tmp_path):
    path, _ = _training_args(tmp_path)
    _same([f"hf:{TINY}", "--from", str(path)], [f"hf:{TINY}", "--batch", "2", "--seq", "64", "--grad-accum", "4",
                                                "--precision", "bf16-mixed", "--checkpointing", "blocks", "--optim",
                                                "adamw", "--fused", "--outputs", "freed"], training_args.FORMAT)


def test_cli_from_accelerate_config_matches_flags(tmp_path):
    path, _ = _accelerate(tmp_path)
    _same([f"hf:{TINY}", "--from", str(path), "--batch", "2", "--seq", "64"],
          [f"hf:{TINY}", "--batch", "2", "--seq", "64", "--world-size", "2", "--shard", "zero3", "--precision",
           "bf16-mixed"], accelerate_config.FORMAT)


@pytest.mark.parametrize(("extra", "expected"), [
    ("", {"fp8": "tensorwise"}),
    ('[quantize.linear.float8]\nrecipe_name = "rowwise"\nfilter_fqns = ["attention.wq", "output"]\n',
     {"fp8": "rowwise", "fp8_skip": "self_attn.q_proj,lm_head"}),
    ("[quantize.linear.float8]\nenable_fsdp_float8_all_gather = true\n", {"fp8": "tensorwise", "fp8_all_gather": "float8"}),
    ("[quantize.linear.float8]\nenable_fsdp_float8_all_gather = true\nprecompute_float8_dynamic_scale_for_fsdp = true\n",
     {"fp8": "tensorwise", "fp8_all_gather": "float8-precomputed"}),
])
def test_torchtitan_float8_converter(tmp_path, extra, expected):
    """model.converters = ["quantize.linear.float8"]: torchtitan's Float8LinearConverter (238fa99) as --fp8: no
    recipe_name is tensorwise (Float8LinearConfig()), its FSDP float8 all-gather (and precompute) where FSDP shards,
    filter_fqns as --fp8-skip in transformers' names; compile.enable as --compile-scope blocks (apply_compile)."""
    text = ('[model]\nhf_assets_path = "./assets/tiny"\nconverters = ["quantize.linear.float8"]\n'
            "[parallelism]\ndata_parallel_shard_degree = 2\n[compile]\nenable = true\n" + extra)
    path, data = _toml(tmp_path, text)
    cfg = torchtitan.read(path, data)
    assert {k: cfg.keys[k] for k in expected} == expected
    assert "fp8_skip" in expected or "fp8_skip" not in cfg.keys
    assert cfg.keys["compile_scope"] == "blocks" and "compile" not in cfg.keys
    assert not [u for u in cfg.unknown if "converters" in u]


def test_torchtitan_other_converters_stay_unknown(tmp_path):
    text = '[model]\nhf_assets_path = "./assets/tiny"\nconverters = ["quantize.linear.mx"]\n'
    path, data = _toml(tmp_path, text)
    cfg = torchtitan.read(path, data)
    assert "fp8" not in cfg.keys and cfg.unknown == ["model.converters = ['quantize.linear.mx']"]

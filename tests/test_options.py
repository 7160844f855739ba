"""Every option declared once (spec/options.py): each command's parameters come from the table, every printed
command line parses back to the same spec (and the same traced peak), YAML takes every step key."""

import dataclasses
import json
import shlex

import pytest
import typer
from typer.testing import CliRunner

import memest
from memest.cli import app
from memest.spec import RunSpec, options
from memest.spec.choices import Optimizer
from memest.spec.config import config_from_dict

from .conftest import model_ref

runner = CliRunner()
INTERNAL = {"iterations", "lr", "compute_capability", "pp_stage", "ep_routing", "cp_rank"}
USER_FIELDS = {f.name for f in dataclasses.fields(RunSpec)} - INTERNAL
COMMANDS = typer.main.get_command(app).commands


def params(command: str) -> dict:
    return {p.name: p for p in COMMANDS[command].params}


def parse(argv: list[str]) -> RunSpec:
    """A printed command line (after `memest`) parsed by the command itself, back into a RunSpec."""
    command = COMMANDS[argv[0]]
    values = command.make_context(argv[0], list(argv[1:])).params
    return RunSpec(**options.step_spec(values, argv[0]))


def test_every_command_takes_exactly_the_table_options():
    for name in COMMANDS:
        assert set(params(name)) == {o.name for o in options.for_command(name)}, name
    for name in ("estimate", "whatif", "max-batch", "advise"):
        assert USER_FIELDS <= set(params(name)), name
        assert USER_FIELDS <= set(options.step_fields(name)) | {"batch", "seq"}
    assert set(options.spec_options()) == USER_FIELDS  # the table covers every field a user sets


def test_planners_take_the_step_options_estimate_has():
    for name in ("whatif", "max-batch", "advise"):
        flags = {f for p in COMMANDS[name].params for f in p.opts + p.secondary_opts}
        for flag in ("--world-size", "--shard", "--offload", "--tp", "--pp", "--ep", "--cp", "--mode", "--attention",
                     "--sp", "--pp-virtual", "--zero-grad", "--fused"):
            assert flag in flags, (name, flag)
    plan = set(options.step_fields("plan-parallel"))
    assert {"lora", "quant", "compile", "grad_accum", "freeze", "double_quant", "prepare_kbit", "loss_head"} <= plan
    check = params("check")
    assert {"target", "freeze", "world_size", "mode", "pp_virtual"} <= set(check)
    assert all(check[f].default is None for f in options.step_fields("check"))  # None keeps the config's value
    assert "--no-fused" in check["fused"].secondary_opts


def test_optim_help_names_every_optimizer():
    text = params("estimate")["optim"].help
    for member in Optimizer:
        assert member.value in text, member


SPECS = [
    dict(model="hf:gpt2", batch=4, seq=128, optim="adamw", precision="bf16-mixed", grad_accum=2,
         checkpointing="every:2", outputs="freed", loss_head="chunked:4", lora="r=8,alpha=16,targets=all-linear",
         quant="nf4", double_quant=False, prepare_kbit=True, compile=False, data_dependent="upper-bound",
         zero_grad="zeros", freeze="transformer.wte", attention="flash", fused=True, cudnn_benchmark=True),
    dict(model="hf:gpt2", batch=2, seq=64, optim="paged-adamw-8bit", world_size=8, tp=2, sp=True, pp=2, shard="zero3",
         pp_schedule="interleaved", pp_virtual=2, microbatches=4, pp_split="3,3,3,3"),
    dict(model="hf:gpt2", seq=128, world_size=4, cp=2, shard="zero2", cp_rotate="alltoall"),
    dict(model="hf:gpt2", batch=2, compile=True, target="cpu"),
    dict(model="hf:gpt2", seq=16, mode="generate", new_tokens=8, cache="static", precision="fp16"),
    dict(model="examples/mlp.py", batch=3, world_size=2, shard="zero3", offload="params", target="cpu"),
]


@pytest.mark.parametrize("fields", SPECS)
def test_printed_command_lines_parse_back_to_the_same_spec(fields):
    spec = RunSpec(**fields)
    for command in ("estimate", "advise", "max-batch"):
        extra = {"gpu": "24GB"} if command != "estimate" else {}
        line = options.command_line(spec, command, **extra)
        assert parse(shlex.split(line)[1:]) == spec, line


def test_command_line_round_trips_to_the_same_peak():
    spec = RunSpec(model=model_ref("mlp"), batch=2, target="cpu", optim="sgd-momentum", zero_grad="zeros",
                   world_size=2, shard="zero1")
    argv = options.to_argv(spec)
    assert argv[:2] == ["estimate", spec.model] and "--zero-grad" in argv and "--world-size" in argv
    result = runner.invoke(app, [*argv, "--json"])
    assert result.exit_code == 0, result.output
    fields = {k: v for k, v in dataclasses.asdict(spec).items() if k != "model"}
    direct = memest.estimate(spec.model, **fields)
    assert json.loads(result.stdout)["peak_allocated_bytes"] == direct.peak_allocated_bytes


def test_pp_virtual_and_every_step_key_load_from_yaml():
    cfg = config_from_dict({"model": "hf:gpt2", "pp": 2, "world_size": 2, "pp_schedule": "interleaved",
                            "pp_virtual": 2, "seq": 64, "sp": False, "cudnn_benchmark": True})
    assert cfg.values["pp_virtual"] == 2 and cfg.spec().stages_per_rank == 2
    with pytest.raises(memest.MemestError, match="pp_virtual: expected a whole number"):
        config_from_dict({"model": "hf:gpt2", "pp_virtual": "two"})
    with pytest.raises(memest.MemestError, match="fused: expected true or false"):
        config_from_dict({"model": "hf:gpt2", "fused": 1})


def test_check_overrides_target_and_freeze(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(f"model: {model_ref('mlp')}\nbatch: 2\ngpu: 11GB\n")
    base = runner.invoke(app, ["check", str(path), "--json"])
    over = runner.invoke(app, ["check", str(path), "--target", "cpu", "--freeze", "0.*", "--json"])
    assert base.exit_code == 0 and over.exit_code == 0, over.output
    before, after = json.loads(base.stdout)["configs"][0], json.loads(over.stdout)["configs"][0]
    frozen = memest.estimate(model_ref("mlp"), batch=2, target="cpu", freeze="0.*")
    assert after["needed_bytes"] == frozen.needed_bytes != before["needed_bytes"]


def test_whatif_takes_data_parallel_options():
    result = runner.invoke(app, ["whatif", model_ref("mlp"), "--batch", "2", "--target", "cpu", "--world-size", "2",
                                 "--shard", "zero1", "--json"])
    assert result.exit_code == 0, result.output
    point = json.loads(result.stdout)["points"][0]
    direct = memest.estimate(model_ref("mlp"), batch=2, target="cpu", world_size=2, shard="zero1")
    assert point["peak_bytes"] == direct.peak_allocated_bytes
    plain = memest.estimate(model_ref("mlp"), batch=2, target="cpu")
    assert direct.peak_allocated_bytes != plain.peak_allocated_bytes  # the options reached the trace


def test_plan_parallel_refuses_what_it_searches():
    result = runner.invoke(app, ["plan-parallel", "hf:gpt2", "--gpu", "24GB", "--tp", "2", "--shard", "zero3"])
    assert result.exit_code == 2
    assert "--shard, --tp" in result.stderr and "drop them" in result.stderr
    result = runner.invoke(app, ["plan-parallel", "hf:gpt2", "--gpu", "24GB", "--compile"])
    assert result.exit_code == 2 and "--compile" in result.stderr


def test_advise_remedies_carry_their_command():
    result = runner.invoke(app, ["advise", model_ref("mlp"), "--batch", "8", "--target", "cpu", "--world-size", "2",
                                 "--shard", "zero1", "--gpu", "1MiB", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    base = RunSpec(model=model_ref("mlp"), batch=8, target="cpu", world_size=2, shard="zero1")
    assert doc["remedies"]
    for remedy in doc["remedies"]:
        argv = shlex.split(remedy["command"])[1:]
        assert argv[-2:] == ["--gpu", "1MiB"]
        assert parse(argv) == dataclasses.replace(base, **remedy["changes"]), remedy["name"]
    remedy = doc["remedies"][0]
    again = runner.invoke(app, [*shlex.split(remedy["command"])[1:], "--json"])
    assert json.loads(again.stdout)["needed_bytes"] == remedy["needed_bytes"]


def test_plan_parallel_layouts_carry_their_command():
    ref = model_ref("hf:llama-tiny-4l")
    result = runner.invoke(app, ["plan-parallel", ref, "--gpus", "2", "--gpu", "1GB", "--batch", "2", "--seq", "32",
                                 "--target", "cpu", "--grad-accum", "2", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["base"]["grad_accum"] == 2
    pipelines = [lay for lay in doc["layouts"] if lay["pp"] > 1]
    assert pipelines and all(lay["command"] == "" and lay["error"] for lay in pipelines)  # --pp refuses --grad-accum
    assert all(lay["command"].startswith(f"memest estimate {ref} ") for lay in doc["layouts"] if lay["pp"] == 1)
    best = next(lay for lay in doc["layouts"] if lay["fits"] and not lay["error"])
    argv = shlex.split(best["command"])[1:]
    assert argv[-2:] == ["--gpu", "1GB"] and "--grad-accum" in argv
    spec = parse(argv)
    assert (spec.world_size, spec.tp, spec.pp, spec.grad_accum) == (2, best["tp"], best["pp"], 2)
    again = runner.invoke(app, [*argv, "--json"])
    assert json.loads(again.stdout)["peak_allocated_bytes"] == best["peak_bytes"]  # 4 layers: traced at full depth


def test_serve_defaults_are_the_engine_spec_s_and_yaml_keys_the_table_s():
    from memest.serve.engine import ServeSpec
    from memest.spec.config import SERVE_KEYS

    defaults = {f.name: f.default for f in dataclasses.fields(ServeSpec)}
    serve = params("serve")
    for name in ("tp", "kv_dtype", "block_size", "engine", "cuda_graphs", "max_model_len", "utilization"):
        assert serve[name].default == defaults[name], name
    assert set(SERVE_KEYS) == {"max_model_len", "gpu_memory_utilization", "tp", "kv_dtype", "block_size", "max_num_seqs",
                               "max_num_batched_tokens", "engine", "cuda_graphs", "min_concurrency", "non_torch_memory"}
    with pytest.raises(memest.MemestError, match="unknown option"):
        memest.serve_capacity("hf:gpt2", gpu="h100", block=16)

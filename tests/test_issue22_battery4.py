"""Issue 22's fourth battery (benchmarks/battery-30.md): the leftovers of battery 29 (benchmarks/battery-29.md
#152, #161, #162, #177, A5/A6, A26) and the defects battery 30 found in the features added since battery 29
(--preference orpo|kto|simpo|cpo|grpo, --images, --loss-head chunked-output, --from on the planners, --lora
dtype=base, --checkpointing blocks-reentrant). Each test failed on main 05c2d10."""

import json

import pytest
import torch
from typer.testing import CliRunner

import memest
from memest.cli import app
from memest.errors import MemestError

from .conftest import ROOT
from .conftest import one_line_error as error_line

runner = CliRunner()
MLP = str(ROOT / "examples" / "mlp.py")
TINY_JSON = ROOT / "tests" / "configs" / "llama-tiny.json"
TINY = f"hf:{TINY_JSON}"
AXOLOTL = f"base_model: {TINY_JSON}\nsequence_len: 32\nmicro_batch_size: 2\n"


# --- battery 29's leftovers

def test_version_with_extra_arguments_is_a_usage_error():
    # was: `memest --version extra` printed the versions and exited 0 (battery 29, #152)
    line = error_line(runner.invoke(app, ["--version", "extra"]), alone=True)
    assert "--version" in line and "'extra'" in line
    plain = runner.invoke(app, ["--version"])
    assert plain.exit_code == 0 and plain.stdout.startswith("memest ")


def test_selective_name_the_file_lacks_is_said_before_no_repeated_blocks():
    # was: "examples/mlp.py has no repeated blocks" for selective:NOPE (battery 29, #161)
    line = error_line(runner.invoke(app, ["estimate", MLP, "--checkpointing", "selective:NOPE"]), alone=True)
    assert "defines no NOPE" in line and "repeated blocks" not in line


def test_pageable_activation_offload_on_the_cpu_target_is_refused():
    # was: exit 0 with a note (host copies of host tensors move nothing) (battery 29, #162)
    line = error_line(runner.invoke(app, ["estimate", TINY, "--seq", "32", "--target", "cpu",
                                          "--activation-offload", "save-on-cpu"]), alone=True)
    assert "--activation-offload save-on-cpu with --target cpu moves nothing" in line
    with pytest.raises(MemestError, match="moves nothing"):
        memest.estimate(TINY, seq=32, target="cpu", activation_offload="save-on-cpu")


def test_an_include_that_is_not_utf8_names_the_include_and_the_users_from_file(tmp_path):
    # was: "--from bin.json: not UTF-8 text" when the user's --from was the axolotl file (battery 29, #177)
    (tmp_path / "bin.json").write_bytes(b"\xff\xfe\x00garbage\x9c")
    config = tmp_path / "ax.yml"
    config.write_text(AXOLOTL + "deepspeed: bin.json\n")
    line = error_line(runner.invoke(app, ["estimate", "--from", str(config)]), alone=True)
    assert "bin.json" in line and f"included by --from {config}" in line and "not UTF-8" in line
    assert "--from bin.json" not in line


def test_api_from_file_reads_the_run_as_the_cli_does(tmp_path):
    # was: memest.estimate(from_file=...) -> TypeError: missing 'model' (battery 29, A5)
    config = tmp_path / "ax.yml"
    config.write_text(AXOLOTL)
    for extra, flags in (({}, []), ({"batch": 4}, ["--batch", "4"])):
        est = memest.estimate(from_file=str(config), **extra)
        cli = runner.invoke(app, ["estimate", "--from", str(config), *flags, "--json"])
        assert cli.exit_code == 0, cli.output
        doc = json.loads(cli.stdout)
        assert est.peak_allocated_bytes == doc["peak_allocated_bytes"]
        assert json.loads(est.to_json())["spec"]["batch"] == doc["spec"]["batch"] == extra.get("batch", 2)


def test_api_from_file_errors_are_memest_errors_naming_from_file(tmp_path):
    with pytest.raises(MemestError, match=r"^memest.estimate\(\): from_file 'nothere.yml': not found"):
        memest.estimate(from_file="nothere.yml")
    with pytest.raises(MemestError, match="from_file: expected the path"):
        memest.estimate(from_file=5)
    with pytest.raises(MemestError, match="or from_file="):
        memest.estimate()
    config = tmp_path / "ax.yml"
    config.write_text(AXOLOTL)
    with pytest.raises(MemestError, match="not a factory"):
        memest.estimate(lambda: torch.nn.Linear(2, 2), from_file=str(config))


def test_preflight_batch_that_disagrees_with_the_sample_is_refused():
    # was: preflight(..., batch=8) over a sample of 2 silently estimated batch 8 (battery 29, A26)
    model = torch.nn.Linear(3, 3)
    with pytest.raises(MemestError, match=r"batch=8 disagrees with sample_batch's first dimension \(2\)"):
        memest.preflight(model, None, torch.zeros(2, 3), gpu="1GB", batch=8)
    assert memest.preflight(model, None, torch.zeros(2, 3), gpu="1GB", batch=2).fits


# --- battery 30

GRPO = ["--seq", "32", "--preference", "grpo", "--generations", "2", "--completion-len", "8"]


def test_max_batch_under_grpo_searches_multiples_of_generations():
    # was: exit 2, "--batch must be a multiple of --generations 2 ... got --batch 1": the search began at batch 1
    result = runner.invoke(app, ["max-batch", TINY, *GRPO, "--gpu", "24GB", "--limit", "4", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["step"] == 2 and doc["value"] == 4 and doc["hit_limit"]
    assert sorted(v for v, _, _ in doc["probes"]) == [2, 4]
    line = error_line(runner.invoke(app, ["max-batch", TINY, *GRPO, "--gpu", "24GB", "--limit", "1"]), alone=True)
    assert "--limit 1" in line and "--generations 2" in line


@pytest.mark.parametrize("extra", [["--images", "1"], []], ids=["images", "default-inputs"])
def test_preference_on_a_vision_language_model_is_refused_not_traced_without_its_images(extra):
    # was: exit 0, the DPO batch built from input_ids alone: pixel_values dropped, the vision tower never run.
    # dpo now traces trl's vision batch (tests/test_preference_vlm.py); orpo's batch is still text only
    qwen = "hf:" + str(ROOT / "tests" / "configs" / "qwen2.5-vl-tiny.json")
    line = error_line(runner.invoke(app, ["estimate", qwen, "--seq", "8", "--batch", "1", "--preference", "orpo",
                                          *extra]))  # (progress lines: the default inputs are built first)
    assert "--preference orpo" in line and ("--images" in line if extra else "pixel_values" in line), line


def test_dpo_on_a_vision_language_model_traces_its_images_and_refuses_precomputed():
    qwen = "hf:" + str(ROOT / "tests" / "configs" / "qwen2.5-vl-tiny.json")
    args = ["estimate", qwen, "--seq", "8", "--batch", "1", "--preference", "dpo", "--images", "1", "--target", "cpu"]
    result = runner.invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    line = error_line(runner.invoke(app, [*args, "--reference", "precomputed"]))
    assert "precompute_ref_log_probs" in line, line


@pytest.mark.parametrize("completion, named", [("100000", "--completion-len 100000"), ("0", "max_completion_length 512")])
def test_grpo_prompt_and_completion_past_the_models_positions_is_refused(completion, named):
    # was: --completion-len 100000 on a 256-position model traced a 100,032-token generation for many minutes
    line = error_line(runner.invoke(app, ["estimate", TINY, "--seq", "32", "--preference", "grpo", "--generations", "2",
                                          "--batch", "2", "--completion-len", completion]))
    assert named in line and "256 positions" in line, line
    with pytest.raises(MemestError, match="positions"):
        memest.estimate(TINY, seq=32, preference="grpo", generations=2, batch=2, completion_len=int(completion))


def test_images_past_the_models_positions_are_refused():
    # was: --images 1000 (256 tokens each) on a 512-position model: a ~256,000-token trace, still running after minutes
    qwen = "hf:" + str(ROOT / "tests" / "configs" / "qwen2.5-vl-tiny.json")
    line = error_line(runner.invoke(app, ["estimate", qwen, "--seq", "32", "--images", "1000"]))
    assert "--images 1000" in line and "256 image tokens" in line and "512 positions" in line, line


def test_a_checkpointing_policy_spelled_with_an_underscore_is_named(tmp_path):
    # was: "has no module 'blocks_reentrant'; see the module names in the memest table" (YAML blocks_reentrant)
    line = error_line(runner.invoke(app, ["estimate", TINY, "--seq", "32", "--checkpointing", "blocks_reentrant"]))
    assert "did you mean the policy blocks-reentrant?" in line, line


def test_grpo_on_a_vision_language_model_is_refused_before_tracing():
    # was: exit 2 "the forward raised AttributeError: 'Qwen2_5_VLConfig' object has no attribute 'eos_token_id'"
    qwen = "hf:" + str(ROOT / "tests" / "configs" / "qwen2.5-vl-tiny.json")
    line = error_line(runner.invoke(app, ["estimate", qwen, "--seq", "8", "--preference", "grpo", "--generations", "2",
                                          "--batch", "2", "--completion-len", "4"]), alone=True)
    assert "--preference grpo on a vision-language model" in line and "AttributeError" not in line, line


def test_plan_parallel_refuses_a_preference_step_it_cannot_lay_out():
    # was: exit 0, every layout 'not traceable' (--preference dpo with --world-size > 1 is not traced yet)
    line = error_line(runner.invoke(app, ["plan-parallel", TINY, "--seq", "32", "--preference", "dpo", "--gpus", "2",
                                          "--gpu", "24GB"]), alone=True)
    assert "--preference dpo" in line and "plan-parallel" in line, line


@pytest.mark.parametrize("head", ["chunked-output:100000", "chunked:33"])
def test_more_loss_chunks_than_tokens_is_refused(head):
    # was: chunked-output:100000 at --seq 32 traced one op per (empty) chunk, still running after 10 minutes
    line = error_line(runner.invoke(app, ["estimate", TINY, "--seq", "32", "--loss-head", head]), alone=True)
    assert f"--loss-head {head}" in line and "empty" in line, line


@pytest.mark.parametrize("head, extra", [("chunked-output", []), ("chunked", ["--sp"])])
def test_a_loss_head_with_tensor_parallel_is_refused_with_the_reason(head, extra):
    # was: exit 2 "the forward raised TypeError: _chunked_output_loss() missing 1 required positional argument:
    # 'labels'; memest built the inputs of a causal-lm head ..." (blaming the model's inputs)
    line = error_line(runner.invoke(app, ["estimate", TINY, "--seq", "32", "--loss-head", head, "--tp", "2", *extra,
                                          "--world-size", "2"]), alone=True)
    assert f"--loss-head {head} with --tp is not traced yet" in line and "TypeError" not in line, line

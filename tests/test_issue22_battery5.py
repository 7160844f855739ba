"""Issue 22's fifth battery (benchmarks/battery-31.md): battery 30's leftovers (#54 the default-image note beside
the user's own images; #46, #49 the Python API's errors naming CLI flags) and the defects battery 31 found in the
features added since battery 30 (--compile-scope, GRPO with --grad-accum / --quant / --checkpointing, the VLM
options --video-frames / --min-pixels / --max-pixels / --freeze vision, memest.estimate(from_file=))."""

import json

import pytest
from typer.testing import CliRunner

import memest
from memest.cli import app
from memest.errors import MemestError

from .conftest import ROOT
from .conftest import one_line_error as error_line

runner = CliRunner()
CONFIGS = ROOT / "tests" / "configs"
TINY = f"hf:{CONFIGS / 'llama-tiny.json'}"
QWEN = f"hf:{CONFIGS / 'qwen2.5-vl-tiny.json'}"
LLAVA_NEXT = f"hf:{CONFIGS / 'llava-next-tiny.json'}"
GRPO = {"preference": "grpo", "generations": 2, "completion_len": 8}


# --- battery 30 #54: the source's note on its default image only where that image is traced

def _notes(args: list[str]) -> list[str]:
    result = runner.invoke(app, ["estimate", *args, "--target", "cpu", "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)["notes"]


@pytest.mark.parametrize("model,given", [
    (QWEN, ["--images", "2", "--image-size", "56x56"]),
    (QWEN, ["--video-frames", "2", "--image-size", "56x56"]),
    (LLAVA_NEXT, ["--images", "1", "--image-size", "100x300"]),
], ids=["qwen-images", "qwen-video", "llava-next-images"])
def test_the_default_image_note_is_not_beside_the_users_own_images(model, given):
    # was: "inputs: one 448x448 image per example ... (256 image tokens)" beside --image-size 100000x100000
    notes = _notes([model, "--seq", "16", "--batch", "1", *given])
    assert not [n for n in notes if "image per example (--images N" in n], notes


def test_the_default_image_note_stays_where_the_default_image_is_traced():
    notes = _notes([QWEN, "--seq", "16", "--batch", "1"])
    assert [n for n in notes if "one 448x448 image per example (--images N" in n], notes


# --- battery 30 #46, #49: the Python API's errors name its keywords, the CLI's its flags

@pytest.mark.parametrize("keywords,named", [
    ({**GRPO, "batch": 2, "rollout": "x"}, ["unknown rollout='x'"]),
    ({"optim": "lion"}, ["unknown optim='lion'"]),
    ({"compile_scope": "layers"}, ["unknown compile_scope='layers'"]),
    ({**GRPO, "generations": 3, "batch": 4}, ["batch= counts completions", "multiple of generations=3", "got batch=4"]),
    ({"generations": 2}, ["generations=, completion_len=, generation_batch= and rollout=", "add preference='grpo'"]),
    ({"preference": "simpo", "reference": "copy"}, ["preference simpo has no reference", "drop reference='copy'"]),
    ({"compile": True, "world_size": 2}, ["compile=True with world_size:", "compile_scope='blocks'"]),
    ({"prepare_kbit": True}, ["prepare_kbit"]),
    # was: "compile_scope blocks with tp= is not traced ...; drop it or compile=True" (the value lost, and a keyword
    # that turns compile on named as the way out of a refusal of compiled blocks)
    ({"compile_scope": "blocks", "world_size": 4, "shard": "zero3", "tp": 2},
     ["compile_scope blocks with tp=2 is not traced", "drop it, or drop compile_scope='blocks'"]),
    ({"compile_scope": "blocks", "world_size": 2, "offload": "optimizer"},
     ["compile_scope blocks with offload='optimizer' is not traced", "drop it, or drop compile_scope='blocks'"]),
], ids=["rollout", "optim", "compile-scope", "grpo-batch", "grpo-options", "simpo-reference", "compile-world",
        "prepare-kbit", "blocks-tp", "blocks-offload"])
def test_api_errors_name_keywords_for_choices_and_combinations(keywords, named):
    with pytest.raises(MemestError) as err:
        memest.estimate(TINY, seq=32, target="cpu", **keywords)
    text = str(err.value)
    assert text.startswith("memest.estimate(): ") and "\n" not in text, text
    for words in named:
        assert words in text, text
    assert "--" not in text and "compile=True;" not in text, text


def test_api_min_max_pixels_refusal_names_keywords():
    with pytest.raises(MemestError) as err:
        memest.estimate(QWEN, seq=16, images=1, min_pixels=1_000_000, max_pixels=10)
    assert "min_pixels 1000000 is above max_pixels=10" in str(err.value) and "--" not in str(err.value)


@pytest.mark.parametrize("args,named", [
    (["--rollout", "x"], "'--rollout'"),
    (["--generations", "3", "--batch", "4"], "--generations 3"),
    (["--compile", "--world-size", "2"], "--compile with --world-size"),
    (["--compile-scope", "blocks", "--world-size", "4", "--shard", "zero3", "--tp", "2"],
     "--compile-scope blocks with --tp 2 is not traced (not checked against real compiled runs); drop it, or drop "
     "--compile-scope blocks;"),
], ids=["rollout", "grpo-batch", "compile-world", "blocks-tp"])
def test_the_cli_keeps_naming_flags(args, named):
    extra = ["--preference", "grpo", "--completion-len", "8"] if "--generations" in args or "--rollout" in args else []
    line = error_line(runner.invoke(app, ["estimate", TINY, "--seq", "32", *extra, *args]), alone=True)
    assert named in line, line


# --- battery 31's defects

def test_yaml_blocks_with_compile_false_names_the_value(tmp_path):
    # was: "compile_scope: blocks with compile: drop one" (--no-compile said as "compile:", its value lost; #18)
    config = tmp_path / "c.yaml"
    config.write_text(f"model: {TINY}\nseq: 32\ncompile_scope: blocks\ncompile: false\n")
    line = error_line(runner.invoke(app, ["check", str(config)]), alone=True)
    assert "compile_scope: blocks with compile: false" in line and "--" not in line


def test_video_frames_past_the_positions_are_refused_naming_them():
    # was: "the forward uses a data-dependent op (aten.nonzero.default) ... memest cannot trace this model yet" (#43)
    line = error_line(runner.invoke(app, ["estimate", QWEN, "--seq", "16", "--video-frames", "100000"]))
    assert "--video-frames 100000" in line and "video tokens" in line and "positions" in line, line
    assert "data-dependent" not in line


def test_an_aspect_ratio_the_processor_refuses_is_a_one_line_error():
    # was: "memest: internal error: ValueError: absolute aspect ratio must be smaller than 200" (#48)
    result = runner.invoke(app, ["estimate", QWEN, "--seq", "16", "--images", "1", "--image-size", "28x10000"])
    line = error_line(result, internal=True)
    assert "--image-size 28x10000" in line and "aspect ratio" in line, line
    with pytest.raises(MemestError, match=r"image_size 28x10000: .*aspect ratio"):
        memest.estimate(QWEN, seq=16, images=1, image_size="28x10000")


def test_an_option_given_beside_a_trainer_file_is_not_named_as_the_files_key(tmp_path):
    # was: "ax.yml: preference: grpo: batch: counts completions ..." for preference='grpo' / --preference grpo given
    # beside the file (its key form blamed the file for the user's own option; #66, #68)
    config = tmp_path / "ax.yml"
    config.write_text(f"base_model: {CONFIGS / 'llama-tiny.json'}\nsequence_len: 32\nmicro_batch_size: 2\n")
    with pytest.raises(MemestError) as err:
        memest.estimate(from_file=str(config), preference="grpo")
    assert "preference='grpo'" in str(err.value) and "batch: counts completions" in str(err.value), str(err.value)
    line = error_line(runner.invoke(app, ["estimate", "--from", str(config), "--preference", "grpo"]), alone=True)
    assert "--preference grpo" in line and "batch: counts completions" in line, line

"""Issue 22, the serve items: layouts vLLM refuses (2), models it does not serve (3, 21), fixes that do not fix (12),
zero and negative settings (14), SGLang's longest context (21), training keys in serving configs (22) and the
budget table's source column (35)."""

import json

import pytest
from typer.testing import CliRunner

from memest.cli import app
from memest.errors import MemestError
from memest.serve.plan import ServeSpec, plan_serve

from .conftest import one_line_error, run

runner = CliRunner()
GiB = 2**30


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return path


# -- 2: tensor-parallel layouts vLLM refuses ------------------------------------------------------------------


def test_serve_tp_that_does_not_divide_the_heads_is_refused():
    line = one_line_error(run("serve", "hf:llama-3-8b", "--gpu", "h100", "--tp", "3"))
    assert "--tp 3" in line and "32 attention heads" in line


def test_serve_config_with_tp_3_fails_check(tmp_path):
    cfg = write(tmp_path, "tp3.yaml", "model: hf:llama-3-8b\ngpu: h100\nserve: {tp: 3}\n")
    line = one_line_error(run("check", cfg))
    assert "32 attention heads" in line


def test_serve_kv_heads_must_divide_tp_or_tp_them():
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=768, num_attention_heads=12, num_key_value_heads=4, num_hidden_layers=2,
                      intermediate_size=1024, vocab_size=1000, max_position_embeddings=512,
                      architectures=["LlamaForCausalLM"])
    with pytest.raises(MemestError, match="4 key/value heads"):
        plan_serve(ServeSpec("hf:tiny", 80 * GiB, "h100", tp=6), config=cfg)


# -- 3, 21: encoders and image models are not served --------------------------------------------------------


@pytest.mark.parametrize("model, why", [("hf:bert-base-uncased", "BertForMaskedLM"),
                                        ("hf:vit-base", "ViTForImageClassification")])
def test_serve_refuses_models_that_are_not_decoder_lms(model, why):
    line = one_line_error(run("serve", model, "--gpu", "h100"))
    assert "decoder-only" in line and why in line


def test_serve_refuses_an_encoder_family_without_is_decoder():
    from transformers import BertConfig

    cfg = BertConfig(num_hidden_layers=2, architectures=["BertLMHeadModel"])
    with pytest.raises(MemestError, match="is_decoder"):
        plan_serve(ServeSpec("hf:bert-lm", 80 * GiB, "h100"), config=cfg)


def test_serve_config_for_an_encoder_fails_check(tmp_path):
    cfg = write(tmp_path, "bert.yaml", "model: hf:bert-base-uncased\ngpu: h100\nserve: {min_concurrency: 1}\n")
    assert "decoder-only" in one_line_error(run("check", cfg))


# -- 21: SGLang's longest context stops at the model's positions --------------------------------------------


def test_sglang_longest_context_is_capped_at_the_positions():
    result = run("serve", "hf:llama-3-8b", "--gpu", "h100", "--engine", "sglang", "--format", "json")
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["kv_tokens"] > 8192  # the pool holds far more than one sequence ...
    assert doc["longest_context"] == doc["longest_context_high"] == 8192  # ... but one sequence is at most the model's positions


# -- 14: zero and negative settings ------------------------------------------------------------------------


def test_colocate_serve_zero_is_refused_not_read_as_the_default():
    line = one_line_error(run("estimate", "hf:llama-3.2-1b", "--batch", "1", "--seq", "16",
                              "--gpu", "h100", "--colocate-serve", "0"))
    assert "(0, 1)" in line and "got 0" in line


@pytest.mark.parametrize("value", [0, -5])
def test_min_concurrency_below_one_is_refused(tmp_path, value):
    cfg = write(tmp_path, "c.yaml", f"model: hf:llama-3-8b\ngpu: h100\nserve: {{min_concurrency: {value}}}\n")
    line = one_line_error(run("check", cfg))
    assert "min_concurrency" in line and str(value) in line


# -- 22: training keys in a serving config --------------------------------------------------------------------


@pytest.mark.parametrize("key, text", [("batch", "batch: 8"), ("lora", "lora: {r: 8}")])
def test_serve_config_refuses_training_keys(tmp_path, key, text):
    cfg = write(tmp_path, "s.yaml", f"model: hf:llama-3-8b\ngpu: h100\n{text}\nserve: {{tp: 1}}\n")
    assert repr(key) in one_line_error(run("check", cfg))


@pytest.mark.parametrize("flag, value", [("--batch", "8"), ("--lora", "r=8")])
def test_serve_config_refuses_training_overrides(tmp_path, flag, value):
    cfg = write(tmp_path, "s.yaml", "model: hf:llama-3-8b\ngpu: h100\nserve: {tp: 1}\n")
    assert flag in one_line_error(run("check", cfg, flag, value))


# -- 12: every printed fix, applied, makes the engine start -------------------------------------------------

TINY = ["--max-num-batched-tokens", "256", "--max-num-seqs", "8"]


def serve_json(*args):
    result = run("serve", *args, "--format", "json")
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


def test_each_printed_fix_starts_when_applied():
    doc = serve_json("hf:tinyllama-1.1b", "--gpu", "h100", "--max-model-len", "5000000", *TINY)
    assert doc["verdict"] == "will-not-start"
    assert doc["fixes"] and doc["fixes"][0].startswith("--max-model-len 2048")
    for fix in doc["fixes"]:  # main also printed --max-model-len 3266992, --kv-dtype fp8, --tp 2
        flag, value = fix.split()[:2]
        after = serve_json("hf:tinyllama-1.1b", "--gpu", "h100", "--max-model-len", "5000000", *TINY, flag, value)
        assert "MAY NOT START" not in fix  # issue 22 item 12: only fixes that make it start are printed
        assert after["verdict"] == "starts", (fix, after["reasons"])


def test_no_fix_is_printed_when_none_makes_it_start():
    doc = serve_json("hf:tinyllama-1.1b", "--gpu", "1GB", *TINY)  # 2.05 GiB of weights on a 1 GB card
    assert doc["verdict"] == "will-not-start"
    assert doc["fixes"] == []  # main printed "--gpu-memory-utilization 0.45 or lower" and "--tp 2"
    assert any(n.startswith("no single change") for n in doc["notes"])


# -- 35: the budget table stays short; its sources sit under it and in the JSON -------------------------------


def test_serve_budget_table_keeps_sources_out_of_its_cells():
    result = runner.invoke(app, ["serve", "hf:tinyllama-1.1b", "--gpu", "h100", *TINY], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.splitlines()
    top = next(i for i, line in enumerate(lines) if line.startswith("┏"))
    bottom = next(i for i, line in enumerate(lines) if line.startswith("└"))
    assert bottom - top + 1 <= 12  # header + 7 steps, one line each (main: 20+ lines at 80 columns)
    refs = {cell.strip() for line in lines[top:bottom] for cell in line.split("│")[-2:-1] if cell.strip()}
    assert refs and all(any(line.startswith(ref + " ") for line in lines[bottom:]) for ref in refs)
    doc = serve_json("hf:tinyllama-1.1b", "--gpu", "h100", *TINY)
    assert all(part["source"] for part in doc["budget"]["parts"])  # the JSON keeps every source in full


# -- 3: the profile forward is never longer than the model's positions ----------------------------------------


def test_profile_run_spreads_tokens_over_sequences_within_the_positions():
    from memest.serve.model import load_config
    from memest.serve.profile import trace_profile_run

    cfg = load_config("hf:gpt2")  # 1,024 positions
    run_ = trace_profile_run(cfg, 1, 2048, 8, "float32", (9, 0))
    assert run_.model is not None  # main stretched the positions to 2,048 and dropped the model
    assert run_.model.config.max_position_embeddings == 1024
    assert any("2 sequences of 1024 tokens" in n for n in run_.notes)

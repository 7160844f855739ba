"""memest serve: KV bytes per token against the config arithmetic and against transformers' own cache, the
engines' budget arithmetic step by step, weights per rank, the CLI and the check gate."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from memest.cli import app
from memest.serve.budget import Part
from memest.serve.kv import FULL, MLA, SLIDING, LayerKV, ModelKV, model_dtype, model_kv
from memest.serve.model import build_meta as _build_meta
from memest.serve.plan import ServeSpec, load_config, plan_serve
from memest.serve.sglang import sglang_budget, sglang_default_fraction
from memest.serve.vllm import kv_layout, longest_context, request_bytes, vllm_budget
from memest.serve.weights import weights_per_rank

GiB = 2**30
BUNDLED = Path(__file__).resolve().parent.parent / "memest" / "data" / "models"
DECODERS = sorted(p.stem for p in BUNDLED.glob("*.json")
                  if any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in json.loads(p.read_text())["architectures"]))


def config_arithmetic(raw: dict) -> int:
    """2 (K, V) x layers x KV heads x head dim x bytes, from the config.json's own numbers."""
    layers = raw.get("num_hidden_layers", raw.get("n_layer"))
    heads = raw.get("num_attention_heads", raw.get("n_head"))
    kv_heads = raw.get("num_key_value_heads", heads)
    head_dim = raw.get("head_dim") or raw.get("hidden_size", raw.get("n_embd")) // heads
    nbytes = 2  # bf16 / fp16 configs; a float32 (or dtype-less: gpt2) config is served in fp16 by vLLM
    return 2 * layers * kv_heads * head_dim * nbytes


def transformers_cache_bytes_per_token(name: str, length: int = 16) -> int:
    """Bytes per token transformers' StaticCache holds after the model's own attention filled it (a forward
    on the meta device: shapes from the model's code, nothing allocated)."""
    import transformers

    from memest.sources.hf_masks import real_mask_branches

    cfg = load_config(f"hf:{name}")
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}[model_dtype(cfg)]
    cfg.use_cache = True
    with torch.device("meta"):
        model = _build_meta(cfg).to(dtype)
        cache = transformers.StaticCache(config=cfg, max_cache_len=length)
        with torch.inference_mode(), real_mask_branches():
            model(input_ids=torch.zeros((1, length), dtype=torch.long), past_key_values=cache, use_cache=True,
                  cache_position=torch.arange(length))
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers) // length


@pytest.mark.parametrize("name", DECODERS)
def test_kv_bytes_per_token_is_the_config_arithmetic(name):
    raw = json.loads((BUNDLED / f"{name}.json").read_text())
    kv = model_kv(load_config(f"hf:{name}"))
    assert kv.bytes_per_token == config_arithmetic(raw)
    # and what transformers' own attention writes into a static cache, per token
    assert kv.bytes_per_token == transformers_cache_bytes_per_token(name)


def test_bundled_decoders_are_all_covered():
    assert {"gpt2", "llama-3-8b", "llama-3.1-8b", "mistral-7b", "mixtral-8x7b", "qwen3-30b-a3b"} <= set(DECODERS)
    assert "bert-base-uncased" not in DECODERS and "t5-base" not in DECODERS


def test_kv_heads_per_rank_and_fp8():
    cfg = load_config("hf:llama-3-8b")  # 8 KV heads
    assert model_kv(cfg, tp=2).bytes_per_token == model_kv(cfg).bytes_per_token // 2
    assert model_kv(cfg, tp=16).layers[0].kv_heads == 1  # replicated: at least one per rank
    assert model_kv(cfg, kv_dtype="fp8").bytes_per_token == model_kv(cfg).bytes_per_token // 2


def test_mla_latent_per_token():
    from transformers import DeepseekV3Config

    cfg = DeepseekV3Config(num_hidden_layers=4, kv_lora_rank=512, qk_rope_head_dim=64, torch_dtype="bfloat16")
    kv = model_kv(cfg, tp=8)
    assert {x.kind for x in kv.layers} == {MLA}
    assert kv.bytes_per_token == 4 * (512 + 64) * 2  # one latent, not split by TP, no separate V


def test_sliding_window_layers_follow_vllm():
    cfg = load_config("hf:mistral-7b")  # sliding_window 4096 on every layer
    kv = model_kv(cfg)
    assert {x.kind for x in kv.layers} == {SLIDING}
    page = kv.layers[0].page_bytes(16)
    # SlidingWindowSpec.max_memory_usage_bytes: (cdiv(min(w - 1 + batched, len), 16) + 1) pages
    assert kv.layers[0].max_memory_usage_bytes(16, 32768, 8192) == (math.ceil((4095 + 8192) / 16) + 1) * page
    assert kv.layers[0].max_memory_usage_bytes(16, 1000, 8192) == (math.ceil(1000 / 16) + 1) * page
    qwen = load_config("hf:qwen3-30b-a3b")  # use_sliding_window false
    assert {x.kind for x in model_kv(qwen).layers} == {FULL}


# ------------------------------------------------------------------------------- budget arithmetic

LLAMA8 = ModelKV([LayerKV(FULL, 8, 128, 2)] * 32, "bfloat16")  # 131072 B/token, 2 MiB per block of 16


def test_blocks_are_floored_per_layer_and_page():
    page = 16 * 8 * 128 * 2 * 2
    assert page == 65536
    exact = 1952 * page * 32
    assert kv_layout(LLAMA8, exact, 16, 20000, 20000).blocks == 1952
    assert kv_layout(LLAMA8, exact - 1, 16, 20000, 20000).blocks == 1951
    lay = kv_layout(LLAMA8, exact, 16, 20000, 20000)
    assert lay.tokens == 1952 * 16
    assert lay.blocks_per_request == math.ceil(20000 / 16)
    assert lay.concurrency == pytest.approx(1952 / 1250)  # vLLM's log: 1.56x
    assert kv_layout(LLAMA8, -5, 16, 20000, 20000).blocks == 0


def test_vllm_budget_steps():
    parts = [Part.exact("weights", int(14.9888 * GiB), "t"), Part("act", GiB, GiB // 2, 2 * GiB, "t")]
    b = vllm_budget(int(23.58 * GiB), 0.9, parts, LLAMA8, 16, 20000, 20000)
    assert b.requested_bytes == int(int(23.58 * GiB) * 0.9)
    assert b.available.bytes == b.requested_bytes - sum(p.bytes for p in parts)
    assert b.available.low == b.requested_bytes - int(14.9888 * GiB) - 2 * GiB
    assert b.available.high == b.requested_bytes - int(14.9888 * GiB) - GiB // 2
    assert b.layout_low.tokens <= b.layout.tokens <= b.layout_high.tokens


def test_hybrid_groups_split_the_pool():
    # 10 full + 20 sliding layers: groups of 10 layers, 3 groups; tokens = blocks // 3 x block
    kv = ModelKV([LayerKV(FULL, 8, 128, 2)] * 10 + [LayerKV(SLIDING, 8, 128, 2, 1024)] * 20, "bf16")
    page = kv.layers[0].page_bytes(16)
    lay = kv_layout(kv, page * 10 * 3000, 16, 8192, 2048)
    assert (lay.layers_per_pool, lay.groups, lay.blocks) == (10, 3, 3000)
    assert lay.tokens == 1000 * 16
    per_request = math.ceil(8192 / 16) + 2 * (math.ceil(min(1023 + 2048, 8192) / 16) + 1)
    assert lay.blocks_per_request == per_request


def test_longest_context_is_the_largest_length_that_fits():
    avail = 1478 * 32 * 65536  # vllm#10517 29k: "the maximum number of tokens ... in KV cache (23648)"
    assert longest_context(LLAMA8, avail, 16, 29000, 10**6) == 23648
    assert request_bytes(LLAMA8, 16, 23648, 29000) <= avail < request_bytes(LLAMA8, 16, 23649, 29000)
    assert longest_context(LLAMA8, 0, 16, 8192, 10**6) == 0


def test_sglang_arithmetic():
    fraction, _ = sglang_default_fraction(81559 * 2**20, 1)  # H100 80GB as nvidia-smi reports it
    assert fraction == round((81559 - 10240) / 81559, 3)
    ctx = Part.exact("ctx", 500 * 2**20, "t")
    total, weights = 80 * GiB, 15 * GiB
    g = sglang_budget(total, 0.88, "t", ctx, weights, LLAMA8, 8192)
    before = total - ctx.bytes
    assert g.tokens == int(((before - weights) - before * 0.12) // 131072)


# ---------------------------------------------------------------------------------------- weights


def test_weights_match_vllms_logged_load():
    cfg = load_config("hf:llama-3.1-8b")
    w = weights_per_rank(_build_meta(cfg), cfg, 1, "bfloat16")
    # "Loading model weights took 14.9888 GB" (vllm#10517): 8,030,261,248 bf16 params + the 131072 x 128 rope cache
    assert w.parameters == 8_030_261_248
    assert w.bytes == 8_030_261_248 * 2 + 131072 * 128 * 2
    assert round(w.bytes / GiB, 4) == 14.9888


@pytest.mark.parametrize("name,tp", [("llama-3-8b", 2), ("tinyllama-1.1b", 4)])
def test_weights_from_the_traced_rank_equal_the_split_rule(name, tp):
    spec = ServeSpec(f"hf:{name}", 80 * GiB, "h100", tp=tp, max_num_batched_tokens=256, max_num_seqs=8)
    cfg = load_config(spec.model)
    plan = plan_serve(spec, cfg)
    assert plan.weights.bytes == weights_per_rank(_build_meta(cfg), cfg, tp, "bfloat16").bytes


# ------------------------------------------------------------------------------------- plan + CLI


def test_plan_will_not_start_names_reason_and_fixes():
    plan = plan_serve(ServeSpec("hf:llama-3.1-8b", int(23.58 * GiB), "rtx3090", max_model_len=60000,
                                max_num_batched_tokens=2048, max_num_seqs=64, cuda_graphs="after"))
    assert plan.verdict == "will-not-start"
    assert any("check_enough_kv_cache_memory" in r for r in plan.reasons)
    # issue 22 item 12: only fixes that make it start are printed; the length that fits with the expected costs
    # reaches only 'may-not-start', the length that surely fits starts
    assert any(f.startswith(f"--max-model-len {plan.longest_context_low}") for f in plan.fixes)
    assert any(f.startswith("--kv-dtype fp8") for f in plan.fixes)
    assert 0 < plan.longest_context < 60000


def test_cli_serve_json():
    result = CliRunner().invoke(app, ["serve", "hf:gpt2", "--gpu", "h100", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["verdict"] == "starts" and doc["kv_bytes_per_token"] == 36864
    assert doc["kv_tokens"] == doc["blocks"] * 16
    assert doc["kv_tokens_low"] <= doc["kv_tokens"] <= doc["kv_tokens_high"]
    assert doc["schema_version"] == 1


def test_cli_serve_exit_codes():
    runner = CliRunner()
    bad = runner.invoke(app, ["serve", "hf:llama-2-70b", "--gpu", "rtx3090", "--fail-if-not-starts", "--json"])
    assert bad.exit_code == 1, bad.output
    assert json.loads(bad.stdout)["verdict"] == "will-not-start"
    usage = runner.invoke(app, ["serve", "hf:gpt2", "--gpu", "h100", "--gpu-memory-utilization", "1.5"])
    assert usage.exit_code == 2
    assert runner.invoke(app, ["serve", "examples/mlp.py", "--gpu", "h100"]).exit_code == 2


# ------------------------------------------------------------------------------ check gate, colocate


CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def test_check_gates_serving_configs():
    runner = CliRunner()
    ok = runner.invoke(app, ["check", str(CONFIGS / "llama-3-8b-serve-h100.yaml"), "--json"])
    assert ok.exit_code == 0, ok.output
    row = json.loads(ok.stdout)["configs"][0]
    assert row["verdict"] == "fits" and row["seq"] == 8192
    bad = runner.invoke(app, ["check", str(CONFIGS / "llama-3.1-8b-serve-rtx3090-too-long.yaml"), "--json"])
    assert bad.exit_code == 1, bad.output  # vLLM refused this start-up (vllm#10517)
    assert json.loads(bad.stdout)["configs"][0]["verdict"] == "does-not-fit"


def test_serve_config_keys_are_checked(tmp_path):
    from memest.errors import MemestError
    from memest.spec.config import load_config as load_run_config

    cfg = tmp_path / "s.yaml"
    cfg.write_text("model: hf:gpt2\ngpu: h100\nserve: {max_model_len: 1024, min_concurency: 4}\n")
    with pytest.raises(MemestError, match="did you mean 'min_concurrency'"):
        load_run_config(cfg)
    cfg.write_text("model: hf:gpt2\ngpu: h100\nserve: {engine: vlm}\n")
    with pytest.raises(MemestError, match="did you mean 'vllm'"):
        load_run_config(cfg)
    cfg.write_text("model: hf:gpt2\ngpu: h100\nserve: {tp: two}\n")
    with pytest.raises(MemestError, match="whole number"):
        load_run_config(cfg)


def test_colocate_arithmetic():
    from memest.serve.colocate import colocate

    plan = plan_serve(ServeSpec("hf:llama-3.2-1b", 80 * GiB, "h100", max_model_len=768, utilization=0.3,
                                max_num_seqs=8, max_num_batched_tokens=4096))
    c = colocate((20 * GiB, 21 * GiB, 22 * GiB), 80 * GiB, 0.3, plan)
    assert c.engine_bytes == int(80 * GiB * 0.3)
    assert c.headroom_bytes == 80 * GiB - 21 * GiB - c.engine_bytes
    assert c.verdict == "fits" and c.engine_starts
    assert c.largest_utilization == math.floor((80 - 22) / 80 * 100) / 100
    too_big = colocate((60 * GiB, 62 * GiB, 64 * GiB), 80 * GiB, 0.3, plan)
    assert too_big.verdict == "does-not-fit"


def test_estimate_colocate_serve_flag():
    result = CliRunner().invoke(app, ["estimate", "hf:llama-3.2-1b", "--batch", "1", "--seq", "128", "--precision",
                                      "bf16-mixed", "--gpu", "h100", "--colocate-serve", "0.95", "--json",
                                      "--fail-if-not-fits"])
    assert result.exit_code == 1, result.output  # 95% for the engine leaves no room for the step
    doc = json.loads(result.stdout)
    assert doc["colocate"]["verdict"] == "does-not-fit" and doc["verdict"] == "does-not-fit"


def test_python_api_serve():
    import memest

    doc = memest.serve_capacity("hf:tinyllama-1.1b", gpu="h100", max_model_len=2048, max_num_seqs=16,
                       max_num_batched_tokens=512)
    assert doc["verdict"] == "starts" and doc["kv_tokens"] == doc["blocks"] * 16
    assert doc["kv_bytes_per_token"] == 2 * 22 * 4 * 64 * 2
    with pytest.raises(memest.MemestError, match="unknown option"):
        memest.serve_capacity("hf:gpt2", gpu="h100", max_len=5)


def test_sglang_refuses_when_the_weights_exceed_the_static_share():
    plan = plan_serve(ServeSpec("hf:llama-2-70b", int(79.22 * GiB), "h100", engine="sglang", tp=2, utilization=0.8))
    g = plan.sglang
    assert plan.verdict == "will-not-start" and g.tokens == 0
    smallest = math.ceil(g.weights_bytes / g.free_before_load * 10000) / 10000
    assert plan.fixes[0].startswith(f"--gpu-memory-utilization {smallest:.4f}")
    ok = plan_serve(ServeSpec("hf:llama-2-70b", int(79.22 * GiB), "h100", engine="sglang", tp=2,
                              utilization=min(smallest + 0.02, 1.0)))
    assert ok.sglang.tokens > 0


# ------------------------------------------------------------- safe verdicts, measured non-torch memory


RTX3090 = dict(max_num_batched_tokens=2048, max_num_seqs=64, cuda_graphs="after")


def test_starts_only_when_the_low_end_of_the_kv_range_holds_a_sequence():
    """A length between what surely fits and what fits with the expected costs: may not start, with its reason and
    fixes; the expected verdict no longer says 'starts'."""
    probe = plan_serve(ServeSpec("hf:llama-3.1-8b", int(23.58 * GiB), "rtx3090", max_model_len=1024, **RTX3090))
    sure, expected, best = probe.longest_context_low, probe.longest_context, probe.longest_context_high
    assert 0 < sure < expected < best
    assert probe.verdict == "starts" and probe.starts

    between = plan_serve(ServeSpec("hf:llama-3.1-8b", int(23.58 * GiB), "rtx3090", max_model_len=(sure + expected) // 2,
                                   **RTX3090))
    assert between.verdict == "may-not-start" and not between.starts
    assert any("high end of its range" in r for r in between.reasons)
    assert any(f.startswith(f"--max-model-len {sure}") for f in between.fixes)
    assert any(f.startswith("--non-torch-memory") for f in between.fixes)

    optimistic = plan_serve(ServeSpec("hf:llama-3.1-8b", int(23.58 * GiB), "rtx3090",
                                      max_model_len=(expected + best) // 2, **RTX3090))
    assert optimistic.verdict == "may-not-start"
    assert any("only with every cost at the low end" in r for r in optimistic.reasons)

    never = plan_serve(ServeSpec("hf:llama-3.1-8b", int(23.58 * GiB), "rtx3090", max_model_len=best + 4096, **RTX3090))
    assert never.verdict == "will-not-start"

    from memest.serve.colocate import colocate  # an engine that may not start makes a colocated run at best tight

    c = colocate((GiB // 2, GiB // 2, GiB // 2), int(23.58 * GiB), 0.9, between)
    assert c.verdict == "tight" and not c.engine_starts
    assert any("may not start" in n for n in c.notes)


def test_sequences_reported_at_both_ends():
    doc = CliRunner().invoke(app, ["serve", "hf:llama-3-8b", "--gpu", "h100", "--max-model-len", "8192", "--json"])
    d = json.loads(doc.stdout)
    assert d["sequences_low"] <= d["sequences"] <= d["sequences_high"]
    assert d["concurrency_low"] <= d["concurrency"] <= d["concurrency_high"]
    lay_low = d["budget"]["layout_low"]
    assert d["sequences_low"] == lay_low["sequences"] == int(lay_low["blocks"] / lay_low["blocks_per_request"])
    assert d["non_torch_calibrated"] is False and d["non_torch"]["low"] < d["non_torch"]["high"]


def test_non_torch_memory_flag_replaces_the_evidence():
    """The measured value is subtracted as given (no range), and the rest of the budget is unchanged."""
    from memest.app import run_serve

    args = dict(model="hf:llama-3.1-8b", max_model_len=20000, max_num_batched_tokens=20000, max_num_seqs=256,
                cuda_graphs="after")
    plain = run_serve(args, "rtx3090").plan
    measured = run_serve({**args, "non_torch_memory": 0.35}, "rtx3090").plan
    nt = measured.non_torch
    assert nt.bytes == nt.low == nt.high == round(0.35 * GiB) and "--non-torch-memory 0.35" in nt.source
    b, p = measured.vllm, plain.vllm
    assert b.available.bytes == p.available.bytes - (nt.bytes - plain.non_torch.bytes)
    assert [x for x in b.parts if x.name != nt.name] == [x for x in p.parts if x.name != nt.name]
    assert b.layout.blocks == b.available.bytes // b.layout.page_bytes // 32 and b.layout.tokens == b.layout.blocks * 16


def test_calibration_profile_replaces_non_torch_and_context(tmp_path):
    from memest.device.calibration import load_profile

    path = Path(__file__).resolve().parent.parent / "profiles" / "h100-cuda13.0-torch2.11.json"
    prof = load_profile(path)
    r = CliRunner().invoke(app, ["serve", "hf:llama-3-8b", "--gpu", "h100", "--calibration", str(path), "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["non_torch"]["bytes"] == prof["cublas_library_bytes"] and d["non_torch_calibrated"]
    assert str(path) in d["non_torch"]["source"] and d["context"]["bytes"] == prof["context_bytes"]
    tp2 = CliRunner().invoke(app, ["serve", "hf:llama-3-8b", "--gpu", "h100", "--tp", "2", "--calibration", str(path),
                                   "--json"])
    assert json.loads(tp2.stdout)["non_torch"]["bytes"] == prof["cublas_library_bytes"] + prof["nccl_library_bytes"]
    both = CliRunner().invoke(app, ["serve", "hf:llama-3-8b", "--gpu", "h100", "--calibration", str(path),
                                    "--non-torch-memory", "0.2", "--json"])
    assert json.loads(both.stdout)["non_torch"]["bytes"] == round(0.2 * GiB)  # the log's own figure wins
    assert CliRunner().invoke(app, ["serve", "hf:gpt2", "--gpu", "h100", "--non-torch-memory", "-1"]).exit_code == 2
    sg = json.loads(CliRunner().invoke(app, ["serve", "hf:gpt2", "--gpu", "h100", "--engine", "sglang",
                                             "--non-torch-memory", "0.3", "--json"]).stdout)
    assert any("measured non-torch value is not used" in n for n in sg["notes"])


def test_check_serve_config_non_torch_key_and_may_not_start(tmp_path):
    probe = plan_serve(ServeSpec("hf:llama-3.1-8b", int(23.58 * GiB), "rtx3090", max_model_len=1024, **RTX3090))
    length = (probe.longest_context_low + probe.longest_context) // 2
    cfg = tmp_path / "s.yaml"
    cfg.write_text(f"model: hf:llama-3.1-8b\ngpu: rtx3090\nserve: {{max_model_len: {length}, max_num_seqs: 64, "
                   "max_num_batched_tokens: 2048, cuda_graphs: after}\n")
    r = CliRunner().invoke(app, ["check", str(cfg), "--json"])
    assert r.exit_code == 0, r.output  # tight passes unless --strict
    assert json.loads(r.stdout)["configs"][0]["verdict"] == "tight"
    assert CliRunner().invoke(app, ["check", str(cfg), "--strict", "--json"]).exit_code == 1
    cfg.write_text(cfg.read_text().replace("cuda_graphs: after", "cuda_graphs: after, non_torch_memory: 0.05"))
    measured = json.loads(CliRunner().invoke(app, ["check", str(cfg), "--json"]).stdout)["configs"][0]
    assert measured["verdict"] == "fits" and "--non-torch-memory 0.05" in measured["calibration"]


def test_non_torch_ranges_hold_the_published_values_of_their_arithmetic():
    from memest.serve import evidence

    for gib, _gpu, build, tp, url in evidence.NON_TORCH_PUBLISHED:
        assert url.startswith("https://github.com/")
        if "current arithmetic" not in build:
            continue
        low, _, high = evidence.NON_TORCH_TP1 if tp == 1 else evidence.NON_TORCH_TP
        assert low - 0.005 * GiB <= gib * GiB <= high + 0.005 * GiB, (gib, build)

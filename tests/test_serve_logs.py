"""memest serve against published vLLM V1 start-up logs (llm-d's DEBUG-level logs on H100s, v0.11.0 image):
the budget arithmetic on the logs' own components reproduces their KV memory / tokens, the sampler's sort-path
bytes are the tensors PyTorch's CUDA sort allocates, and memest's own uncalibrated prediction is within 1%."""

from __future__ import annotations

import pytest

from memest.serve.budget import Part
from memest.serve.kv import FULL, LayerKV, ModelKV
from memest.serve.profile import SAMPLER_AFTER_SORT, sampler_sort_extra
from memest.serve.vllm import vllm_budget

GiB = 2**30
# https://github.com/llm-d/llm-d-benchmark/blob/4f4d449/config_explorer/empirical-vllm-memory-results.md


def budget(total, util, weights, activation, non_torch, layers, kv_heads, block, max_len):
    kv = ModelKV([LayerKV(FULL, kv_heads, 128, 2)] * layers, "bfloat16")
    parts = [Part.exact(n, int(v * GiB), "log") for n, v in
             (("weights", weights), ("activation", activation), ("non-torch", non_torch))]
    return vllm_budget(int(total * GiB), util, parts, kv, block, max_len, 8192)


def test_llama_31_8b_v1_log_kv_memory():
    # 'Free memory on device (78.57/79.18 GiB)', 0.9 -> 71.26 GiB; 14.99 + 4.76 + 0.13; 'Available KV cache memory: 51.38'
    b = budget(79.18, 0.90, 14.99, 4.76, 0.13, 32, 8, 128, 16000)
    assert round(b.requested_bytes / GiB, 2) == 71.26
    assert abs(b.available.bytes / GiB - 51.38) <= 0.005 + 1e-9


def test_mistral_small_v1_log_tokens_and_blocks():
    # utilization 0.95 of 79.19 GiB; 44.76 + 2.12 + 0.14; 'GPU KV cache size: 184,832 tokens' = 1,444 blocks of 128
    b = budget(79.19, 0.95, 44.76, 2.12, 0.14, 40, 8, 128, 16000)
    assert b.layout.blocks == 1444
    assert b.layout.tokens == 184832
    assert b.layout.concurrency == pytest.approx(11.55, abs=0.005)  # 'Maximum concurrency for 16,000 tokens: 11.55x'


def test_llama_33_70b_fp8_v1_logs_tp2_starts_tp1_refused():
    tp2 = budget(79.18, 0.90, 33.88, 4.84, 0.55, 80, 4, 128, 16000)
    assert abs(tp2.available.bytes / GiB - 32.0) <= 0.01  # 'Available KV cache memory: 32.0 GiB'
    tp1 = budget(79.18, 0.90, 67.72, 4.84, 0.14, 80, 8, 128, 16000)
    assert abs(tp1.available.bytes / GiB + 1.44) <= 0.01  # '-1.44 GiB', 'No available memory for the cache blocks'
    assert tp1.layout.blocks == 0


def test_sampler_sort_path_bytes_are_the_sort_tensors():
    # >= 128 rows (segmented_sort_pairs): values 4 + indices 8 + reverse indices 8 + cub's alternate keys 4, values 8
    assert sampler_sort_extra(1024) == sampler_sort_extra(128) == 32
    # 2-127 rows (segmented_sort_pairs_by_full_sort): outputs 12 + two int2 buffers 16 + keys out 4 + cub 4 + 8
    assert sampler_sort_extra(64) == 44
    assert sampler_sort_extra(1) == 24
    assert all(sampler_sort_extra(r) >= SAMPLER_AFTER_SORT for r in (1, 2, 127, 128, 4096))


def test_uncalibrated_prediction_of_the_v1_llama_log_within_one_percent():
    """memest's own figures (weights from the config, the traced profile run, the evidence non-torch range) on
    llm-d's Llama-3.1-8B V1 log; the GPU total is memest's H100 card (79.22 GiB), not the log's 79.18."""
    import memest

    d = memest.serve_capacity("hf:llama-3.1-8b", gpu="h100", max_model_len=16000, block_size=128,
                              cuda_graphs="after")
    kv = d["kv_cache_bytes"] / GiB
    assert abs(kv - 51.38) / 51.38 <= 0.01, kv
    assert d["kv_cache_bytes_low"] / GiB <= 51.38 + 0.005 <= d["kv_cache_bytes_high"] / GiB + 0.01
    activation = next(p for p in d["budget"]["parts"] if p["name"].startswith("activation"))["bytes"] / GiB
    assert abs(activation - 4.76) <= 0.1, activation  # DEBUG line 'torch peak memory increase: 4.76GiB'
    assert d["verdict"] == "starts"


def test_default_utilization_says_newer_vllm_uses_092():
    from memest.serve.plan import ServeSpec, plan_serve

    small = dict(max_num_batched_tokens=256, max_num_seqs=8, max_model_len=2048)
    default = plan_serve(ServeSpec("hf:tinyllama-1.1b", 80 * GiB, "h100", **small))
    assert default.utilization == 0.9
    assert any("0.92" in n and "cache.py" in n for n in default.notes)
    given = plan_serve(ServeSpec("hf:tinyllama-1.1b", 80 * GiB, "h100", utilization=0.92, **small))
    assert not any("0.92" in n and "cache.py" in n for n in given.notes)

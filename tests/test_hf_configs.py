"""Bundled hf: configs build from config alone (no weights, no network) with the published
parameter counts, and trace a step with inputs that follow the model's head."""

import json

import pytest
from torch._subclasses.fake_tensor import FakeTensorMode
from typer.testing import CliRunner

from memest.cli import app
from memest.sources import load_source
from memest.sources.hf import bundled_names
from memest.trace.values import PlaceholderScalars

# Parameter counts as published on the models' cards / papers.
PUBLISHED = {
    "gpt2": 124_439_808,
    "gpt2-medium": 354_823_168,
    "gpt2-large": 774_030_080,
    "gpt2-xl": 1_557_611_200,
    "bert-base-uncased": 109_514_298,  # BertForMaskedLM (no pooler)
    "bert-large-uncased": 335_174_458,
    "llama-2-7b": 6_738_415_616,
    "llama-3-8b": 8_030_261_248,
    "llama-2-70b": 68_976_648_192,
    "mistral-7b": 7_241_732_096,
    # the models people fine-tune most (issue 12): each config's "_source" names its hub repository; counts
    # are the repositories' safetensors totals
    "llama-3.1-8b": 8_030_261_248,
    "qwen2.5-7b": 7_615_616_512,
    "gemma-2-9b": 9_241_705_984,
    "phi-3-mini": 3_821_079_552,
    "t5-base": 222_903_552,
    "vit-base": 86_567_656,
}


# Mixture-of-experts totals as their cards publish them, in billions (rounded): Mixtral-8x7B "46.7B"
# (mistral.ai/news/mixtral-of-experts), Qwen3-30B-A3B "30.5B in total and 3.3B activated" (its model card).
PUBLISHED_BILLIONS = {"mixtral-8x7b": 46.7, "qwen3-30b-a3b": 30.5}


def test_every_required_config_is_bundled():
    assert set(PUBLISHED) | set(PUBLISHED_BILLIONS) <= set(bundled_names())


@pytest.mark.parametrize("name", sorted(PUBLISHED_BILLIONS))
def test_bundled_moe_config_builds_fake_with_published_size(name):
    source = load_source(f"hf:{name}")
    with FakeTensorMode(), PlaceholderScalars():
        model = source.build_model()
    count = sum(p.numel() for p in model.parameters())
    assert round(count / 1e9, 1) == PUBLISHED_BILLIONS[name], count
    assert model.config._experts_implementation == "grouped_mm"  # transformers' default: routing-independent buffers


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_bundled_config_builds_fake_with_published_size(name):
    source = load_source(f"hf:{name}")
    with FakeTensorMode(), PlaceholderScalars():  # as the tracer builds it
        model = source.build_model()
    assert sum(p.numel() for p in model.parameters()) == PUBLISHED[name]
    assert model.config.use_cache is False


@pytest.mark.parametrize("name,seq", [("bert-base-uncased", 64), ("t5-base", 64), ("vit-base", None)])
def test_heads_get_matching_inputs_and_trace(name, seq):
    args = ["estimate", f"hf:{name}", "--batch", "1", "--json", "--gpu", "80GiB"]
    if seq:
        args += ["--seq", str(seq)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["param_count"] == PUBLISHED[name]
    assert doc["breakdown_at_peak"]["optimizer_state"] > 0


def test_llama_7b_traces_without_real_memory():
    """A 7B model at seq 4096 needs >100 GiB; tracing it must not allocate any of that."""
    import resource

    result = CliRunner().invoke(app, ["estimate", "hf:llama-2-7b", "--batch", "1", "--seq", "512", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["peak_allocated_bytes"] > 4 * doc["param_bytes"]  # weights, grads, 2 Adam states at least
    max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    assert max_rss < 3 * 2**30, f"RSS {max_rss / 2**30:.2f} GiB"

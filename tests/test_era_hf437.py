"""The benchmark's transformers 4.37 causal LM (scripts/models/hf437_causal_lm.py, used to score fsdp_qlora's 2024
runs, benchmarks/gpu-scale.md): memest traces it as the real CPU run allocates, it holds what its docstring says
beyond transformers 5's model (the fp32 logits kept in the output, the rotary caches), and --precision bf16 leaves
the QLoRA runs' fp32 caches in fp32."""

import torch

from memest.features.registry import trace_step
from memest.sources import load_source
from memest.spec import RunSpec
from memest.trace.dtype import cast_floating
from memest.trace.events import Category
from memest.validate.cpu_truth import measure_cpu_peak

from .conftest import model_ref
from .models.llama_tiny_hf437 import HEADS, HIDDEN, LAYERS, MAX_POS, VOCAB, build_fp32_cache

CACHES = LAYERS * 2 * MAX_POS * (HIDDEN // HEADS)  # cos_cached + sin_cached per layer, elements


def _trace(factory: str, precision="fp32", batch=2, seq=32):
    ref = model_ref(f"llama_tiny_hf437:{factory}")
    spec = RunSpec(model=ref, target="cpu", batch=batch, seq=seq, optim="adamw", precision=precision)
    source = load_source(ref)
    return trace_step(source, spec), source, spec


def _buffer_bytes(trace) -> int:
    return sum(r.nbytes for r in trace.storages if r.category == Category.BUFFERS and r.iteration == 0)


def test_era_model_traced_as_the_real_cpu_run():
    for factory in ("build_model", "build_fp32_cache"):  # fp32: the byte-exact CPU claim (bf16 runs oneDNN on AMX)
        trace, source, spec = _trace(factory)
        real = measure_cpu_peak(source, spec)["peak_bytes"]
        assert abs(trace.peak()[0] - real) <= 0.001 * real, (factory, trace.peak()[0], real)


def test_rotary_caches_held_in_the_runs_dtypes():
    today, _, _ = _trace("build_today", precision="bf16")
    lora, _, _ = _trace("build_model", precision="bf16")
    qlora, _, _ = _trace("build_fp32_cache", precision="bf16")
    inv_freq = LAYERS * (HIDDEN // HEADS // 2)
    # LoRA: bf16 buffers (2 bytes), inv_freq cast to bf16 with them; QLoRA: fp32 buffers the bf16 cast leaves alone,
    # inv_freq among them (4 bytes), still buffers, which FSDP1's wrap moves with their layer
    assert _buffer_bytes(lora) - _buffer_bytes(today) == CACHES * 2 + inv_freq * 2
    assert _buffer_bytes(qlora) - _buffer_bytes(today) == CACHES * 4 + inv_freq * 4
    cast = cast_floating(build_fp32_cache(), torch.bfloat16)
    caches = {n: b.dtype for n, b in cast.named_buffers() if ".self_attn.rotary_emb." in n}
    assert caches == {f"model.layers.{i}.self_attn.rotary_emb.{b}": torch.float32
                      for i in range(LAYERS) for b in ("inv_freq", "cos_cached", "sin_cached")}
    assert cast.lm_head.weight.dtype == torch.bfloat16  # the rest is cast


def test_era_model_keeps_fp32_logits_through_backward():
    """bf16 model: transformers 5 keeps the head's bf16 logits in the output, 4.37 the fp32 upcast (2 bytes more
    per logit, N/2 in fp32 logits); at the loss's backward both hold the saved log-softmax, its incoming and its
    outgoing gradient, over the N(seq-1)/seq shifted logits in 4.37 and over all N in 5 (which shifts the labels):
    the era's peak is higher by N/2 - 3N/seq fp32 logits."""
    batch, seq = 4, 64  # the loss's tensors above the weights and AdamW state: the peak at the loss
    today, _, _ = _trace("build_today", precision="bf16", batch=batch, seq=seq)
    era, _, _ = _trace("build_model", precision="bf16", batch=batch, seq=seq)
    logits_fp32 = batch * seq * VOCAB * torch.float32.itemsize
    gap = era.peak()[0] - today.peak()[0] - CACHES * 2
    assert gap >= logits_fp32 * (1 / 2 - 3 / seq), (gap, logits_fp32)

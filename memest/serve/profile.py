"""vLLM's profile run, traced on fake tensors: the activation peak that start-up subtracts.

vLLM runs one forward of max_num_batched_tokens tokens (vllm/v1/worker/gpu_model_runner.py
``GPUModelRunner.profile_run`` -> ``_dummy_run(max_num_tokens, is_profile=True)``; attention is skipped
while no KV cache exists), then the sampler on the last hidden state of each of min(max_num_seqs,
max_num_batched_tokens) requests with top-k and top-p on (``_dummy_sampler_run``). The torch peak above the
weights during both is the "torch peak increase" (vllm/utils/mem_utils.py ``memory_profiling``).

memest traces the same forward with transformers' implementation of the model (one sequence of
max_num_batched_tokens tokens, logits for the last R positions), split as on one tensor-parallel rank (heads
and MLP width / tp), under --target cuda kernel semantics. The sampler phase is the hidden states of the
forward plus the sampler's own tensors, from vllm/v1/sample/ (below).
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field

from memest.serve.budget import Part
from memest.serve.kv import DTYPE_BYTES
from memest.spec import RunSpec

# The sampler phase's bytes per logit element (R rows x vocab), from the tensors vLLM's sampler holds at
# once. compute_logits output in the model dtype (held by the caller) + the fp32 copy Sampler.forward makes
# (vllm/v1/sample/sampler.py ``logits.to(torch.float32)``) + top-k/top-p on the PyTorch sort path
# (vllm/v1/sample/ops/topk_topp_sampler.py ``apply_top_k_top_p``: ``logits.sort`` -> fp32 values + int64
# indices; then a bool top-k mask, softmax into fp32 probs_sort with cumsum in place, a bool top-p mask and the
# scatter's fp32 output). The peak is inside the sort, whose CUDA implementation allocates beside its two outputs
# (PyTorch aten/src/ATen/native/cuda/SortStable.cu ``launch_stable_sort_kernel``):
#   - >= 128 rows: ``segmented_sort_pairs``: an int64 reverse-index input (8 B per element) and cub's
#     DeviceSegmentedRadixSort::SortPairs, whose non-DoubleBuffer form keeps alternate key and value buffers in its
#     temporary storage (4 + 8 B; nvidia.github.io/cccl/cub/api/structcub_1_1DeviceSegmentedRadixSort.html);
#   - 2-127 rows: ``segmented_sort_pairs_by_full_sort``: two int2 index-and-segment buffers (8 + 8 B), the keys
#     output radix_sort_pairs allocates when given none (4 B) and cub's alternate key and int2 value buffers (4 + 8 B);
#   - 1 row: ``segmented_sort_large_segments``: one row of indices (negligible) and cub's alternates (4 + 8 B).
# After the sort these are freed; what apply_top_k_top_p holds at its scatter (sorted values 4, indices 8, top-k
# mask 1, probs 4, top-p mask 1, output 4 = 22 B) is less than the sort's peak.
# Low end: a fused top-k/top-p kernel (FlashInfer, or the Triton path newer releases take for >= 8
# requests) that keeps only the fp32 probabilities beside the logits.
SAMPLER_SORT_OUTPUTS = 4 + 8  # sorted fp32 values, int64 indices
SAMPLER_AFTER_SORT = 4 + 8 + 1 + 4 + 1 + 4  # sorted values, indices, top-k mask, probs, top-p mask, scatter output


def sampler_sort_extra(rows: int) -> int:
    """Bytes per logit element the PyTorch sort path holds at its peak beyond the model-dtype and fp32 logits
    (the sort's outputs and transients, by which of PyTorch's CUDA sort paths ``rows`` rows take; see above)."""
    if rows >= 128:
        transient = 8 + (4 + 8)  # reverse indices + cub's alternate keys and values
    elif rows >= 2:
        transient = 8 + 8 + 4 + (4 + 8)  # two int2 buffers + keys output + cub's alternate keys and int2 values
    else:
        transient = 4 + 8  # cub's alternate keys and values
    return max(SAMPLER_SORT_OUTPUTS + transient, SAMPLER_AFTER_SORT)


SAMPLER_FUSED_EXTRA = 4  # probabilities


@dataclass
class ProfileRun:
    activation: Part  # torch peak increase above the weights (what vLLM subtracts)
    forward_peak_bytes: int  # traced forward: allocated peak above the weights
    sampler_peak_bytes: int  # sampler phase, expected (sort path)
    tokens: int
    logit_rows: int
    seconds: float
    notes: list[str] = field(default_factory=list)
    model: object = field(default=None, repr=False)  # the rank's model as traced (fake tensors)
    split: bool = True  # the model is one rank's (heads and MLP divided); False: traced unsplit

    def to_dict(self) -> dict:
        return {"activation": self.activation.to_dict(), "forward_peak_bytes": self.forward_peak_bytes,
                "sampler_peak_bytes": self.sampler_peak_bytes, "tokens": self.tokens, "logit_rows": self.logit_rows,
                "trace_seconds": self.seconds, "notes": self.notes}


def rank_config(config, tp: int):
    """The config of one tensor-parallel rank: attention heads, KV heads (at least one) and MLP widths
    divided by tp, the head size kept (transformers' head_dim); the hidden size stays whole."""
    if tp == 1:
        return config, []
    heads = getattr(config, "num_attention_heads", None)
    if heads is None or not hasattr(config, "head_dim") and getattr(config, "model_type", "") == "gpt2":
        return config, [f"the profile forward is traced unsplit for this architecture (tp {tp}): its activation "
                        "peak is an upper bound"]
    c = copy.deepcopy(config)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    c.head_dim = head_dim
    c.num_attention_heads = max(1, heads // tp)
    kv = getattr(config, "num_key_value_heads", None) or heads
    c.num_key_value_heads = max(1, kv // tp)
    for name in ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size", "ffn_dim"):
        if getattr(c, name, None):
            setattr(c, name, -(-getattr(c, name) // tp))
    return c, [f"profile forward traced as one of {tp} ranks: {c.num_attention_heads} heads, "
               f"{c.num_key_value_heads} KV heads, MLP width / {tp} (logits all-gathered to the full vocabulary)"]


def trace_profile_run(config, tp: int, tokens: int, logit_rows: int, dtype: str,
                      compute_capability: tuple[int, int]) -> ProfileRun:
    """Trace the forward of ``tokens`` tokens on one rank and price the sampler phase."""
    import time

    import torch
    import transformers

    from memest.estimator import estimate
    from memest.sources.base import ModelSource
    from memest.sources.hf_masks import real_mask_branches

    rank, notes = rank_config(config, tp)
    split = tp == 1 or rank is not config
    rank = copy.deepcopy(rank)
    rank.use_cache = False
    positions = getattr(rank, "max_position_embeddings", 0) or 0
    # never a sequence longer than the model's positions: vLLM's profile run spreads its tokens over up to
    # max_num_seqs requests (gpu_model_runner.py _dummy_run), so a short-context model's forward is several sequences
    batch = -(-tokens // positions) if positions and positions < tokens else 1
    seq, keep = -(-tokens // batch), -(-min(logit_rows, tokens) // batch)
    if batch > 1:
        notes.append(f"profile forward traced as {batch} sequences of {seq} tokens (the model has {positions} "
                     f"positions; vLLM spreads the {tokens} tokens over up to max_num_seqs requests)")
    arch = (getattr(rank, "architectures", None) or [None])[0]
    cls = getattr(transformers, arch, None) if arch else None
    if cls is None:
        cls = transformers.AutoModelForCausalLM._model_mapping[type(rank)]
    rows = min(logit_rows, tokens)

    def inputs(batch_size: int, seq_len: int | None = None):
        return {"input_ids": torch.zeros((batch, seq), dtype=torch.long), "logits_to_keep": keep}

    built = []

    def build():
        built.append(cls(rank))
        return built[-1]

    source = ModelSource(name=f"vLLM profile run ({tokens} tokens)", build_model=build,
                         example_inputs=inputs, trace_context=lambda spec: real_mask_branches())
    precision = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}[dtype]
    spec = RunSpec(model="serve-profile", batch=batch, seq=seq, mode="inference", precision=precision,
                   compute_capability=compute_capability)
    start = time.perf_counter()
    est = estimate(spec, source=source)
    seconds = time.perf_counter() - start
    report = est.report
    resident = report.param_bytes + report.other_at_peak.get("buffers", 0)
    allocated = report.device.allocated_peak_bytes if report.device is not None else report.peak_allocated_bytes
    forward = max(allocated - resident, 0)
    hidden = int(getattr(config, "hidden_size", None) or config.n_embd)
    size = DTYPE_BYTES[dtype]
    if re.search(r"layers\.([1-9]|\d\d+)\b", report.module_at_peak or ""):
        # transformers' LlamaModel.forward (and its kin) keeps `inputs_embeds` referenced through the layer
        # loop; vLLM's model forward (vllm/model_executor/models/llama.py LlamaModel.forward) does not, and
        # updates the residual in place (fused_add_rms_norm): one tokens x hidden tensor less at a later
        # layer's peak
        forward = max(forward - tokens * hidden * size, 0)
        notes.append("profile forward: the embedding output transformers keeps referenced through the layers is "
                     "not held by vLLM's forward (one tokens x hidden tensor subtracted)")
    vocab = int(config.vocab_size)
    sampler, sampler_low = sampler_phase(config, tokens, rows, dtype)
    expected = max(forward, sampler)
    low = max(forward, sampler_low)
    notes.append(f"profile run: forward of {tokens} tokens traced ({forward / 2**30:.2f} GiB above the weights); "
                 f"sampler on {rows} requests x {vocab} vocab ({sampler / 2**30:.2f} GiB, top-k/top-p sort path; "
                 f"{sampler_low / 2**30:.2f} GiB with a fused kernel)")
    part = Part(ACTIVATION_NAME, expected, low, expected,
                "traced forward of max_num_batched_tokens tokens (transformers' code, --target cuda) and the sampler "
                "phase (vllm/v1/sample); gpu_model_runner.py profile_run")
    return ProfileRun(part, forward, sampler, tokens, rows, seconds, notes, built[-1], split)


ACTIVATION_NAME = "activation peak (profile run)"
TRACED: dict = {}  # the process's traced profile runs (serve/vllm.py _profile), at most TRACED_KEPT of them
TRACED_KEPT = 32


def remember(cache: dict, key, value) -> None:
    """Keep ``value`` under ``key``, dropping the oldest entry past TRACED_KEPT (each holds a few numbers)."""
    cache[key] = value
    while len(cache) > TRACED_KEPT:
        del cache[next(iter(cache))]


def sampler_phase(config, tokens: int, rows: int, dtype: str) -> tuple[int, int]:
    """The sampler phase's bytes on ``rows`` requests: the PyTorch sort path (expected) and a fused top-k/top-p
    kernel (low); see SAMPLER_SORT_OUTPUTS above. No trace: arithmetic on the config."""
    hidden = int(getattr(config, "hidden_size", None) or config.n_embd)
    size, vocab = DTYPE_BYTES[dtype], int(config.vocab_size)
    held = tokens * hidden * size + 2 * rows * hidden * size  # hidden states of the forward, last rows, rand_like
    logits = rows * vocab * (size + 4)  # model-dtype logits + the sampler's fp32 copy
    return held + logits + rows * vocab * sampler_sort_extra(rows), held + logits + rows * vocab * SAMPLER_FUSED_EXTRA


def profile_floor(config, tokens: int, logit_rows: int, dtype: str) -> ProfileRun:
    """A lower bound of the profile run without tracing it: the activation peak is max(traced forward, sampler
    phase) at every end of its range, so the sampler phase alone bounds it from below. A plan with this floor that
    does not start cannot start with the traced run either (less activation only leaves more KV cache): the fixes'
    re-check uses it to skip traces that cannot change the answer."""
    rows = min(logit_rows, tokens)
    sampler, sampler_low = sampler_phase(config, tokens, rows, dtype)
    part = Part(ACTIVATION_NAME, sampler, sampler_low, sampler, "lower bound: the sampler phase alone (not traced)")
    return ProfileRun(part, 0, sampler, tokens, rows, 0.0, ["profile run not traced: its lower bound only"])

"""Make transformers take, on fake tensors, the attention-mask branch it takes on real ones.

transformers skips building a causal mask (and lets SDPA use ``is_causal``) after checking tensor
*values* — no padding, no packed sequences. On fake tensors it cannot read values, so it builds a
batch x 1 x seq x seq mask that the real run never allocates (and that would also rule out flash
attention). memest generates the inputs of ``hf:`` models itself — no attention_mask, contiguous
positions — so it knows what those checks would find, and answers them here.

A transformers model built in a model file (or a Python-API factory) gets the same answers
(:func:`holds_transformers_model`, checked after the build): the checks read values only of an
``attention_mask`` (then the original check runs: with a mask the trace builds the 4-D mask, the
conservative branch) and of ``position_ids``, which are answered as contiguous, one sequence per
row — a model file passing packed sequences (several per row) is traced as unpacked. The patch is
harmless for other models, which never call transformers' masking code.
"""

from __future__ import annotations

import contextlib
import sys


def holds_transformers_model(model) -> bool:
    """Whether ``model`` is or contains a transformers PreTrainedModel (peft wraps one, a user's module
    may hold one). Never imports transformers: a model built without it holds none."""
    if "transformers" not in sys.modules:
        return False
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    return any(isinstance(m, PreTrainedModel) for m in model.modules())


@contextlib.contextmanager
def real_mask_branches():
    try:
        from transformers import masking_utils as mu
    except ImportError:
        yield
        return
    orig_ignore = getattr(mu, "_ignore_causal_mask_sdpa", None)
    orig_packed = getattr(mu, "find_packed_sequence_indices", None)
    if orig_ignore is None or orig_packed is None:  # another transformers layout: leave it alone
        yield
        return

    def ignore_causal_mask(padding_mask, q_length, kv_length, q_offset, kv_offset, local_attention_size=None):
        if padding_mask is None:  # what the real check concludes without padding (see masking_utils)
            if local_attention_size is not None and kv_length >= local_attention_size:
                return False
            # training (q == kv), decoding (q == 1), or a prefill into an empty cache (q_offset == 0):
            # memest's inputs are always one of these, and the real check then skips the mask
            return True
        return orig_ignore(padding_mask, q_length, kv_length, q_offset, kv_offset, local_attention_size)

    def packed_sequences(position_ids):
        orig_packed(position_ids)  # same temporaries as the real check
        return None  # memest's position ids are contiguous: one sequence per row

    mu._ignore_causal_mask_sdpa = ignore_causal_mask
    mu.find_packed_sequence_indices = packed_sequences
    try:
        yield
    finally:
        mu._ignore_causal_mask_sdpa = orig_ignore
        mu.find_packed_sequence_indices = orig_packed

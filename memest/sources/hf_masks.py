"""Make transformers take, on fake tensors, the attention-mask branch it takes on real ones.

transformers skips building a causal mask (and lets SDPA use ``is_causal``) after checking tensor
*values* — no padding, no packed sequences. On fake tensors it cannot read values, so it builds a
batch x 1 x seq x seq mask that the real run never allocates (and that would also rule out flash
attention). memest generates the inputs of ``hf:`` models itself — no attention_mask, contiguous
positions — so it knows what those checks would find, and answers them here.
"""

from __future__ import annotations

import contextlib


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

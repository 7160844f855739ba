"""Answer transformers' value checks on the inputs memest built, as the real run does.

Some transformers models validate their inputs by reading tensor values: LLaVA asserts (with
``torch._check_tensor_all``) that there are as many image tokens as image features; Wav2Vec2ForCTC
raises ``if labels.max() >= vocab_size``; its CTC loss drops padding labels with ``masked_select`` and
hands the kernel lengths it reads from tensors. Fake tensors have no values, so the fake step fails
where the real one, on the same inputs, passes. memest built those inputs and knows what the reads
find (as hf_masks.py knows there is no padding); the contexts here answer them:

- ``KnownValues``: a dispatch mode over the fake one. An input memest built with a known value range
  (label ids) keeps it through max/min; a comparison of such a value with a number that the range
  decides is a known boolean; reading it returns that boolean. ``torch._check_tensor_all`` (the op
  ``_is_all_true``) is an assertion that the real run passes on memest's inputs (built to match), so
  it reads True. Every other read still fails, as it should.
  A boolean mask the model makes from host data (SpecAugment's ``torch.tensor(numpy mask)`` in
  wav2vec2-style models) keeps its count of True values (through views and expand), so indexing
  with it (``grad[mask]`` in the backward of ``hidden[mask] = embed``) has its real size: the count
  of the fake run's own random draw (a real run draws another, of about the same count).
- ``known_length_ctc``: transformers' ForCTCLoss with its lengths as the numbers they hold on
  memest's inputs (every example has all its frames and all its labels).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakTensorKeyDictionary

aten = torch.ops.aten
# scalar reads: the op, and item() and is_nonzero() (`if tensor:`), which reach a dispatch mode undecomposed
# under inference_mode
READS = {aten._local_scalar_dense.default, aten.item.default, aten.is_nonzero.default}
IS_ALL_TRUE = aten._is_all_true.default
_KEEP_RANGE = {aten.max.default, aten.min.default, aten.amax.default, aten.amin.default}
_LIFTS = {aten.lift_fresh.default, aten.lift_fresh_copy.default}
# ops whose output holds the same values (same count of True) as their input
_SAME_VALUES = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.unsqueeze.default,
                aten.alias.default, aten.detach.default, aten._to_copy.default, aten.clone.default}
# ops with no tensor input whose values follow from their arguments (torch.arange over a read size)
_VALUE_FACTORIES = {aten.arange.default, aten.arange.start, aten.arange.start_step, aten.scalar_tensor.default}
REAL_LIMIT = 1 << 20  # elements: real values are followed only on small (index-sized) tensors
_COMPARE = {
    aten.ge.Scalar: lambda lo, hi, x: (lo >= x, hi >= x),
    aten.gt.Scalar: lambda lo, hi, x: (lo > x, hi > x),
    aten.le.Scalar: lambda lo, hi, x: (hi <= x, lo <= x),
    aten.lt.Scalar: lambda lo, hi, x: (hi < x, lo < x),
}


class KnownValues(TorchDispatchMode):
    """While entered, reads decided by the known value ranges of ``ranges`` (tensor -> (lo, hi),
    inclusive) are answered; see the module docstring."""

    # trace/recompute.py may replay a checkpointed block's recomputation under this mode (its ops not run): where
    # what the mode follows of the block's inputs is the same (replay_key), and it follows none of what the
    # recomputation saved or returned (holds)
    replay_transparent = True

    def __init__(self, ranges: WeakTensorKeyDictionary, real: WeakTensorKeyDictionary | None = None) -> None:
        super().__init__()
        self.ranges = ranges
        self.real = real if real is not None else WeakTensorKeyDictionary()  # fake input -> its real values
        self.known = WeakTensorKeyDictionary()  # 0-d boolean tensor -> its value
        self.true_count = WeakTensorKeyDictionary()  # boolean mask -> how many of its values are True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in READS and args[0] in self.known:
            return self.known[args[0]]
        if self.real and func not in READS:
            followed = self._follow_real(func, args, kwargs)
            if followed is not None:
                return followed
        elif func in READS and args[0] in self.real:
            from torch._subclasses.fake_tensor import unset_fake_temporarily

            with unset_fake_temporarily():
                return self.real[args[0]].item()
        if func is aten.index.Tensor:
            counted = self._index_by_mask(*args, **kwargs)
            if counted is not None:
                return counted
        out = func(*args, **kwargs)
        if func in _LIFTS and args[0].dtype == torch.bool:  # torch.tensor(host data): its values are here
            from torch._subclasses.fake_tensor import unset_fake_temporarily

            with unset_fake_temporarily():
                self.true_count[out] = int(args[0].sum())
        elif func in _SAME_VALUES and args[0] in self.true_count and out.dtype == torch.bool:
            self.true_count[out] = self.true_count[args[0]]
        elif func is aten.expand.default and args[0] in self.true_count:
            self.true_count[out] = self.true_count[args[0]] * out.numel() // max(1, args[0].numel())
        elif func is IS_ALL_TRUE:
            self.known[out] = True
        elif func in _KEEP_RANGE and args[0] in self.ranges and not kwargs:
            self.ranges[out] = self.ranges[args[0]]
        elif func in _COMPARE and args[0] in self.ranges and isinstance(args[1], (int, float)):
            always, sometimes = _COMPARE[func](*self.ranges[args[0]], args[1])
            if always or not sometimes:  # the range decides it
                self.known[out] = always
        return out

    def replay_key(self, tensors: list) -> tuple:
        """What the mode knows of each tensor: its real values (dtype, shape and a digest of the bytes), value range,
        known value, count of True values."""
        import hashlib

        from torch.utils._python_dispatch import _disable_current_modes

        out = []
        for t in tensors:
            real = self.real.get(t)
            if real is not None:
                with _disable_current_modes():  # every mode off: SAC's (above this one) must not see these ops
                    data = real.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
                real = (real.dtype, tuple(real.shape), hashlib.sha256(data).digest())
            out.append((real, self.ranges.get(t), self.known.get(t), self.true_count.get(t)))
        return tuple(out)

    def holds(self, t: torch.Tensor) -> bool:
        return t in self.real or t in self.ranges or t in self.known or t in self.true_count

    def _follow_real(self, func, args, kwargs):
        """An op on small inputs whose real values memest built (a VLM's image_grid_thw, input_ids): the fake
        op as usual (its memory traced), and the same op on the real values beside it, so that the model's
        reads of them (tolist, item, nonzero's count) find what the real run finds. An op whose output size
        depends on values (nonzero, repeat_interleave) gets a fake output of the real one's size."""
        from torch._subclasses.fake_tensor import unset_fake_temporarily
        from torch.utils._pytree import tree_flatten, tree_map

        if func in _LIFTS and args[0].numel() <= REAL_LIMIT:  # torch.tensor(host data): its values are here
            out = func(*args, **kwargs)
            with unset_fake_temporarily():
                self.real[out] = args[0].clone()
            return out
        tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        if not tensors and func not in _VALUE_FACTORIES:
            return None
        if not all(t in self.real for t in tensors):
            return None
        if any(self.real[t].numel() > REAL_LIMIT for t in tensors):
            return None
        with unset_fake_temporarily():
            real_args, real_kwargs = tree_map(lambda a: self.real[a] if isinstance(a, torch.Tensor) else a, (args, kwargs))
            real_out = func(*real_args, **real_kwargs)
        try:
            out = func(*args, **kwargs)
        except Exception:  # a value-dependent size (nonzero, unique_consecutive): fakes of the real outputs' sizes
            if not all(isinstance(r, torch.Tensor) for r in tree_flatten(real_out)[0]):
                raise
            out = tree_map(lambda r: torch.empty(r.shape, dtype=r.dtype), real_out)
        outs, reals = tree_flatten(out)[0], tree_flatten(real_out)[0]
        for fake, real in zip(outs, reals, strict=False):
            if isinstance(fake, torch.Tensor) and isinstance(real, torch.Tensor) and real.numel() <= REAL_LIMIT:
                self.real[fake] = real
        return out

    def _index_by_mask(self, tensor, indices):
        """``tensor[mask]`` for a mask of known count: (count, *the dimensions the mask does not cover)."""
        if len(indices) != 1 or indices[0] is None or indices[0] not in self.true_count:
            return None
        mask = indices[0]
        return tensor.new_empty((self.true_count[mask], *tensor.shape[mask.dim():]))


class TensorOfKnown(torch.overrides.TorchFunctionMode):
    """``torch.tensor(list of 0-d tensors)`` reads each element's data directly (not through dispatch): an
    element whose real value KnownValues follows is handed over as that value (Qwen2-VL's get_rope_index
    builds ``torch.tensor(mrope_position_deltas)`` so)."""

    def __init__(self, known: KnownValues) -> None:
        super().__init__()
        self.known = known

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.tensor and args and isinstance(args[0], (list, tuple)):
            from torch._subclasses.fake_tensor import unset_fake_temporarily
            from torch.utils._pytree import tree_map

            def value(x):
                if isinstance(x, torch.Tensor) and x in self.known.real:
                    with unset_fake_temporarily():
                        return self.known.real[x].item()
                return x

            args = (tree_map(value, list(args[0])), *args[1:])
        return func(*args, **kwargs)


def known_length_ctc(original):
    """transformers' ForCTCLoss (transformers/loss/loss_ctc.py) where every example has all its frames
    (memest passes no attention mask) and all its labels (none is padding or blank): the same ops, with
    the lengths as Python numbers instead of tensors the kernel reads, and the targets that
    ``masked_select`` keeps (all of them) as a copy of the labels (same bytes)."""

    def loss(logits, labels, logit_lengths, blank_token_id, reduction="mean", zero_infinity=False,
             ignore_index=-100, **kwargs):
        labels = labels.to(logits.device)
        labels_mask = (labels != ignore_index) & (labels != blank_token_id)
        labels_mask.sum(-1)  # target_lengths: each row holds labels.shape[1]
        flattened_targets = labels.reshape(-1).clone()  # masked_select keeps every label
        log_probs = torch.nn.functional.log_softmax(logits, dim=-1, dtype=torch.float32).transpose(0, 1)
        frames, batch, count = logits.shape[1], logits.shape[0], labels.shape[1]
        with torch.backends.cudnn.flags(enabled=False):
            per_example = torch.nn.functional.ctc_loss(
                log_probs, flattened_targets, (frames,) * batch, (count,) * batch,
                blank=blank_token_id, reduction="none", zero_infinity=zero_infinity,
            )
        # the reduction of ctc_loss_impl (LossCTC.cpp), whose at::tensor(target_lengths) cannot be made fake
        if reduction == "mean":
            lengths = torch.full((batch,), count, dtype=per_example.dtype, device=per_example.device).clamp_min(1)
            return (per_example / lengths).mean()
        return per_example.sum() if reduction == "sum" else per_example

    loss.__wrapped__ = original
    return loss


@contextlib.contextmanager
def known_values(ranges: WeakTensorKeyDictionary, ctc: bool, real: WeakTensorKeyDictionary | None = None) -> Iterator[None]:
    """The mode, and for a CTC head transformers' CTC loss with known lengths."""
    with contextlib.ExitStack() as stack:
        if ctc:
            stack.enter_context(_ctc_loss_patched())
        mode = stack.enter_context(KnownValues(ranges, real))
        if real is not None:
            stack.enter_context(TensorOfKnown(mode))
        yield


@contextlib.contextmanager
def _ctc_loss_patched() -> Iterator[None]:
    try:
        from transformers.loss.loss_utils import LOSS_MAPPING
    except ImportError:
        yield
        return
    original = LOSS_MAPPING.get("ForCTC")
    if original is None:
        yield
        return
    LOSS_MAPPING["ForCTC"] = known_length_ctc(original)
    try:
        yield
    finally:
        LOSS_MAPPING["ForCTC"] = original

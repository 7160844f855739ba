"""memest's fake kernels (trace/fake_kernels.py) against the real CPU kernels they stand for: the same
outputs (size, strides, bytes of storage) and the same refusals, and torch's own answers back at exit."""

import logging

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from memest.trace.fake_kernels import real_fake_kernels

OFFS = [3, 8]  # 2 groups over 8 rows (the second holds 5)


def _grouped_cases():
    # (name, mat_a, mat_b, offs): transformers' forward (2d x 3d: input @ weight.T, the weight a transposed
    # view), its backward (2d x 2d: the weight gradient, 2d x 3d: the input gradient) and bmm (3d x 3d)
    return [
        ("forward", lambda d: torch.randn(8, 16, dtype=d), lambda d: torch.randn(2, 24, 16, dtype=d).transpose(-2, -1), True),
        ("forward, N not 16-byte aligned", lambda d: torch.randn(8, 16, dtype=d),
         lambda d: torch.randn(2, 6, 16, dtype=d).transpose(-2, -1), True),
        ("weight gradient", lambda d: torch.randn(8, 16, dtype=d).t(), lambda d: torch.randn(8, 24, dtype=d), True),
        ("input gradient", lambda d: torch.randn(8, 24, dtype=d), lambda d: torch.randn(2, 24, 16, dtype=d), True),
        ("bmm", lambda d: torch.randn(2, 8, 16, dtype=d), lambda d: torch.randn(2, 16, 24, dtype=d), False),
    ]


def _layout(t: torch.Tensor):
    return tuple(t.shape), t.stride(), t.dtype, t.untyped_storage().nbytes()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", _grouped_cases(), ids=lambda c: c[0])
def test_grouped_mm_fake_output_is_the_real_kernels(case, dtype):
    _, make_a, make_b, with_offs = case
    torch.manual_seed(0)
    a, b = make_a(dtype), make_b(dtype)
    offs = torch.tensor(OFFS, dtype=torch.int32) if with_offs else None
    real = torch._grouped_mm(a, b, offs=offs)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode, real_fake_kernels():
        fa, fb = mode.from_tensor(a), mode.from_tensor(b)
        fo = mode.from_tensor(offs) if offs is not None else None
        fake = torch._grouped_mm(fa, fb, offs=fo)
    assert _layout(fake) == _layout(real)


def test_an_unaligned_output_is_padded_as_the_real_one():
    """The real kernel pads each output row to 16 bytes (GroupedMMUtils.h); 6 fp32 columns take 8."""
    a, b = torch.randn(8, 16), torch.randn(2, 6, 16).transpose(-2, -1)
    real = torch._grouped_mm(a, b, offs=torch.tensor(OFFS, dtype=torch.int32))
    assert real.stride() == (8, 1) and real.untyped_storage().nbytes() == (7 * 8 + 6) * 4


@pytest.mark.parametrize(
    "a,b,needle",
    [
        (torch.randn(8, 16).to(torch.float64), torch.randn(2, 16, 24).to(torch.float64), "Float32, BFloat16 or Float16"),
        (torch.randn(8, 16), torch.randn(2, 16, 6), "multiple of 16 bytes"),  # contiguous (2, 16, 6): rows of 24 B
    ],
)
def test_grouped_mm_fake_refuses_what_the_real_kernel_refuses(a, b, needle):
    offs = torch.tensor(OFFS, dtype=torch.int32)
    with pytest.raises(RuntimeError, match=needle.split()[0]):
        torch._grouped_mm(a, b, offs=offs)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode, real_fake_kernels():
        with pytest.raises(RuntimeError, match=needle.split()[0]):
            torch._grouped_mm(mode.from_tensor(a), mode.from_tensor(b), offs=mode.from_tensor(offs))


def test_torch_meta_refuses_float32_and_is_back_after_the_context():
    """Why the kernel exists (torch 2.13's meta kernel checks the CUDA bf16 fast path only) and that
    it is undone: fresh shapes, so FakeTensorMode's class-wide cache cannot answer."""
    logging.getLogger("torch._subclasses.fake_tensor").setLevel(logging.CRITICAL)
    a, b = torch.randn(40, 16), torch.randn(2, 16, 32)
    offs = torch.tensor([20, 40], dtype=torch.int32)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fa, fb, fo = mode.from_tensor(a), mode.from_tensor(b), mode.from_tensor(offs)
        with pytest.raises(RuntimeError, match="BF16"):
            torch._grouped_mm(fa, fb, offs=fo)
        with real_fake_kernels():
            assert torch._grouped_mm(fa, fb, offs=fo).shape == (40, 32)
        with pytest.raises(RuntimeError, match="BF16"):
            torch._grouped_mm(fa, fb, offs=fo)
    meta = torch._grouped_mm(a.to("meta").bfloat16(), b.to("meta").bfloat16(), offs=offs.to("meta"))
    assert meta.shape == (40, 32)  # the Meta dispatch key itself was never touched


@pytest.mark.parametrize("targets_2d", [False, True])
@pytest.mark.parametrize("target_lengths", [[5, 5, 5], [3, 7, 1]])
def test_ctc_loss_fake_outputs_are_the_real_kernels(targets_2d, target_lengths):
    frames, batch, classes = 30, 3, 12
    log_probs = torch.randn(frames, batch, classes).log_softmax(-1)
    if targets_2d:
        targets = torch.randint(1, classes, (batch, max(target_lengths) + 2))
    else:
        targets = torch.randint(1, classes, (sum(target_lengths),))
    lengths = [frames] * batch
    real = torch.ops.aten._ctc_loss(log_probs, targets, lengths, target_lengths, 0, False)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode, real_fake_kernels():
        fake = torch.ops.aten._ctc_loss(mode.from_tensor(log_probs), mode.from_tensor(targets), lengths, target_lengths, 0, False)
    assert [_layout(t) for t in fake] == [_layout(t) for t in real]


def test_ctc_loss_is_refused_by_fake_tensors_without_the_kernel():
    """_ctc_loss is tagged dynamic_output_shape, so FakeTensorMode refuses it although its shapes come
    from int arguments."""
    from torch._subclasses.fake_tensor import DynamicOutputShapeException

    log_probs, targets = torch.randn(30, 2, 12).log_softmax(-1), torch.randint(1, 12, (10,))
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        with pytest.raises(DynamicOutputShapeException):
            torch.ops.aten._ctc_loss(mode.from_tensor(log_probs), mode.from_tensor(targets), [30, 30], [5, 5], 0, False)

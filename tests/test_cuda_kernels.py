"""--target cuda kernel semantics beyond attention (targets/cuda/kernels.py, conv.py, rnn.py): the bytes
each CUDA kernel saves or allocates, hand-worked from PyTorch's sources, and cross-checked against the
per-op measurements taken on an H100 (benchmarks/gpu-probe.json from scripts/probe_cuda.py and
benchmarks/gpu-kernels.json from scripts/probe_cuda_kernels.py; torch 2.11.0+cu130, cuDNN 9.19)."""

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from memest.errors import MemestError
from memest.estimator import estimate
from memest.features.registry import trace_step
from memest.sources.base import ModelSource
from memest.spec import RunSpec
from memest.targets.cuda.rnn import RnnShape
from memest.trace import Category

from .conftest import model_ref

ROOT = Path(__file__).resolve().parent.parent
KERNELS = json.loads((ROOT / "benchmarks" / "gpu-kernels.json").read_text())  # measured on an H100
PROBE = json.loads((ROOT / "benchmarks" / "gpu-probe.json").read_text())["ops"]["ops"]  # measured on an H100


class Op(nn.Module):
    """One op on given inputs (inputs and parameters are not activations, so only the op's bytes show)."""

    def __init__(self, fn, module=None):
        super().__init__()
        self.fn, self.inner = fn, module
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, *xs):
        return self.fn(self.inner, *xs) + self.scale  # an add saves nothing


def trace_op(fn, shapes, module=None, dtype=torch.float32, target="cuda", grad=True, **spec):
    def inputs(batch, seq=None):
        return tuple(torch.randn(*s, dtype=dtype, requires_grad=grad) for s in shapes)

    def build():  # the trace casts the model to the spec's precision
        return Op(fn, module() if module else None)

    spec = RunSpec(model="op", optim="sgd", iterations=1, target=target,
                   precision={torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype], **spec)
    return trace_step(ModelSource("op", build, inputs), spec)


def saved(trace, op_prefix=""):
    return [r for r in trace.storages if r.category is Category.ACTIVATIONS and r.op.startswith(op_prefix)]


def scratch(trace, op_prefix):
    return [r.nbytes for r in trace.storages if r.op == f"{op_prefix} (kernel scratch)"]


def measured(group, case, op):
    """The first record of ``op`` in a gpu-kernels.json case (real CUDA allocations)."""
    records = KERNELS["groups"][group]["cases"][case]["records"]
    return next(r for r in records if r["op"] == op)


# -- dropout -----------------------------------------------------------------------------------------


def test_dropout_saves_a_one_byte_mask_on_cuda():
    """Dropout.cpp: a CUDA input takes native_dropout, whose mask is bool (1 B/element); the CPU path
    saves a noise tensor in the input's dtype."""
    shape = (32, 512, 768)
    n = math.prod(shape)
    cuda = saved(trace_op(lambda _, x: F.dropout(x, 0.1, True), [shape]))
    cpu = saved(trace_op(lambda _, x: F.dropout(x, 0.1, True), [shape], target="cpu"))
    assert [r.nbytes for r in cuda] == [n]
    assert [r.nbytes for r in cpu] == [4 * n]
    # H100 probe (gpu-probe.json dropout_fp32): saved 12,582,912 B on CUDA, 50,331,648 B on CPU
    assert PROBE["dropout_fp32"]["cuda"]["saved_bytes"] == n
    assert PROBE["dropout_fp32"]["cpu"]["saved_bytes"] == 4 * n


def test_dropout_off_or_in_eval_allocates_nothing():
    """_dropout_impl returns its input when p == 0 or not training (torch's Python decomposition of
    dropout would clone it: 67 MB too many on examples/transformer.py)."""
    for p, train in ((0.0, True), (0.1, False)):
        trace = trace_op(lambda _, x, p=p, train=train: F.dropout(x, p, train), [(8, 64)])
        assert not [r for r in trace.storages if r.op.split(".")[0] in ("clone", "dropout", "native_dropout")]


# -- normalisation statistics ------------------------------------------------------------------------


def test_layer_norm_keeps_fp32_statistics_for_bf16_inputs():
    """layer_norm_kernel.cu: mean and rstd in acc_type (fp32); probe layer_norm_bf16: 65,536 B on CUDA
    (2 x 8 x 1024 x 4) vs 32,768 B on CPU."""
    trace = trace_op(lambda m, x: m(x), [(8, 1024, 768)], module=lambda: nn.LayerNorm(768), dtype=torch.bfloat16)
    stats = sorted(r.nbytes for r in saved(trace, "native_layer_norm") if r.nbytes < 10**6)
    assert stats == [8 * 1024 * 4] * 2
    assert sum(stats) == PROBE["layer_norm_bf16"]["cuda"]["saved_bytes"]


def test_batch_norm_keeps_fp32_statistics_for_bf16_inputs():
    """Normalization.cu: save_mean / save_invstd in fp32 for 16-bit inputs (probe batch_norm2d_bf16:
    two fp32 [64] tensors beside the bf16 running statistics)."""
    trace = trace_op(lambda m, x: m(x), [(4, 64, 8, 8)], module=lambda: nn.BatchNorm2d(64), dtype=torch.bfloat16)
    stats = sorted(r.nbytes for r in saved(trace) if r.nbytes < 4096)
    cuda_saved = PROBE["batch_norm2d_bf16"]["cuda"]["saved"]
    assert stats == [64 * 4] * 2 == sorted(s[0] for s in cuda_saved if s[1] == "torch.float32")


# -- cuDNN convolution workspaces ---------------------------------------------------------------------


def conv_scratch(n, cin, cout, hw, k, stride=1, pad=0, groups=1, dtype=torch.float32, **spec):
    trace = trace_op(lambda m, x: m(x), [(n, cin, hw, hw)],
                     module=lambda: nn.Conv2d(cin, cout, k, stride, pad, groups=groups, bias=False), dtype=dtype, **spec)
    return trace, scratch(trace, "convolution.default")


@pytest.mark.parametrize("case,shape,dtype", [
    # (gpu-kernels.json conv group case, (N, Cin, Cout, H, k, stride, pad), dtype): cases where the heuristic
    # engine staged input + output + weight
    ("stem_224_k7s2_fp32", (32, 3, 64, 224, 7, 2, 3), torch.float32),
    ("c512_14_k3_fp32", (32, 512, 512, 14, 3, 1, 1), torch.float32),
    ("c1024_7_k3_b64_fp32", (64, 1024, 1024, 7, 3, 1, 1), torch.float32),
    ("stem_224_k7s2_bf16", (32, 3, 64, 224, 7, 2, 3), torch.bfloat16),  # 3 channels staged as 8
])
def test_conv_forward_workspace_is_staged_operands(case, shape, dtype):
    n, cin, cout, hw, k, s, p = shape
    _, ws = conv_scratch(n, cin, cout, hw, k, s, p, dtype=dtype)
    out_hw = (hw + 2 * p - k) // s + 1
    e = dtype.itemsize
    cin_staged = cin if e == 4 else math.ceil(cin / 8) * 8
    x, y, w = n * cin_staged * hw * hw * e, n * cout * out_hw * out_hw * e, cout * cin_staged * k * k * e
    assert ws == [x + y + w]
    real = max(measured("conv", case, "aten.convolution.default")["transient"])
    assert 0 <= real - ws[0] <= 700  # the measured engines add 16-679 bytes


def test_pointwise_and_depthwise_convolutions_stage_nothing_but_keep_a_range():
    trace, ws = conv_scratch(32, 256, 64, 56, 1)
    assert ws == [0]
    x = 32 * 256 * 56 * 56 * 4
    low, high, _ = next(iter(trace.workspace_ranges.values()))
    assert (low, high) == (0, 10 * (x + x // 4 + 256 * 64 * 4))
    assert max(measured("conv", "c256to64_56_k1_fp32", "aten.convolution.default")["transient"]) <= 512
    _, ws = conv_scratch(32, 96, 96, 56, 7, pad=3, groups=96)
    assert ws == [0]
    assert not measured("conv", "dw_96_56_k7_fp32", "aten.convolution.default")["transient"]


def test_conv_backward_takes_the_larger_of_data_and_filter_workspaces():
    """ConvShared.cpp: backward-data then backward-filter, each workspace freed before the next."""
    trace, _ = conv_scratch(32, 512, 512, 14, 3, pad=1)
    ws = scratch(trace, "convolution_backward.default")
    x = dy = 32 * 512 * 14 * 14 * 4
    w = 512 * 512 * 9 * 4
    assert ws == [max(dy + x + w, x + dy + w)]
    # measured backward-data workspace: 35,127,312 B = dy + dx + w + 16 (gpu-kernels.json conv/c512_14_k3_fp32)
    assert 35_127_312 - ws[0] == 16


def test_cudnn_benchmark_search_is_unbounded_once_per_shape():
    """Conv_v8.cpp get_plans_from_find: the first call of a shape tries every plan whose workspace fits
    the free memory; later calls run the chosen plan."""
    spec = RunSpec(model="op", optim="sgd", iterations=2, cudnn_benchmark=True)
    source = ModelSource("op", lambda: Op(lambda m, x: m(x), nn.Conv2d(64, 64, 3, padding=1)),
                         lambda b, s=None: (torch.randn(8, 64, 16, 16, requires_grad=True),))
    trace = trace_step(source, spec)
    highs = [(trace.storages[sid].iteration, high) for sid, (_, high, _) in trace.workspace_ranges.items()]
    assert [h for it, h in highs if it == 1] == [None, None]  # forward and backward searched in step 1
    assert all(h is not None for it, h in highs if it == 2)


def test_cudnn_benchmark_is_a_cuda_option():
    with pytest.raises(MemestError, match="--cudnn-benchmark"):
        RunSpec(model="x.py", target="cpu", cudnn_benchmark=True)


def test_estimate_reports_the_workspace_range():
    spec = RunSpec(model=model_ref("cnn"), batch=16, optim="sgd")
    usage = estimate(spec, calibration=None).report.device
    ws = usage.workspaces
    assert ws.calls == 3 * 2 * spec.iterations  # 3 convolutions, forward and backward, in each traced step
    assert ws.low_allocated_bytes <= usage.allocated_peak_bytes <= ws.high_allocated_bytes
    bench = estimate(RunSpec(model=model_ref("cnn"), batch=16, optim="sgd", cudnn_benchmark=True),
                     calibration=None).report.device.workspaces
    assert bench.high_allocated_bytes is None and bench.unbounded


# -- cuDNN RNN ---------------------------------------------------------------------------------------

RNN_CASES = {  # gpu-kernels.json rnn cases: (mode, input, hidden, layers, seq, batch, bidirectional, dtype, proj)
    "lstm_512_512_L2_T128_B32": (2, 512, 512, 2, 128, 32, False, torch.float32, 0),
    "lstm_512_1024_L2_T128_B64": (2, 512, 1024, 2, 128, 64, False, torch.float32, 0),
    "lstm_512_512_L1_T128_B32_bi": (2, 512, 512, 1, 128, 32, True, torch.float32, 0),
    "lstm_512_512_L4_T128_B32": (2, 512, 512, 4, 128, 32, False, torch.float32, 0),
    "lstm_512_512_L2_T128_B32_fp16": (2, 512, 512, 2, 128, 32, False, torch.float16, 0),
    "lstm_512_1024_L1_T128_B32_proj256": (2, 512, 1024, 1, 128, 32, False, torch.float32, 256),
    "lstm_128_128_L1_T50_B8": (2, 128, 128, 1, 50, 8, False, torch.float32, 0),
    "gru_512_512_L2_T128_B32": (3, 512, 512, 2, 128, 32, False, torch.float32, 0),
    "gru_512_1024_L1_T64_B16": (3, 512, 1024, 1, 64, 16, False, torch.float32, 0),
    "rnn_tanh_512_512_L1_T128_B32": (1, 512, 512, 1, 128, 32, False, torch.float32, 0),
}


def rnn_shape(mode, inp, hidden, layers, seq, batch, bi, dtype, proj):
    x = torch.empty(batch, seq, inp, dtype=dtype, device="meta")
    return RnnShape(x, mode, hidden, proj, layers, True, bi, [])


@pytest.mark.parametrize("case", sorted(RNN_CASES))
def test_cudnn_rnn_reserve_matches_the_measured_bytes(case):
    real = measured("rnn", case, "aten._cudnn_rnn.default")["outputs"][3][0]
    assert rnn_shape(*RNN_CASES[case]).reserve_bytes() == real


@pytest.mark.parametrize("case", sorted(RNN_CASES))
def test_cudnn_rnn_workspace_fit_brackets_the_measured_bytes(case):
    ws = rnn_shape(*RNN_CASES[case]).workspace()
    real = measured("rnn", case, "aten._cudnn_rnn.default")["transient"][0]
    assert ws.low <= real <= ws.high
    backward = measured("rnn", case, "aten._cudnn_rnn_backward.default")["transient"][0]
    assert backward == real  # the backward allocates the same workspace


def test_lstm_saves_what_cudnn_saves():
    """_cudnn_rnn's autograd node saves hx, cx, output and the reserve (and the input and weights, which
    are not activations): probe lstm_fp32 saved 100,925,696 B on CUDA (282,877,952 B on CPU)."""
    trace = trace_op(lambda m, x: m(x)[0], [(32, 128, 512)], module=lambda: nn.LSTM(512, 512, 2, batch_first=True))
    total = sum(r.nbytes for r in saved(trace))
    assert total == PROBE["lstm_fp32"]["cuda"]["saved_bytes"]
    reserve = rnn_shape(*RNN_CASES["lstm_512_512_L2_T128_B32"]).reserve_bytes()
    assert reserve in [r.nbytes for r in saved(trace, "_cudnn_rnn")]
    assert any("cuDNN" in note for note in trace.notes)


def test_gru_saves_what_cudnn_saves():
    """probe gru_fp32: 58,786,048 B saved on CUDA (67,108,864 B on CPU)."""
    trace = trace_op(lambda m, x: m(x)[0], [(32, 128, 512)], module=lambda: nn.GRU(512, 512, 1, batch_first=True))
    assert sum(r.nbytes for r in saved(trace)) == PROBE["gru_fp32"]["cuda"]["saved_bytes"]


def test_bf16_rnn_is_not_cudnn():
    """cudnn_is_acceptable takes fp32, fp16 and fp64 only: a bf16 LSTM keeps the native path."""
    trace = trace_op(lambda m, x: m(x)[0], [(2, 8, 16)], module=lambda: nn.LSTM(16, 16), dtype=torch.bfloat16)
    assert not any("_cudnn_rnn" in r.op for r in trace.storages)


# -- embedding backward, mse_loss --------------------------------------------------------------------


class Embed(nn.Module):
    def __init__(self, vocab, dim):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)

    def forward(self, idx):
        return self.emb(idx)


def embedding_scratch(batch, seq):
    source = ModelSource("emb", lambda: Embed(50257, 768), lambda b, s=None: (torch.randint(0, 50257, (batch, seq)),))
    trace = trace_step(source, RunSpec(model="emb", optim="sgd", iterations=1))
    return scratch(trace, "embedding_dense_backward.default")


def test_embedding_backward_sorts_and_segments_above_3072_indices():
    """Embedding.cu / EmbeddingBackwardKernel.cu: grad_weight_per_segment holds one fp32 row per partial
    segment, sized for num_indices + num_indices / 10 of them: 9011 x 768 x 4 = 27,681,792 B for 8192
    indices, as measured (gpu-kernels.json embedding/gpt2_b8_T1024_random, also with 10 distinct tokens)."""
    ws = embedding_scratch(8, 1024)
    assert 9011 * 768 * 4 in ws
    for case in ("gpt2_b8_T1024_random", "gpt2_b8_T1024_10tok"):
        assert 27_681_792 in measured("embedding", case, "aten.embedding_dense_backward.default")["transient"]
    assert embedding_scratch(2, 1024) == []  # 2048 indices: the direct kernel, no scratch


def test_mse_loss_output_is_backed_by_an_input_sized_storage():
    """Loss.cpp mse_loss_out: the reduced 0-d loss lives in an input-sized storage, and the element-wise
    loss is a temporary of the same size (gpu-kernels.json misc/mse_mean_32M: 134,217,728 B each)."""
    shape = (32, 1024, 1024)
    n = math.prod(shape) * 4
    trace = trace_op(lambda _, x, y: F.mse_loss(x, y), [shape, shape])
    assert n in [r.nbytes for r in trace.storages if r.op == "mse_loss.default"]
    assert scratch(trace, "mse_loss.default") == [n]
    real = measured("misc", "mse_mean_32M", "aten.mse_loss.default")
    assert real["outputs"][0][0] == n and n in real["transient"]


def test_cudnn_benchmark_from_the_cli_and_a_config(tmp_path):
    from typer.testing import CliRunner

    from memest.cli import app
    from memest.spec.config import load_config

    result = CliRunner().invoke(app, ["estimate", model_ref("cnn"), "--batch", "4", "--optim", "sgd",
                                      "--cudnn-benchmark", "--json"])
    assert result.exit_code == 0, result.output
    workspaces = json.loads(result.stdout)["device"]["workspaces"]
    assert workspaces["high_allocated_bytes"] is None and workspaces["unbounded"]
    config = tmp_path / "run.yaml"
    config.write_text(f"model: {model_ref('cnn')}\ncudnn_benchmark: true\n")
    assert load_config(config).spec().cudnn_benchmark is True

"""--fp8 tensorwise|rowwise (features/fp8.py): torchao's convert_to_float8_training traced through torchao's own
Float8Linear on fake tensors. torch 2.13's CPU runs torch._scaled_mm (an emulation: targets/cpu/aten_scaled_mm.py),
so the whole float8 step runs for real here and the trace is checked against it to the byte
(validate/cpu_truth.py). No GPU figure is measured: on CUDA cuBLASLt multiplies the float8 operands directly, and
the trace of --target cuda is the same torchao code without the CPU emulation's float32 copies.

The tests that run torchao need it (memest[fp8]) and are skipped without it; the CPU kernel rule's and the
refusals' run without it."""

import importlib.util

import pytest
import torch

from memest.errors import MemestError
from memest.features.registry import trace_step
from memest.sources import load_source
from memest.spec import RunSpec
from memest.targets.cpu.aten_scaled_mm import scaled_mm_scratch
from memest.validate.cpu_truth import _allocation_events, _step_peak, measure_cpu_peak

from .conftest import model_ref, onednn

# the steps run ATen's CPU kernels, traced and real alike (conftest.aten_cpu_kernels: oneDNN's float8 matmul on an
# AMX CPU takes minutes per step); the kernel rule's test and test_onednn_float8_matmul_in_a_whole_step run oneDNN's
pytestmark = pytest.mark.usefixtures("aten_cpu_kernels")

needs_torchao = pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="torchao not installed (memest[fp8])")

F8 = torch.float8_e4m3fn
# (model, batch, seq): the transformer example's Linear layers are all multiples of 16; llama-tiny's too
CASES = [("transformer", 2, 64), ("hf:llama-tiny", 2, 128)]
PARAMS = [(case, recipe) for case in CASES for recipe in ("tensorwise", "rowwise")]


def _spec(name: str, batch: int, seq: int, fp8: str, **more) -> RunSpec:
    return RunSpec(model=model_ref(name), batch=batch, seq=seq, target="cpu", fp8=fp8, **{"optim": "sgd", **more})


@needs_torchao
@pytest.mark.parametrize("case,recipe", PARAMS, ids=[f"{c[0].removeprefix('hf:')}-{r}" for c, r in PARAMS])
def test_traced_peak_matches_the_real_float8_step_to_the_byte(case, recipe):
    spec = _spec(*case, recipe)
    trace = trace_step(load_source(spec.model), spec)
    real = measure_cpu_peak(load_source(spec.model), spec)["peak_bytes"]
    assert trace.peak()[0] == real, (trace.peak()[0], real)
    assert any(note.startswith(f"--fp8 {recipe}:") for note in trace.notes)


# with the other step options, tensorwise on the transformer example: B the trace may read below the real run
# (AdamW: the plain step's own residual, small scalars AdamW.step keeps alive; tests/test_optim_in_backward.py)
COMBOS = [({"checkpointing": "blocks"}, 0), ({"precision": "bf16-mixed"}, 0), ({"precision": "bf16"}, 0),
          ({"optim": "adamw"}, 16)]


@needs_torchao
@pytest.mark.parametrize("more,residual", COMBOS, ids=[next(iter(c[0].values())) for c in COMBOS])
def test_with_checkpointing_precisions_and_adamw(more, residual):
    spec = _spec("transformer", 2, 64, "tensorwise", **more)
    traced = trace_step(load_source(spec.model), spec).peak()[0]
    real = measure_cpu_peak(load_source(spec.model), spec)["peak_bytes"]
    assert 0 <= real - traced <= residual, (traced, real)


@needs_torchao
def test_float8_changes_the_real_peak_and_the_trace_follows():
    """The feature is not a no-op: the real float8 step's peak differs from the plain step's, as traced."""
    on, off = _spec("transformer", 2, 64, "tensorwise"), _spec("transformer", 2, 64, "none")
    real_on = measure_cpu_peak(load_source(on.model), on)["peak_bytes"]
    real_off = measure_cpu_peak(load_source(off.model), off)["peak_bytes"]
    assert real_on != real_off
    assert trace_step(load_source(on.model), on).peak()[0] - trace_step(load_source(off.model), off).peak()[0] == (
        real_on - real_off)


def _real_peak(fn) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return _step_peak(_allocation_events(prof))[0]


SHAPES = [(128, 256, 512), (8000, 128, 256), (128, 8000, 256), (32, 64, 1024)]
# every shape with oneDNN off (ATen's emulation), the two small ones with it on (oneDNN's float8 matmul where this CPU
# takes it, AMX: 11-19 s a call for the two long shapes, conftest.aten_cpu_kernels)
KERNELS = [(mkn, False) for mkn in SHAPES] + [(mkn, True) for mkn in SHAPES if max(mkn) < 8000]


@pytest.mark.parametrize("mkn,with_onednn", KERNELS, ids=[f"{'x'.join(map(str, c))}-{'onednn' if o else 'aten'}"
                                                          for c, o in KERNELS])
@pytest.mark.parametrize("rowwise", [False, True])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["nt", "tn"])
def test_cpu_scaled_mm_rule_matches_the_real_kernel(mkn, with_onednn, rowwise, out_dtype, layout):
    """targets/cpu/aten_scaled_mm.py against torch.profiler on the real CPU kernel: output + scratch == peak; with
    oneDNN off (ATen's emulation) and on (oneDNN's float8 matmul where this CPU takes it, AMX; the emulation
    elsewhere)."""
    m, k, n = mkn
    torch.manual_seed(0)
    a = torch.randn(m, k).to(F8) if layout == "nt" else torch.randn(k, m).to(F8).t()
    b = torch.randn(n, k).to(F8).t() if layout == "nt" else torch.randn(k, n).to(F8)
    sa, sb = (torch.full((m, 1), 2.0), torch.full((1, n), 3.0)) if rowwise else (torch.tensor(2.0), torch.tensor(3.0))
    with onednn(with_onednn):
        real = _real_peak(lambda: torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=out_dtype))
        modelled = m * n * out_dtype.itemsize + sum(scaled_mm_scratch((a, b, sa, sb, None, None, out_dtype), {}))
    assert modelled == real, (modelled, real)


@needs_torchao
def test_onednn_float8_matmul_in_a_whole_step():
    """A tensorwise step with torch's default switch: on an AMX CPU every float8 matmul takes oneDNN's path
    (targets/cpu/aten_scaled_mm.py onednn_path; 7 s for this small step here, against 75 s at batch 2, seq 64), on
    other CPUs ATen's emulation, as in the tests above."""
    spec = _spec("transformer", 1, 16, "tensorwise")
    with onednn(True):
        traced = trace_step(load_source(spec.model), spec).peak()[0]
        real = measure_cpu_peak(load_source(spec.model), spec)["peak_bytes"]
    assert traced == real, (traced, real)


class _Float8Matmuls(torch.utils._python_dispatch.TorchDispatchMode):
    """Every matmul on torchao's Float8TrainingTensor: shape, dtype, strides and storage bytes of each operand's
    ``_data`` and ``_scale`` (the float8 copies and their scales torchao made) and of the output."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torchao.float8.float8_training_tensor import Float8TrainingTensor

        out = func(*args, **(kwargs or {}))
        operands = [a for a in args if isinstance(a, Float8TrainingTensor)]
        if operands:
            tensors = [t for a in operands for t in (a._data, a._scale)] + [out]
            self.seen.append((func.__name__, [(tuple(t.shape), t.dtype, t.stride(), t.untyped_storage().nbytes())
                                              for t in tensors]))
        return out


@needs_torchao
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fake_float8_tensors_are_torchaos_real_ones(recipe):
    """The float8 operands and scales torchao's Float8Linear makes (Float8TrainingTensor's _data and _scale, the
    transposed copies of backward) have, on fake tensors, the shapes, strides and bytes they have for real."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memest.features.fp8 import convert

    def step():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 32))
        assert convert(model, recipe) == 2
        with _Float8Matmuls() as seen:
            model(torch.randn(4, 8, 64)).sum().backward()
        return seen.seen

    real = step()
    with FakeTensorMode():
        fake = step()
    assert sum(name.startswith("mm") for name, _ in real) == 6  # forward, grad input, grad weight, x 2 layers
    assert fake == real


def test_refused_below_compute_capability_8_9_and_outside_training():
    with pytest.raises(MemestError, match=r"compute capability 8\.0.*8\.9"):
        RunSpec(model=model_ref("transformer"), target="cuda", compute_capability=(8, 0), fp8="tensorwise")
    with pytest.raises(MemestError, match="--fp8 rowwise"):
        RunSpec(model=model_ref("transformer"), mode="inference", fp8="rowwise")
    RunSpec(model=model_ref("transformer"), target="cuda", compute_capability=(8, 9), fp8="tensorwise")  # Ada: allowed


@needs_torchao
def test_a_model_without_eligible_linears_is_refused():
    spec = RunSpec(model=model_ref("transformer"), batch=1, seq=8, target="cpu", fp8="tensorwise")
    source = load_source(spec.model)
    original = source.build_model
    source.build_model = lambda: torch.nn.Sequential(torch.nn.Linear(10, 3))  # 10 x 3: not multiples of 16
    try:
        with pytest.raises(MemestError, match="converts none"):
            trace_step(source, spec)
    finally:
        source.build_model = original


@pytest.mark.skipif(importlib.util.find_spec("torchao") is not None, reason="torchao is installed")
def test_without_torchao_the_refusal_says_how_to_install_it():
    spec = _spec("transformer", 1, 8, "tensorwise")
    with pytest.raises(MemestError, match="needs torchao: pip install torchao"):
        trace_step(load_source(spec.model), spec)


@needs_torchao
def test_fp8_skip_leaves_the_named_layers_in_high_precision_as_the_real_step_does():
    """--fp8-skip (torchtitan's filter_fqns: a layer whose name contains a listed part is not converted): llama-tiny's
    two q_proj layers left in high precision (its lm_head is not converted either way: a vocabulary of 1000 is not a
    multiple of 16), and the trace equals the real CPU step with the same filter."""
    spec = _spec("hf:llama-tiny", 2, 128, "tensorwise", fp8_skip="q_proj")
    trace = trace_step(load_source(spec.model), spec)
    assert trace.peak()[0] == measure_cpu_peak(load_source(spec.model), spec)["peak_bytes"]
    counts = {}
    for skip in ("", "q_proj"):
        notes = trace_step(load_source(spec.model), _spec("hf:llama-tiny", 2, 128, "tensorwise", fp8_skip=skip)).notes
        counts[skip] = int(next(n for n in notes if n.startswith("--fp8 tensorwise:")).split()[2])
    assert counts["q_proj"] == counts[""] - 2, counts
    with pytest.raises(MemestError, match="--fp8-skip 'lm_head' .* needs --fp8"):
        RunSpec(model=model_ref("transformer"), fp8_skip="lm_head")

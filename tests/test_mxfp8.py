"""--fp8 mxfp8 | mxfp8-wgrad-hp | mxfp8-emulated (features/mxfp8.py): torchao's MXFP8 training traced through
torchao's own code (quantize_ with MXFP8TrainingOpConfig, the weight wrapper's linear override, mx_mm).

The emulated recipe (torchao's PyTorch casts and dequantized matmuls) runs on this CPU, so its trace is checked
against real steps to the byte (validate/cpu_truth.py). The real-kernel recipes need compute capability 10.0: no
GPU figure is measured; their two cast kernels are stand-ins, checked here against torchao's own tensors (the
emulated casts make the same float8 values and e8m0 scales, byte for byte in size), and what autograd saves is
checked against torchao's source (mx_mm saves the high-precision input and weight, as a plain Linear does)."""

import importlib.util

import pytest
import torch

from memest.errors import MemestError
from memest.features.registry import trace_step
from memest.sources import load_source
from memest.spec import RunSpec
from memest.trace.events import Phase
from memest.validate.cpu_truth import measure_cpu_peak

from .conftest import model_ref

# traced and real steps on ATen's CPU kernels alike (conftest.aten_cpu_kernels; tests/test_fp8.py runs oneDNN's)
pytestmark = pytest.mark.usefixtures("aten_cpu_kernels")

needs_torchao = pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="torchao not installed (memest[fp8])")

# (model, batch, seq): tokens (batch x seq) and every converted Linear's dimensions multiples of 32
CASES = [("transformer", 2, 64), ("hf:llama-tiny", 2, 64)]


def _spec(name: str, batch: int, seq: int, fp8: str, **more) -> RunSpec:
    return RunSpec(model=model_ref(name), batch=batch, seq=seq, **{"target": "cpu", "optim": "sgd", "fp8": fp8,
                                                                    **more})


@needs_torchao
@pytest.mark.parametrize("case", CASES, ids=[c[0].removeprefix("hf:") for c in CASES])
def test_emulated_recipe_traced_peak_matches_the_real_step_to_the_byte(case):
    spec = _spec(*case, "mxfp8-emulated")
    trace = trace_step(load_source(spec.model), spec)
    real = measure_cpu_peak(load_source(spec.model), spec)["peak_bytes"]
    assert trace.peak()[0] == real, (trace.peak()[0], real)
    assert any(note.startswith("--fp8 mxfp8-emulated:") for note in trace.notes)


@needs_torchao
@pytest.mark.parametrize("more", [{"precision": "bf16"}, {"checkpointing": "blocks"}], ids=["bf16", "blocks"])
def test_emulated_recipe_with_bf16_and_checkpointing(more):
    spec = _spec("transformer", 2, 64, "mxfp8-emulated", **more)
    traced = trace_step(load_source(spec.model), spec).peak()[0]
    real = measure_cpu_peak(load_source(spec.model), spec)["peak_bytes"]
    assert traced == real, (traced, real)


@needs_torchao
def test_mxfp8_changes_the_real_peak_and_the_trace_follows():
    on, off = _spec("transformer", 2, 64, "mxfp8-emulated"), _spec("transformer", 2, 64, "none")
    real_on = measure_cpu_peak(load_source(on.model), on)["peak_bytes"]
    real_off = measure_cpu_peak(load_source(off.model), off)["peak_bytes"]
    assert real_on != real_off
    assert trace_step(load_source(on.model), on).peak()[0] - trace_step(load_source(off.model), off).peak()[0] == (
        real_on - real_off)


def _layout(t: torch.Tensor) -> tuple:
    return tuple(t.shape), t.dtype, t.untyped_storage().nbytes()


@needs_torchao
@pytest.mark.parametrize("rows,cols", [(64, 256), (128, 96), (32, 8000)])
def test_cast_stand_ins_make_torchaos_tensors(rows, cols):
    """The row cast stand-in makes what torchao's own (emulated) row cast makes, and the column cast stand-in's
    MXTensor (through torchao's _to_mxfp8_dim1_kernel_wrapper, CUDA choice) holds what the emulated column cast's
    holds: the same shapes, dtypes and bytes of float8 values and e8m0 scales."""
    from torchao.prototype.mx_formats.config import MXFP8Dim1CastKernelChoice, ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import to_mx
    from torchao.prototype.mx_formats.utils import _to_mxfp8_dim1_kernel_wrapper
    from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

    from memest.features import mxfp8

    x = torch.randn(rows, cols, dtype=torch.bfloat16)
    scale, data = to_mx(x, torch.float8_e4m3fn, 32, ScaleCalculationMode.RCEIL)
    stand_data, stand_scale = mxfp8.triton_to_mxfp8_dim0(x)
    assert _layout(stand_data) == _layout(data) and _layout(stand_scale) == _layout(scale)
    assert stand_data.stride() == data.stride()

    def dim1(preference):
        return _to_mxfp8_dim1_kernel_wrapper(x, 32, torch.float8_e4m3fn, torch.bfloat16, preference,
                                             MXFP8Dim1CastKernelChoice.CUDA, ScaleCalculationMode.RCEIL)

    emulated = dim1(KernelPreference.EMULATED)
    with mxfp8.kernel_stand_ins():
        stood = dim1(KernelPreference.AUTO)
    assert _layout(stood.qdata) == _layout(emulated.qdata) and stood.qdata.stride() == emulated.qdata.stride()
    assert _layout(stood.scale) == _layout(emulated.scale)


@needs_torchao
def test_stand_ins_are_restored():
    from torchao.prototype.mx_formats import kernels, mx_tensor

    from memest.features import mxfp8

    before = mx_tensor.triton_to_mxfp8_dim0, kernels.mxfp8_quantize_cuda
    with pytest.raises(RuntimeError), mxfp8.kernel_stand_ins():
        assert mx_tensor.triton_to_mxfp8_dim0 is mxfp8.triton_to_mxfp8_dim0
        raise RuntimeError("inside")
    assert (mx_tensor.triton_to_mxfp8_dim0, kernels.mxfp8_quantize_cuda) == before


def _saved_for_backward(spec: RunSpec) -> int:
    """Bytes alive when the first forward ends (at the loss) that autograd saved for backward."""
    trace = trace_step(load_source(spec.model), spec)
    first_loss = next(i for i, _, phase in trace.phase_marks if phase == Phase.LOSS)
    alive: dict[int, int] = {}
    for sid, delta in trace.events[:first_loss]:
        if delta > 0:
            alive[sid] = delta
        else:
            alive.pop(sid, None)
    return sum(n for sid, n in alive.items() if trace.storages[sid].saved_for_backward)


@needs_torchao
@pytest.mark.parametrize("recipe", ["mxfp8", "mxfp8-wgrad-hp"])
def test_real_kernel_recipes_save_what_torchaos_mx_mm_saves(recipe):
    """torchao's mx_mm saves (input_hp, weight_hp) for backward, as a plain Linear's matmul does, and nothing in
    float8: the activations alive when the forward ends are the plain bf16 step's (torchao 0.18
    moe_training/mxfp8_linear.py ``ctx.save_for_backward(input_hp, weight_hp)``)."""
    more = {"target": "cuda", "compute_capability": (10, 0), "precision": "bf16"}
    on = _spec("hf:llama-tiny", 2, 64, recipe, **more)
    off = _spec("hf:llama-tiny", 2, 64, "none", **more)
    assert _saved_for_backward(on) == _saved_for_backward(off) > 0


@needs_torchao
def test_real_kernel_recipes_cast_as_torchaos_backward_does():
    """The real-kernel step is not the emulated one (no dequantized high-precision copies: its peak is lower on the
    same target), and its backward makes the column casts torchao's mx_mm makes: per MXFP8 Linear three (the
    weight, the output gradient and the input: two tensors each, the column-major values and scales), and with the
    weight gradient in high precision (mxfp8-wgrad-hp) only the weight's (moe_training/mxfp8_linear.py)."""
    more = {"target": "cuda", "compute_capability": (10, 0), "precision": "bf16", "optim": "adamw"}
    traces = {r: trace_step(load_source(model_ref("transformer")), _spec("transformer", 2, 64, r, **more))
              for r in ("mxfp8", "mxfp8-wgrad-hp", "mxfp8-emulated")}
    assert traces["mxfp8"].peak()[0] < traces["mxfp8-emulated"].peak()[0]

    def column_casts(trace) -> int:  # the stand-in's torch.empty_strided outputs in the first backward
        return sum(s.op == "empty_strided.default" for s in trace.storages
                   if s.phase == Phase.BACKWARD and s.iteration == 1)

    ran = int(next(n for n in traces["mxfp8"].notes if n.startswith("--fp8 mxfp8:")).split()[2])
    assert ran == 9  # 4 x (linear1, linear2) + head; each block's out_proj is read inside MultiheadAttention
    assert column_casts(traces["mxfp8"]) == 3 * 2 * ran
    assert column_casts(traces["mxfp8-wgrad-hp"]) == 2 * ran


def test_refusals():
    base = {"model": model_ref("transformer"), "batch": 2, "seq": 64}
    with pytest.raises(MemestError, match=r"compute capability 9\.0.*10\.0.*mxfp8-emulated"):
        RunSpec(**base, target="cuda", fp8="mxfp8")  # the default GPU generation: Hopper
    RunSpec(**base, target="cuda", fp8="mxfp8-emulated")  # torchao's path for other GPUs: allowed
    RunSpec(**base, target="cuda", compute_capability=(10, 0), fp8="mxfp8-wgrad-hp")
    with pytest.raises(MemestError, match="--fp8 mxfp8-emulated with --lora.*not traced yet"):
        RunSpec(**base, fp8="mxfp8-emulated", lora="r=8")
    with pytest.raises(MemestError, match="--fp8 mxfp8 with --compile is not traced.*float8_e8m0fnu"):
        RunSpec(**base, target="cuda", compute_capability=(10, 0), fp8="mxfp8", compile=True)
    RunSpec(**base, fp8="mxfp8-emulated", compile_scope="blocks", world_size=2, shard="zero3")  # tests/test_fp8_compile.py
    RunSpec(**base, fp8="mxfp8-emulated", compile_scope="blocks")  # compiled in one process: traced
    RunSpec(**base, fp8="mxfp8-emulated", world_size=2, shard="zero3")  # FSDP2: traced (tests/test_mxfp8_fsdp.py)
    for more in ({"world_size": 2, "shard": "none"}, {"world_size": 4, "shard": "zero3", "tp": 2}):
        with pytest.raises(MemestError, match=f"--fp8 mxfp8-emulated with --world-size {more['world_size']} and.*FSDP2 alone"):
            RunSpec(**base, fp8="mxfp8-emulated", **more)
    with pytest.raises(MemestError, match="tensorwise"):
        RunSpec(**base, fp8="mxfp8", compute_capability=(10, 0), world_size=2, shard="zero3", fp8_all_gather="float8")


@needs_torchao
@pytest.mark.parametrize("recipe", ["mxfp8", "mxfp8-emulated"])
def test_tokens_not_a_multiple_of_32_are_the_users_error(recipe):
    spec = _spec("transformer", 3, 10, recipe, target="cuda", compute_capability=(10, 0))
    with pytest.raises(MemestError, match="multiple of 32"):
        trace_step(load_source(spec.model), spec)


def test_b200_is_a_known_sm100_card():
    from memest.device.catalogue import card_bytes, compute_capability

    assert compute_capability("b200") == (10, 0) and compute_capability("NVIDIA B200") == (10, 0)
    assert card_bytes("b200") == 180 * 10**9


@needs_torchao
def test_emulated_recipe_with_blocks_compiled_matches_the_real_compiled_step():
    """torchtitan compiles each block after the MXFP8 conversion (``--compile-scope blocks``): Inductor runs torchao's
    emulated casts inside the compiled graphs, and the trace equals the same compiled step run for real on CPU
    (to the byte, llama-tiny, 2026-11-28: 7,046,472 B; eager 7,790,920 B)."""
    spec = _spec("hf:llama-tiny", 2, 128, "mxfp8-emulated", compile_scope="blocks")
    trace = trace_step(load_source(spec.model), spec)
    real = measure_cpu_peak(load_source(spec.model), spec)["peak_bytes"]
    assert trace.peak()[0] == real, (trace.peak()[0], real)
    assert any("compiled step" in note for note in trace.notes)
    eager = measure_cpu_peak(load_source(spec.model), _spec("hf:llama-tiny", 2, 128, "mxfp8-emulated"))["peak_bytes"]
    assert eager != real  # compiling changes the real step: not a no-op

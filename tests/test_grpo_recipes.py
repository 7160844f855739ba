"""--preference grpo with gradient checkpointing, gradient accumulation and QLoRA, against real CPU steps of the
same trl 1.16.0 code (tests/test_grpo.py's method: validate/cpu_truth.measure_cpu_phase_peaks, the last iteration).

- --checkpointing blocks / blocks-reentrant: transformers' switch on the policy's layers, which trl's
  ``unwrap_model_for_generation`` and ``disable_gradient_checkpointing`` turn off around generate and the no-grad
  log-probs and back on with ``gradient_checkpointing_kwargs`` (trl/models/utils.py).
- --grad-accum K: one generation of K x --batch completions per optimizer step, buffered in K slices
  (``_buffered_inputs``) held through the K micro-steps (trl ``_prepare_inputs``); the real run does all K
  micro-steps, the trace two.
- --quant nf4 --lora: the adapters cast to bf16 as GRPOTrainer.__init__ does over a quantized base; generation and
  the adapter-disabled reference run on the 4-bit base (memest's stand-in for bitsandbytes' Linear4bit,
  features/quant.py, in the trace and in the real run alike)."""

from __future__ import annotations

import pytest
import torch

from memest.errors import MemestError
from memest.features import grpo
from memest.features.registry import features_for
from memest.sources import load_source
from memest.spec import RunSpec
from memest.spec.choices import Quant
from memest.trace import step as core
from memest.validate.cpu_truth import _distinct_storage_bytes, measure_cpu_phase_peaks

from .conftest import model_ref
from .test_grpo import QV, SAVED_SCALAR, assert_phases_match

# traced and real steps on ATen's CPU kernels alike (conftest.aten_cpu_kernels): the bf16 steps compare to the byte on
# CPUs where oneDNN would run their matmuls (AVX-512/AMX), as on the others
pytestmark = pytest.mark.usefixtures("aten_cpu_kernels")

pytest.importorskip("peft")
pytest.importorskip("trl.trainer.grpo_trainer")

BASE = dict(batch=4, seq=8, target="cpu", optim="adamw", preference="grpo", generations=2, completion_len=4)

CASES = [
    # (extra RunSpec fields, Python floats peft's LoRA saves for backward in the training step: 2 layers x q, v;
    # none at the peak under reentrant checkpointing, whose forward runs under no_grad)
    ({"reference": "copy", "checkpointing": "blocks", "grad_accum": 3}, 0),
    ({"lora": QV, "reference": "adapter", "checkpointing": "blocks-reentrant", "grad_accum": 2}, 0),
    # trl's loop: HF Trainer's training_step returns loss.detach(), the output is not held (--outputs freed)
    ({"lora": QV, "reference": "adapter", "quant": "nf4", "checkpointing": "blocks", "outputs": "freed"}, 4),
]


_PLAIN: dict = {}


def _plain_copy():
    """The no-checkpointing, no-accumulation step with a reference copy: traced once for the tests comparing with it."""
    if not _PLAIN:
        _PLAIN["peaks"] = _traced(RunSpec(model=model_ref("hf:llama-tiny"), **BASE, reference="copy"))[2]
    return _PLAIN["peaks"]


_TRACED: dict = {}


def _traced_case(extra: dict):
    """The trace of BASE + ``extra`` on llama-tiny, once per module (two tests compare with the QLoRA one)."""
    key = tuple(sorted(extra.items()))
    if key not in _TRACED:
        _TRACED[key] = _traced(RunSpec(model=model_ref("hf:llama-tiny"), **BASE, **extra))
    return _TRACED[key]


def _traced(spec):
    source = load_source(spec.model)
    features = features_for(spec)
    trace = core.trace_step(source, spec, features=features)
    step = next(f for f in features if isinstance(f, grpo.GRPOFeature)).step_module
    return source, trace, grpo.phase_peaks(trace, step.phase_starts), step


@pytest.mark.parametrize("extra, scalars", CASES, ids=["copy-blocks-accum3", "lora-reentrant-accum2", "qlora-blocks"])
def test_each_phase_peak_matches_trl_s_real_step(extra, scalars):
    source, trace, traced, step = _traced_case(extra)
    spec = RunSpec(model=model_ref("hf:llama-tiny"), **BASE, **extra)
    if spec.quant != Quant.NONE:  # GRPOTrainer.__init__ casts the adapters over a quantized base to bf16
        trainable = [p for p in step.policy.parameters() if p.requires_grad]
        assert trainable and all(p.dtype == torch.bfloat16 for p in trainable)
    real = measure_cpu_phase_peaks(source, spec, "memest.grpo.")
    assert_phases_match(trace, traced, real, scalars)


def test_qlora_step_against_bitsandbytes_own_linear4bit_on_cpu():
    """The same GRPO step over bitsandbytes' own Linear4bit (transformers' from_pretrained with a BitsAndBytesConfig,
    as a QLoRA user loads it; bitsandbytes 0.50 runs it on CPU), not memest's stand-in: generation with the 4-bit
    base and the adapter-disabled reference run, in trl's loop (HF Trainer's ``training_step`` returns
    ``loss.detach()``: --outputs freed; the Trainer sets train mode). Measured (deterministic): the reference phase
    equal to the byte, the training step but for the 32 B of saved scalars (tests/test_grpo.py); the generation phase
    688 B (0.09%) above the trace: bitsandbytes' CPU no-grad path (``gemm_4bit``'s CPU ``dequantize_4bit``)
    against the stand-in's dequantize-then-linear (the CUDA fallback memest prices), not isolated further. CPU
    kernels only: says nothing of bitsandbytes' CUDA kernels."""
    import json
    import tempfile

    from peft import LoraConfig, get_peft_model
    from torch.profiler import ProfilerActivity, profile
    from transformers import AutoConfig, AutoModelForCausalLM, BitsAndBytesConfig

    from memest.validate.cpu_truth import profiled_phase_peaks

    pytest.importorskip("bitsandbytes")
    extra = {"lora": QV, "reference": "adapter", "quant": "nf4", "checkpointing": "blocks", "outputs": "freed"}
    _, _, traced, _ = _traced_case(extra)
    spec = RunSpec(model=model_ref("hf:llama-tiny"), **BASE, **extra)
    config = AutoConfig.for_model(**json.loads(open(model_ref("hf:llama-tiny").removeprefix("hf:")).read()))
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as saved:
        AutoModelForCausalLM.from_config(config).save_pretrained(saved)
        quantized = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32, device_map="cpu",
                                                         quantization_config=BitsAndBytesConfig(
                                                             load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                             bnb_4bit_use_double_quant=True,
                                                             bnb_4bit_compute_dtype=torch.float32))
    policy = get_peft_model(quantized, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    policy.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    step = grpo.wrap(policy, spec)
    step.train()  # from_pretrained returns eval mode; the Trainer's loop sets train mode (checkpointing needs it)
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad])
    ids = torch.randint(0, config.vocab_size, (spec.batch, spec.seq))
    mask = torch.ones_like(ids)
    state = []  # the quantization state: tensors of bitsandbytes' QuantState, no parameter or buffer
    for module in policy.modules():
        quant_state = getattr(getattr(module, "weight", None), "quant_state", None)
        if quant_state is not None:
            state += [quant_state.absmax, quant_state.code, quant_state.state2.absmax, quant_state.state2.code,
                      quant_state.offset]
    baseline = _distinct_storage_bytes(list(step.parameters()) + list(step.buffers()) + state + [ids, mask])
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for _ in range(spec.iterations):
            step.generate_next = True
            step(ids, mask).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    real = {name: peak + baseline for name, peak in profiled_phase_peaks(prof, "memest.grpo.", spec.iterations).items()}
    assert set(real) == set(grpo.PHASES)
    assert traced["training step"] == real["training step"] - 4 * SAVED_SCALAR, (traced, real)
    assert traced["reference log-probs"] == real["reference log-probs"], (traced, real)
    assert abs(traced["generation"] - real["generation"]) <= 0.001 * real["generation"], (traced, real)


def test_checkpointing_is_off_while_generating_and_lowers_the_training_step():
    """trl turns checkpointing off around generate: the generation phase (its KV cache) is the same as without it;
    the training step saves only the layers' inputs; the policy has it on again after the step."""
    spec = dict(model=model_ref("hf:llama-tiny"), **BASE, reference="copy")
    plain = _plain_copy()
    _, trace, checkpointed, step = _traced(RunSpec(**spec, checkpointing="blocks"))
    assert checkpointed["generation"] == plain["generation"]
    assert checkpointed["reference log-probs"] == plain["reference log-probs"]
    assert checkpointed["training step"] < plain["training step"]
    assert step.policy.is_activation_checkpointing and not step.reference.is_activation_checkpointing
    assert step.checkpointing_kwargs == {"use_reentrant": False}  # transformers 5's default, trl's None
    assert any("turned off by trl around generate" in note for note in trace.notes)


def test_accumulation_generates_once_for_the_whole_generation_batch():
    """--grad-accum 2: generation and reference log-probs over 2 x --batch completions, once per optimizer step;
    the buffered slices are held through the micro-steps: both phases grow with K."""
    spec = dict(model=model_ref("hf:llama-tiny"), **BASE, reference="copy")
    one = _plain_copy()
    _, trace, two, step = _traced(RunSpec(**spec, grad_accum=2))
    assert two["generation"] > one["generation"] and two["training step"] > one["training step"]
    starts = [name for name, _ in step.phase_starts]
    per_iteration = starts[: starts.index("generation", 1)]
    assert per_iteration == ["generation", "reference log-probs", "training step", "training step"]
    assert len(step.buffered) == 2 and step.buffered[0]["completion_ids"].shape[0] == BASE["batch"]
    assert any("buffered (trl steps_per_generation 2)" in note for note in trace.notes)


@pytest.mark.parametrize("fields, match", [
    ({"checkpointing": "every:2"}, "blocks or blocks-reentrant"),
    ({"checkpointing": "selective"}, "blocks or blocks-reentrant"),
    # plain DDP (tests/test_preference_ddp.py) and FSDP2 zero3/zero2 (tests/test_grpo_fsdp.py) are traced
    ({"world_size": 2, "shard": "zero1"}, "not traced yet"),
    # trl's generation_batch_size is global: a multiple of per_device x num_processes (grpo_config.py line 1103)
    ({"world_size": 2, "shard": "zero3", "generation_batch": 8}, "divisible by the global batch size"),
])
def test_what_trl_s_grpo_has_no_switch_for_is_refused(fields, match):
    with pytest.raises(MemestError, match=match):
        RunSpec(model="hf:gpt2", batch=8, preference="grpo", **fields)


def test_colocated_engine_holds_the_whole_generation_batch():
    """trl's colocated LLM: max_num_seqs = per_device_train_batch_size x tp x steps_per_generation."""
    import json

    from typer.testing import CliRunner

    from memest.cli import app

    result = CliRunner().invoke(app, ["estimate", model_ref("hf:llama-tiny"), "--preference", "grpo", "--generations",
                                      "2", "--completion-len", "4", "--batch", "4", "--seq", "8", "--gpu", "24GB",
                                      "--colocate-serve", "0.3", "--rollout", "vllm", "--grad-accum", "2", "--json"])
    assert result.exit_code in (0, 1), result.output
    assert any("max_num_seqs 8" in note for note in json.loads(result.stdout)["colocate"]["notes"])

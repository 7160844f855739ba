"""--checkpointing blocks-reentrant (issue 21/24): every repeated block under torch.utils.checkpoint(use_reentrant=True),
as fsdp_qlora's train.py (FSDP checkpoint_wrapper, CheckpointImpl.REENTRANT) and transformers'
gradient_checkpointing_kwargs={"use_reentrant": True} run it. Each traced step against the same step run for real
on CPU (validate/cpu_truth.py), and the reentrant-minus-non-reentrant difference against the real one."""

import json

import pytest

from memest.features.registry import trace_step
from memest.sources import load_source
from memest.spec import RunSpec
from memest.spec.choices import CheckpointPolicy
from memest.spec.trainers.load import read_trainer_config
from memest.validate.cpu_truth import measure_cpu_peak

from .conftest import model_ref

# traced and real steps on ATen's CPU kernels alike (conftest.aten_cpu_kernels): the bf16 steps compare to the byte on
# CPUs where oneDNN would run their matmuls (AVX-512/AMX), as on the others
pytestmark = pytest.mark.usefixtures("aten_cpu_kernels")

REL_TOL = 0.005


def _traced_and_real(extra: dict) -> tuple[int, int]:
    ref = model_ref("hf:llama-tiny")
    spec = RunSpec(model=ref, batch=2, seq=32, optim="adamw", target="cpu", **extra)
    source = load_source(ref)
    return trace_step(source, spec).peak()[0], measure_cpu_peak(source, spec)["peak_bytes"]


def test_policy_parses():
    assert CheckpointPolicy.of("blocks-reentrant") is CheckpointPolicy.BLOCKS_REENTRANT


def test_reentrant_full_fine_tune_matches_the_real_step_and_its_difference():
    """Full fine-tuning of the tiny Llama in fp32: the reentrant step holds more than the non-reentrant one (its
    recomputed block keeps the whole block's graph until the block's backward ends), in the trace as in the real run."""
    traced_re, real_re = _traced_and_real({"checkpointing": "blocks-reentrant"})
    traced_nr, real_nr = _traced_and_real({"checkpointing": "blocks"})
    assert abs(traced_re - real_re) <= REL_TOL * real_re, (traced_re, real_re)
    assert real_re != real_nr  # the real run did take the reentrant path
    assert abs((traced_re - traced_nr) - (real_re - real_nr)) <= 0.001 * real_re, (traced_re, traced_nr, real_re, real_nr)


def test_reentrant_lora_with_base_dtype_adapters_matches_the_real_step():
    """fsdp_qlora's recipe on one rank: bf16 model, bf16 adapters (dtype=base), LoRA dropout, reentrant checkpointing
    (transformers' switch makes the embedding output require grad, so the frozen blocks pass gradients on)."""
    traced, real = _traced_and_real({"checkpointing": "blocks-reentrant", "precision": "bf16",
                                     "lora": "r=8,dropout=0.1,dtype=base,targets=all-linear"})
    assert abs(traced - real) <= REL_TOL * real, (traced, real)


def test_training_arguments_use_reentrant_maps_to_blocks_reentrant(tmp_path):
    data = {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 1, "gradient_checkpointing": True,
            "gradient_checkpointing_kwargs": {"use_reentrant": True}}
    path = tmp_path / "training_args.json"
    path.write_text(json.dumps(data))
    assert read_trainer_config(path).keys["checkpointing"] == "blocks-reentrant"
    data["gradient_checkpointing_kwargs"] = {"use_reentrant": False}
    path.write_text(json.dumps(data))
    assert read_trainer_config(path).keys["checkpointing"] == "blocks"


@pytest.mark.parametrize("kwargs, expected", [("{use_reentrant: true}", "blocks-reentrant"),
                                              ("{use_reentrant: false}", "blocks")])
def test_axolotl_gradient_checkpointing_kwargs_map(tmp_path, kwargs, expected):
    path = tmp_path / "a.yml"
    path.write_text(f"base_model: {model_ref('hf:llama-tiny').removeprefix('hf:')}\nmicro_batch_size: 1\n"
                    f"sequence_len: 64\ngradient_checkpointing: true\ngradient_checkpointing_kwargs: {kwargs}\n")
    assert read_trainer_config(path).keys["checkpointing"] == expected

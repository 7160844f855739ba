"""Op-level selective activation checkpointing (--checkpointing selective | selective:NAME, features/selective.py):
each step traced and compared with the same step run for real on CPU (torch.profiler memory events,
validate/cpu_truth.py), to the byte; and its peak between no checkpointing and checkpointing every block, as the
real runs measure them."""

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy as TorchPolicy
from torch.utils.checkpoint import SelectiveCheckpointContext

from memest.errors import MemestError
from memest.features.registry import trace_step
from memest.features.selective import FORCE_RECOMPUTE_FQNS, TORCHTITAN, torchtitan_policy, torchtitan_save_ops
from memest.sources import load_source
from memest.spec import RunSpec
from memest.spec.choices import CheckpointPolicy
from memest.validate.cpu_truth import measure_cpu_peak

from .conftest import lowest_of_runs, model_ref

# (model, batch, seq, optimizer, the SAC value): torchtitan's policy on the example, a tiny Llama and transformers'
# GPT-2 (hf: configs); a policy of the model file's own on the same three models built in model files
CASES = [
    ("transformer", 4, 64, "sgd", "selective"),
    ("hf:llama-tiny", 2, 64, "sgd", "selective"),
    ("hf:gpt2-tiny", 4, 64, "adamw", "selective"),
    ("sac_transformer", 4, 64, "sgd", "selective:checkpoint_policy"),
    ("sac_hf", 2, 64, "sgd", "selective:checkpoint_policy"),
    ("sac_hf:build_gpt2", 4, 64, "adamw", "selective:checkpoint_policy"),
]


def _peaks(ref: str, batch: int, seq: int, optim: str, checkpointing: str) -> tuple[int, int]:
    spec = RunSpec(model=ref, batch=batch, seq=seq, target="cpu", optim=optim, checkpointing=checkpointing)
    source = load_source(ref)
    traced, _ = trace_step(source, spec).peak()
    return traced, measure_cpu_peak(source, spec)["peak_bytes"]


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[4]}" for c in CASES])
def test_sac_matches_real_run_and_lies_between_none_and_blocks(case):
    name, batch, seq, optim, value = case
    ref = model_ref(name)
    traced, real = {}, {}
    for ck in ("none", "blocks", value):
        traced[ck], real[ck] = _peaks(ref, batch, seq, optim, ck)
    # GPT-2's step reads the same few bytes (-24 to -48 B) under the real run without any checkpointing: a difference
    # of the model's step, not of SAC's (docs/accuracy.md); SAC must add none of its own
    offset = traced["none"] - real["none"]
    assert abs(offset) <= 48, f"{name}: without checkpointing traced {traced['none']} B, measured {real['none']} B"
    assert traced[value] - real[value] == offset, (
        f"{name} --checkpointing {value}: traced {traced[value]} B, measured {real[value]} B "
        f"(without checkpointing the difference is {offset} B)"
    )
    assert real["blocks"] < real[value] < real["none"], real
    assert traced["blocks"] < traced[value] < traced["none"], traced


def test_user_policy_differs_from_torchtitans_and_the_list_form_matches():
    """The example's own policy saves the CPU attention kernel too (torchtitan's list has only CUDA's): a different
    peak, measured; the list form (torch saves the listed ops) is traced to the byte as well."""
    ref = model_ref("sac_transformer")
    titan, _ = _peaks(ref, 4, 64, "sgd", "selective")
    own, own_real = _peaks(ref, 4, 64, "sgd", "selective:checkpoint_policy")
    listed, listed_real = _peaks(ref, 4, 64, "sgd", "selective:SAVE_ADDMM")
    assert own == own_real and listed == listed_real
    assert own != titan and listed != titan


def _call(policy, op, *args, recompute=False):
    return policy(SelectiveCheckpointContext(is_recompute=recompute), op, *args)


def test_torchtitan_policy_saves_every_other_mm_per_pass():
    """wrapped_policy: the save ops' outputs are kept, but every second mm/linear is recomputed, counted apart in the
    forward and in the recompute; an mm with a forced shape is always recomputed and not counted."""
    aten = torch.ops.aten
    x, w, gate = torch.empty(4, 8), torch.empty(8, 16), torch.empty(8, 3)
    policy = torchtitan_policy(torchtitan_save_ops(), {torch.Size((8, 3))})
    forward = [_call(policy, aten.mm.default, x, w) for _ in range(3)]
    assert forward == [TorchPolicy.MUST_SAVE, TorchPolicy.PREFER_RECOMPUTE, TorchPolicy.MUST_SAVE]
    assert _call(policy, aten.mm.default, x, gate) == TorchPolicy.PREFER_RECOMPUTE
    assert _call(policy, aten.mm.default, x, w) == TorchPolicy.PREFER_RECOMPUTE  # the 4th counted mm
    assert _call(policy, aten.mm.default, x, w, recompute=True) == TorchPolicy.MUST_SAVE  # its own count
    assert _call(policy, aten.relu.default, x) == TorchPolicy.PREFER_RECOMPUTE
    assert _call(policy, aten.addmm.default, x, x, w) == TorchPolicy.MUST_SAVE  # not an mm op: never skipped
    assert _call(policy, aten._scaled_dot_product_flash_attention.default, x, x, x) == TorchPolicy.MUST_SAVE
    assert aten._scaled_dot_product_flash_attention_for_cpu.default not in torchtitan_save_ops()
    assert FORCE_RECOMPUTE_FQNS == ("moe.router.gate",) and "torchtitan" in TORCHTITAN


def test_values_parse_and_errors():
    assert CheckpointPolicy.of("selective") is CheckpointPolicy.SELECTIVE
    assert CheckpointPolicy.of("selective:my_policy") is CheckpointPolicy.SELECTIVE_USER
    with pytest.raises(MemestError, match="selective:NAME"):
        RunSpec(model="x", checkpointing="selective:")
    ref = model_ref("sac_transformer")
    for value, words in (("selective:missing", "defines no missing"), ("selective:NOT_A_POLICY", "not a policy")):
        with pytest.raises(MemestError, match=words):
            trace_step(load_source(ref), RunSpec(model=ref, batch=1, seq=8, target="cpu", checkpointing=value))
    hf = model_ref("hf:llama-tiny")
    with pytest.raises(MemestError, match="not a model file"):
        trace_step(load_source(hf), RunSpec(model=hf, batch=1, seq=8, target="cpu", checkpointing="selective:p"))


@pytest.mark.parametrize("name,value", [("hf:llama-tiny", "selective"), ("transformer", "selective"),
                                        ("sac_hf", "selective:checkpoint_policy")])
def test_recompute_flops_are_what_the_step_reruns(name, value):
    """The report's recompute FLOPs under SAC are the ops its policy leaves to recompute (counted in the forward),
    and they equal what the traced step's FLOPs grow by over the same step without checkpointing (the tracker
    counts every op the backward re-runs); 3 accumulation micro-steps, scaled as the report scales them."""
    from memest.report.analysis import analyse

    ref = model_ref(name)

    def report(ck):
        spec = RunSpec(model=ref, batch=2, seq=32, target="cpu", optim="sgd", grad_accum=3, checkpointing=ck)
        return analyse(trace_step(load_source(ref), spec), spec, name)

    none, sac = report("none"), report(value)
    assert sac.recompute_flops == sac.step_flops - none.step_flops
    assert 0 <= sac.recompute_flops < report("blocks").recompute_flops
    # the report names the policy (torchtitan's with its source address)
    assert any((TORCHTITAN if value == "selective" else "policy checkpoint_policy") in note for note in sac.notes)


def test_cli_yaml_and_api_take_it(tmp_path):
    """One option row: the CLI flag, the YAML key and the API keyword give the same traced peak as trace_step."""
    import json

    from typer.testing import CliRunner

    import memest
    from memest.cli import app
    from memest.spec.config import load_config

    ref = model_ref("sac_transformer")
    value = "selective:checkpoint_policy"
    spec = RunSpec(model=ref, batch=2, seq=32, target="cpu", optim="sgd", checkpointing=value)
    traced, _ = trace_step(load_source(ref), spec).peak()
    result = CliRunner().invoke(app, ["estimate", ref, "--batch", "2", "--seq", "32", "--target", "cpu", "--optim",
                                      "sgd", "--checkpointing", value, "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["peak_allocated_bytes"] == traced
    est = memest.estimate(ref, batch=2, seq=32, target="cpu", optim="sgd", checkpointing=value)
    assert est.peak_allocated_bytes == traced
    config = tmp_path / "sac.yaml"
    config.write_text(f"model: {ref}\nbatch: 2\nseq: 32\ntarget: cpu\noptim: sgd\ncheckpointing: {value}\n")
    assert load_config(config).spec() == spec


def test_sac_under_fsdp_and_tensor_parallel_matches_real_gloo_ranks():
    """torchtitan's order (SAC per block, then FSDP2 / TP+SP around it), each rank against the same step run for real
    as 2 gloo processes (validate/distributed_truth.py): every rank to the byte."""
    from memest.validate.distributed_truth import measure_distributed_peaks

    ref = model_ref("hf:llama-tiny")
    specs = [RunSpec(model=ref, batch=2, seq=64, target="cpu", optim="adamw", checkpointing="selective", **extra)
             for extra in ({"world_size": 2, "shard": "zero3"}, {"world_size": 2, "tp": 2, "sp": True})]
    for spec, ranks in zip(specs, measure_distributed_peaks(specs), strict=True):
        traced, _ = trace_step(load_source(ref), spec).peak()
        ranks = lowest_of_runs(spec, ranks, traced=lambda r, traced=traced: traced)
        assert [r["peak_bytes"] for r in ranks] == [traced, traced], (spec.shard, spec.tp, traced, ranks)


def test_advise_offers_sac_between_none_and_blocks():
    """advise traces SAC as a remedy: it lowers the need less than checkpointing every block and recomputes less."""
    import json

    from typer.testing import CliRunner

    from memest.cli import app

    result = CliRunner().invoke(app, ["advise", model_ref("hf:llama-tiny"), "--batch", "4", "--seq", "64",
                                      "--target", "cpu", "--optim", "sgd", "--gpu", "1MiB", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    remedies = {r["name"]: r for r in doc["remedies"]}
    sac = remedies["selective activation checkpointing (torchtitan's op policy)"]
    blocks = remedies["activation checkpointing"]
    assert sac["changes"] == {"checkpointing": "selective"} and "--checkpointing selective" in sac["command"]
    assert blocks["needed_bytes"] < sac["needed_bytes"] < doc["base_needed_bytes"]

    def pct(r):
        return float(r["time_cost"].removeprefix("+").split("%")[0])

    assert pct(sac) < pct(blocks)


def test_a_saved_output_written_in_place_is_refused_as_the_real_run_refuses_it():
    """transformers' Mixtral experts write in place into an output torchtitan's policy saved: torch's SAC raises in
    backward, in the real CPU run as in the trace, and memest says why and what to change."""
    ref = "hf:tests/configs/mixtral-tiny.json"
    spec = RunSpec(model=ref, batch=2, seq=32, target="cpu", checkpointing="selective")
    with pytest.raises(RuntimeError, match="selective activation checkpoint has been mutated"):
        measure_cpu_peak(load_source(ref), spec)
    with pytest.raises(MemestError, match="selective activation checkpoint has been mutated") as caught:
        trace_step(load_source(ref), spec)
    assert "writes into one in place" in str(caught.value) and "--checkpointing blocks" in str(caught.value)

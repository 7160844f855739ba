"""--preference grpo at --world-size 2 over FSDP2 (--shard zero3, zero2): each gloo rank's traced peak, and each
phase's (generation, reference log-probs, training step), against the same step run for real on 2 gloo ranks
(memest/validate/distributed_truth.py, the phases marked by features/grpo.py's record_function).

What trl 1.16.0 + accelerate 1.15.0 + transformers 5.24.0 do under an accelerate FSDP2 config, and memest runs
(parallel/trl_fsdp.py):
- the policy: accelerate's ``fsdp2_prepare_model`` (HF Trainer's accelerator.prepare), as for DPO;
- the reference (beta != 0, ``--reference copy``): GRPOTrainer.__init__ (trl/trainer/grpo_trainer.py lines 1183-1186)
  ``self.ref_model = prepare_fsdp(self.ref_model, self.accelerator)``: one ``fully_shard`` on the whole copy, so its
  no-grad log-probs all-gather every reference parameter at once; with a peft policy the reference is the sharded
  policy with its adapter disabled (``use_adapter``);
- generation: ``unwrap_model_for_generation`` (trl/models/utils.py) hands back the FSDP2 module itself (accelerate's
  unwrap_model; its gather is DeepSpeed ZeRO-3's only) and ``self._dist.summon_full_params`` is a no-op for FSDP2
  (trl/distributed.py lines 74-91): ``generate`` runs on the sharded policy. HF Trainer registers ``generate`` as a
  forward method of the root (transformers/trainer.py lines 1798-1801, ``register_fsdp_forward_method``); each
  decoding step's forward all-gathers the policy one unit at a time. Nothing unshards the whole model for generate:
  at zero3 one decoder layer at a time is gathered and freed again in every decoding step; at zero2 (reshard_after_forward
  False) every unit stays gathered after the prefill, through generation, until the training step's backward.

One difference, explained to the byte: transformers' generate drops an all-ones attention mask
(generation/utils.py ``(model_kwargs["attention_mask"] == 1).all()``: ``attention_mask = None``). The real run's
prompts are unpadded, so it drops it; the trace cannot read the values (trace/values.py answers False) and keeps the
mask, as a run with left-padded prompts does: each decoding step's ``torch.cat`` of the mask (after a ``new_ones``)
is one (completions, tokens) int64 tensor more in the trace. Where the generation phase peaks while one is alive
(zero3: inside a decoding step's all-gather), the real phase peak is that tensor's bytes lower.
"""

import pytest

from memest.features import grpo
from memest.features.registry import features_for
from memest.sources import load_source
from memest.spec import RunSpec
from memest.trace import step as core
from memest.validate.distributed_truth import measure_distributed_peaks

from .conftest import lowest_phase_peaks_of_runs, model_ref

# traced and real steps on ATen's CPU kernels alike (conftest.aten_cpu_kernels): the bf16 steps compare to the byte on
# CPUs where oneDNN would run their matmuls (AVX-512/AMX), as on the others
pytestmark = pytest.mark.usefixtures("aten_cpu_kernels")

pytest.importorskip("peft")
pytest.importorskip("accelerate")
pytest.importorskip("trl.trainer.grpo_trainer")

LORA = "r=8,alpha=16,targets=q_proj,v_proj"
# peft's LoRA forward multiplies by a Python float, which eager autograd saves as an 8-byte wrapped-number tensor,
# one per adapted layer (2 layers x q, v): tests/test_grpo.py's SAVED_SCALAR; held in the training step's backward
PEFT_SCALARS = 4 * 8
GRPO = {"preference": "grpo", "seq": 8, "generations": 2, "completion_len": 3}  # 1 prompt x 2 completions per rank
# (extra RunSpec fields, bytes the real training step holds that the trace does not allocate)
ZERO3 = [
    ({**GRPO, "reference": "copy"}, 0),  # trl's ref_model: one FSDP unit (prepare_fsdp)
    (GRPO, 0),  # trl's default beta 0.0: no reference
    ({**GRPO, "lora": LORA, "reference": "adapter"}, PEFT_SCALARS),
    ({**GRPO, "reference": "copy", "checkpointing": "blocks"}, 0),  # trl's toggle around generate, under FSDP2
    ({**GRPO, "reference": "copy", "grad_accum": 2}, 0),  # one generation of 2 x 2 completions, buffered
    ({**GRPO, "reference": "copy", "precision": "bf16"}, 0),
    ({**GRPO, "reference": "copy", "precision": "bf16-mixed"}, 0),  # the plugin's MixedPrecisionPolicy on both
    ({**GRPO, "lora": LORA, "reference": "adapter", "precision": "bf16-mixed"}, PEFT_SCALARS),
]
ZERO2 = [
    ({**GRPO, "reference": "copy"}, 0),
    (GRPO, 0),
    ({**GRPO, "lora": LORA, "reference": "adapter"}, PEFT_SCALARS),
    ({**GRPO, "reference": "copy", "precision": "bf16"}, 0),
]


def _spec(extra: dict, shard: str) -> RunSpec:
    return RunSpec(**{"model": model_ref("hf:llama-tiny"), "batch": 2, "target": "cpu", "optim": "adamw",
                      "world_size": 2, "shard": shard, **extra})


def _traced(spec):
    features = features_for(spec)
    trace = core.trace_step(load_source(spec.model), spec, features=features)
    step = next(f for f in features if isinstance(f, grpo.GRPOFeature)).step_module
    return trace, step


def _kept_mask_bytes(trace, step, spec) -> int:
    """The bytes of transformers' attention-mask cats (a ``cat`` right after its ``new_ones``) alive at the traced
    generation phase's peak (the last generation's window, as grpo.phase_peaks reads it)."""
    timeline, starts = trace.timeline(), step.phase_starts
    begin = [b for name, b in starts if name == grpo.PHASES[0]][-1]
    end = next((b for name, b in starts if b > begin), len(timeline))
    lo = max(begin - 1, 0)
    top = max(range(lo, end), key=timeline.__getitem__)
    masks, previous = set(), None
    for sid, delta in trace.events[: top + 1]:
        record = trace.storages[sid]
        if delta > 0 and record.op == "cat.default" and previous == "new_ones.default":
            masks.add(sid)
        if delta > 0:
            previous = record.op
    live: dict[int, int] = {}
    for sid, delta in trace.events[: top + 1]:
        if sid in masks:
            live[sid] = live.get(sid, 0) + delta
    return sum(live.values())


def _check(cases, shard):
    specs = [_spec(extra, shard) for extra, _ in cases]
    measured = measure_distributed_peaks(specs)
    for spec, (_, saved), ranks in zip(specs, cases, measured, strict=True):
        trace, step = _traced(spec)
        traced = grpo.phase_peaks(trace, step.phase_starts, spec.iterations)
        mask = _kept_mask_bytes(trace, step, spec)
        assert len(ranks) == 2

        def above(rank, trace=trace, traced=traced, mask=mask, saved=saved) -> bool:
            """A reading above the trace's (conftest.lowest_phase_peaks_of_runs: measured again; a collective's
            buffer freed late by gloo's worker on a loaded machine only ever lifts one)."""
            real = rank["phase_peaks"]
            limits = {grpo.PHASES[0]: traced.get(grpo.PHASES[0], 0) - mask,
                      grpo.PHASES[2]: traced.get(grpo.PHASES[2], 0) + saved}
            if grpo.PHASES[1] in traced:
                limits[grpo.PHASES[1]] = traced[grpo.PHASES[1]]
            return rank["peak_bytes"] - saved > trace.peak()[0] or any(real.get(k, 0) > v for k, v in limits.items())

        ranks = lowest_phase_peaks_of_runs(spec, ranks, above)
        for rank in ranks:
            what = f"{spec.shard} {spec.precision} {spec.reference} lora={bool(spec.lora)} rank {rank['rank']}"
            assert trace.peak()[0] == rank["peak_bytes"] - saved, (what, trace.peak()[0], rank)
            real = rank["phase_peaks"]
            assert set(real) == set(traced), (what, traced, real)
            assert traced[grpo.PHASES[0]] - mask == real[grpo.PHASES[0]], (what, mask, traced, real)
            if grpo.PHASES[1] in traced:
                assert traced[grpo.PHASES[1]] == real[grpo.PHASES[1]], (what, traced, real)
            assert traced[grpo.PHASES[2]] == real[grpo.PHASES[2]] - saved, (what, traced, real)
            # the phase the report names (GRPOFeature.finish) is the real run's highest
            assert max(traced, key=traced.get) == max(real, key=real.get), (what, traced, real)
        assert any("GRPO phases' peaks" in note for note in trace.notes)


def test_every_gloo_rank_and_phase_of_grpo_over_fsdp2_zero3_matches_the_trace():
    _check(ZERO3, "zero3")


def test_every_gloo_rank_and_phase_of_grpo_over_fsdp2_zero2_matches_the_trace():
    _check(ZERO2, "zero2")


def _most_gathered_in_generation(trace, step, prefix: str) -> int:
    """The most bytes of FSDP's unsharded (all-gathered) parameters of modules under ``prefix`` alive at once during
    the last generation phase."""
    starts = step.phase_starts
    begin = [b for name, b in starts if name == grpo.PHASES[0]][-1]
    end = next((b for name, b in starts if b > begin), len(trace.events))
    gathered = {sid for sid, rec in enumerate(trace.storages)
                if rec.module.startswith(prefix) and "FSDP all-gather copy-out" in rec.op}
    live = most = 0
    for k, (sid, delta) in enumerate(trace.events[:end]):
        if sid in gathered:
            live += delta
            if k >= begin:
                most = max(most, live)
    return most


def test_generate_does_not_unshard_the_whole_policy_at_zero3_and_keeps_it_gathered_at_zero2():
    """The users' question: does FSDP2 gather the whole model for generate? Not at zero3: each decoding step's
    forward gathers one decoder layer at a time and frees it before the next; at zero2 the decoder layers stay
    gathered after the prefill (reshard_after_forward False; no backward reshards them until the training step)."""
    three, three_step = _traced(_spec(GRPO, "zero3"))
    two, two_step = _traced(_spec(GRPO, "zero2"))
    one, _ = _traced(RunSpec(**{**_spec(GRPO, "zero3").to_dict(), "world_size": 1, "shard": "none"}))
    layers = sum(rec.nbytes for rec in one.storages if rec.category.name == "PARAMETERS"
                 and rec.module.startswith("policy.model.layers"))
    assert layers > 0
    at_zero3 = _most_gathered_in_generation(three, three_step, "policy.model.layers")
    assert at_zero3 == layers // 2  # llama-tiny's two equal decoder layers: one at a time (181,760 B of 363,520 B)
    assert _most_gathered_in_generation(two, two_step, "policy.model.layers") == layers

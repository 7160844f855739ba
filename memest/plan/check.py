"""`memest check`: does each run config fit its GPU or budget (with a margin)?"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from memest.device.fit import passes, verdict
from memest.serve.colocate import colocated_engine
from memest.serve.gpu import serve_measured, serve_total
from memest.serve.plan import ServeSpec, plan_serve
from memest.spec import RunSpec
from memest.spec.choices import ServeVerdict, Target, Verdict
from memest.spec.config import RunConfig
from memest.spec.trainers.load import as_dict


@dataclass
class CheckRow:
    name: str
    path: str
    model: str
    needed_bytes: int  # the smallest budget the step runs in, expected (cuda) or peak allocated (cpu)
    required_bytes: int  # needed x (1 + margin)
    budget_label: str
    budget_bytes: int
    margin: float
    fits: bool  # what the exit code counts: verdict fits, or tight unless --strict
    headroom_bytes: int  # budget - required (>= 0 exactly when expected fits)
    seq: int | None = None  # the sequence length traced (the model's default when the config gives none)
    arch: str = ""  # the GPU generation whose kernels were modelled (sm90), --target cuda
    verdict: Verdict | str = ""  # fits (high <= budget) | tight (floor <= budget < high) | does-not-fit
    needed_bytes_low: int = 0  # the needed range (device/usage.py); needed_bytes is the expected value
    needed_bytes_high: int = 0
    required_bytes_high: int = 0  # needed high x (1 + margin): what "fits" needs
    calibration: str = ""  # the calibration applied, if any

    trainer: object | None = None  # the TrainerConfig of the config's `from:` (spec/trainers), if any

    def to_dict(self) -> dict:
        out = asdict(self)
        del out["trainer"]
        if self.trainer is not None:  # only with `from:`: the mapping used, its notes and every key not understood
            out["from"] = as_dict(self.trainer)
        return out


def check_config(config: RunConfig, spec: RunSpec, source, gpu, margin: float | None,
                 strict: bool = False) -> CheckRow:
    """``gpu``: the app layer's GpuContext for this config (budget, GPU generation, calibration);
    ``source``: the loaded model. The verdict compares needed x (1 + margin), its floor (the allocator
    floor + expected fixed costs), expected and high, with the budget (device/fit.verdict); ``strict``: tight counts as not fitting."""
    from memest.estimator import estimate

    margin = margin if margin is not None else config.margin
    result = estimate(spec, gpu.calibration if spec.target == Target.CUDA else None, source=source)
    low, needed, high = result.needed_range
    budget, label = gpu.capacity_bytes, gpu.budget_label
    floor = result.needed_floor  # below it does not fit (device/fit.verdict)
    starts = True  # a colocated rollout engine that cannot start: does not fit
    if config.colocate is not None:  # a rollout engine keeps total x utilization of the same GPU
        c = colocated_engine(spec, gpu, result.needed_range, config.colocate)
        low, needed, high = low + c.engine_bytes, needed + c.engine_bytes, None if high is None else high + c.engine_bytes
        budget, label = c.total_bytes, f"{gpu.budget_label} shared with a rollout engine at {c.utilization:g}"
        starts, floor = c.engine_starts, floor + c.engine_bytes
    required = math.ceil(needed * (1 + margin))
    required_high = None if high is None else math.ceil(high * (1 + margin))  # None: unbounded
    outcome = verdict(required, required_high, budget, math.ceil(floor * (1 + margin))) if starts else Verdict.DOES_NOT_FIT
    return CheckRow(
        name=config.name,
        path=config.path,
        model=spec.model,
        needed_bytes=needed,
        required_bytes=required,
        budget_label=label,
        budget_bytes=budget,
        margin=margin,
        fits=passes(outcome, strict),
        headroom_bytes=budget - required,
        seq=spec.seq if spec.seq is not None else source.default_seq,
        arch=gpu.arch if spec.target == Target.CUDA else "",
        verdict=outcome,
        needed_bytes_low=low,
        needed_bytes_high=high,
        required_bytes_high=required_high,
        calibration=(gpu.calibration_note or "") if spec.target == Target.CUDA else "",
        trainer=config.trainer,
    )


# a serving config's ``serve:`` keys that are ServeSpec fields (YAML key -> field)
SERVE_SPEC_KEYS = {"max_model_len": "max_model_len", "gpu_memory_utilization": "utilization", "tp": "tp",
                   "kv_dtype": "kv_dtype", "block_size": "block_size", "max_num_seqs": "max_num_seqs",
                   "max_num_batched_tokens": "max_num_batched_tokens", "engine": "engine", "cuda_graphs": "cuda_graphs"}


def check_serve_config(config: RunConfig, gpu, margin: float | None, strict: bool = False) -> CheckRow:
    """A serving config (``serve:``): needed = what the engine subtracts before its KV cache + the KV of
    ``min_concurrency`` (default 1) full-length sequences; budget = what it may use (vLLM: total x
    utilization; SGLang: mem_fraction_static x free memory). Will not start: does not fit; may not start: at best
    tight. ``non_torch_memory`` (GiB) or the config's calibration profile replace the non-torch evidence."""

    margin = margin if margin is not None else config.margin
    s = config.serve
    spec = serve_spec(config, gpu)
    plan = plan_serve(spec, recheck=False)  # the gate prints no fixes
    gate = plan.engine.gate(max(s.get("min_concurrency", 1), 1))
    needed, low, high, budget = gate.needed, gate.low, gate.high, gate.budget
    required = math.ceil(needed * (1 + margin))
    required_high = math.ceil(high * (1 + margin))
    outcome = (Verdict.DOES_NOT_FIT if plan.verdict == ServeVerdict.WILL_NOT_START or required > budget
               else verdict(required, required_high, budget))
    if plan.verdict == ServeVerdict.MAY_NOT_START and outcome is Verdict.FITS:
        outcome = Verdict.TIGHT
    return CheckRow(
        name=config.name, path=config.path, model=spec.model, needed_bytes=needed, required_bytes=required,
        budget_label=f"{gpu.budget_label} {gate.share}", budget_bytes=budget, margin=margin,
        fits=passes(outcome, strict), headroom_bytes=budget - required, seq=plan.max_model_len, arch=gpu.arch,
        verdict=outcome, needed_bytes_low=low, needed_bytes_high=high, required_bytes_high=required_high,
        calibration=plan.non_torch.source if plan.non_torch is not None and spec.non_torch is not None else "",
    )


def serve_spec(config: RunConfig, gpu) -> ServeSpec:
    """The ServeSpec of a serving config (``serve:``) on the app layer's GpuContext ``gpu``."""
    s = config.serve
    total, _ = serve_total(gpu)
    settings = {field: s[key] for key, field in SERVE_SPEC_KEYS.items() if key in s}  # ServeSpec's defaults else
    return ServeSpec(config.values["model"], total, gpu.flag, **settings, compute_capability=gpu.compute_capability,
                     **serve_measured(gpu, s.get("tp", 1), s.get("non_torch_memory")))

"""`memest plan-parallel`: layouts, their per-rank need (from cut-depth traces), ranking by communication."""

import json

from typer.testing import CliRunner

from memest.cli import app
from memest.plan.parallel import Layout, comm_bytes, layouts_for
from memest.spec import RunSpec

from .conftest import CONFIGS, model_ref


def test_layouts_respect_heads_and_depth():
    cfg = {"num_attention_heads": 64, "num_key_value_heads": 8, "num_hidden_layers": 80, "hidden_size": 8192}
    names = [lay.name for lay in layouts_for(64, cfg)]
    assert names[:4] == ["dp 64 x tp 1 x pp 1", "dp 32 x tp 2 + sp x pp 1", "dp 16 x tp 4 + sp x pp 1",
                         "dp 8 x tp 8 + sp x pp 1"]
    # pipeline x FSDP2 x TP: pp in 2..64 dividing 64 with tp (pp x tp <= 64), sequence parallel not with a pipeline
    assert len(names) == 4 + 4 + 4 + 4 + 3 + 2 + 1
    assert {"dp 1 x tp 1 x pp 64", "dp 4 x tp 8 x pp 2", "dp 2 x tp 2 x pp 16"} <= set(names)
    cfg["num_key_value_heads"] = 2  # tp 4 and 8 would split a key/value head
    assert [(lay.tp, lay.pp) for lay in layouts_for(8, cfg)] == [(1, 1), (2, 1), (1, 2), (2, 2), (1, 4), (2, 4), (1, 8)]
    cfg["num_hidden_layers"] = 4  # no more stages than layers
    assert max(lay.pp for lay in layouts_for(8, cfg)) == 4


def test_communication_volume_follows_the_papers_counts():
    cfg = {"hidden_size": 1000, "num_hidden_layers": 10}
    base = RunSpec(model="hf:llama-2-7b", batch=1, seq=100, precision="bf16-mixed")
    psi = 1_000_000
    # FSDP over 4: 2 all-gathers (2 B) + 1 reduce-scatter (4 B) of 3/4 of the parameters
    assert comm_bytes(Layout(dp=4, tp=1, pp=1, sp=False), cfg, base, psi) == int(0.75 * psi * 8)
    # TP 2: 4 all-reduces per layer of b*s*h in 2 B, each 2 (tp-1)/tp
    assert comm_bytes(Layout(dp=1, tp=2, pp=1, sp=True), cfg, base, psi) == 10 * 4 * 1 * 100 * 1000 * 2
    # PP 4, M = 4: an activation forward and a gradient back per micro-batch
    assert comm_bytes(Layout(dp=1, tp=1, pp=4, sp=False), cfg, base, psi) == 2 * 4 * 100 * 1000 * 2
    # PP 2 x FSDP 4: the stage's half of the parameters over 4, + the pipeline's transfers
    assert comm_bytes(Layout(dp=4, tp=1, pp=2, sp=False), cfg, base, psi) == int(0.75 * psi / 2 * 8) + 2 * 2 * 100 * 1000 * 2


def _deeper(tmp_path, layers: int) -> str:
    cfg = json.loads((CONFIGS / "llama-tiny-4l.json").read_text())
    path = tmp_path / f"llama-tiny-{layers}l.json"
    path.write_text(json.dumps({**cfg, "num_hidden_layers": layers}))
    return f"hf:{path}"


def test_plan_parallel_cli_ranks_fitting_layouts_and_matches_direct_traces(monkeypatch, tmp_path):
    """A 6-layer tiny Llama on 4 GPUs: FSDP 4 extrapolated from 3 and 4 layers, the 4-stage pipeline's first and
    last stage from 2- and 3-stage pipelines (m micro-batches); each derived peak against a direct trace of the
    layout at full depth and M = 4."""
    from memest.estimator import estimate
    from memest.plan import parallel

    # FSDP 4 and the pure 4-stage pipeline (pipeline x FSDP layouts have their own tests)
    monkeypatch.setattr(parallel, "layouts_for",
                        lambda gpus, cfg: [lay for lay in layouts_for(gpus, cfg) if lay.tp == 1 and lay.pp in (1, 4)])
    ref = _deeper(tmp_path, 6)
    result = CliRunner().invoke(app, ["plan-parallel", ref, "--gpus", "4", "--gpu", "1GB", "--batch", "2", "--seq", "32",
                                      "--target", "cpu", "--top", "0", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    layouts = {lay["pp"]: lay for lay in doc["layouts"]}
    assert set(layouts) == {1, 4} and all(lay["traced"] and not lay["error"] for lay in layouts.values())
    fitting = [lay["comm_bytes"] for lay in doc["layouts"] if lay["fits"]]
    assert fitting == sorted(fitting)
    assert "3 and 4 layers" in layouts[1]["derived_from"] and "affine in m" in layouts[4]["derived_from"]
    fsdp = estimate(RunSpec(model=ref, batch=2, seq=32, target="cpu", world_size=4, shard="zero3"))
    assert layouts[1]["peak_bytes"] == fsdp.report.peak_allocated_bytes
    pipe = estimate(RunSpec(model=ref, batch=2, seq=32, target="cpu", world_size=4, pp=4))  # every stage, M = 4
    assert abs(layouts[4]["peak_bytes"] - pipe.report.peak_allocated_bytes) <= 1e-5 * pipe.report.peak_allocated_bytes
    # the lower bound used to leave layouts out is below every traced need
    per_param = parallel.state_bytes_per_param(RunSpec(model=ref, batch=2, seq=32, target="cpu"))
    for lay in doc["layouts"]:
        assert parallel.state_floor(Layout(lay["dp"], lay["tp"], lay["pp"], lay["sp"]), doc["param_count"], per_param) <= lay["peak_bytes"]
    check = doc["check"]
    assert check is not None and abs(check["error"]) < 1e-4


def test_segment_fit_follows_the_last_stage_from_its_backward_to_merging_its_outputs(tmp_path):
    """The last stage's peak moves, as M grows, from its last backward to the schedule merging its M outputs
    (torch's _merge_outputs): a line through the step's peaks at m = 2, 3 misses it, the segments' lines do not."""
    from memest.estimator import _estimate_one
    from memest.plan.parallel import segment_peaks
    from memest.sources import load_source

    ref = _deeper(tmp_path, 1)
    src = load_source(ref)

    def last_stage(m: int):
        spec = RunSpec(model=ref, batch=2, seq=64, target="cpu", world_size=m, pp=m, pp_split=",".join(["0"] * (m - 1) + ["1"]),
                       pp_stage=m - 1)
        return _estimate_one(spec, None, src)

    two, three, many = last_stage(2), last_stage(3), last_stage(16)
    s2, s3 = segment_peaks(two.trace), segment_peaks(three.trace)
    segments = max(s2[k] + (s3[k] - s2[k]) * 14 for k in s2.keys() & s3.keys())
    whole = two.report.peak_allocated_bytes + (three.report.peak_allocated_bytes - two.report.peak_allocated_bytes) * 14
    real = many.report.peak_allocated_bytes
    assert many.report.phase_at_peak == "loss" and whole < 0.9 * real
    assert abs(segments - real) <= 1e-5 * real


def test_layouts_whose_model_state_cannot_fit_are_left_out_untraced():
    from memest.plan.parallel import plan_parallel

    base = RunSpec(model=model_ref("hf:llama-tiny-4l"), batch=2, seq=32, target="cpu", optim="adamw")
    plan = plan_parallel(base.model, 2, 1000, "1000 B", base)
    assert plan.traces == 0 and plan.check is None
    for lay in plan.layouts:  # AdamW on fp32 weights: 4 B of weight, 4 of gradient, 8 of state
        assert not lay.traced and not lay.fits and lay.needed_bytes == plan.param_count * 16 // 2
    assert plan.param_count == 4 * (4 * 64 * 64 + 3 * 64 * 128 + 2 * 64) + 2 * 512 * 64 + 64


def test_plan_parallel_takes_calibration_and_advise_offers_its_layouts(tmp_path):
    from memest.device.calibration import write_profile

    from .test_device_evidence import profile_entry

    path = write_profile(profile_entry(), tmp_path / "rtx2080ti.json")
    ref = model_ref("hf:llama-tiny-4l")
    args = ["--batch", "2", "--seq", "32", "--optim", "adamw", "--json"]
    plan = CliRunner().invoke(app, ["plan-parallel", ref, "--gpus", "2", "--gpu", "11GB", *args, "--calibration", str(path),
                                    "--top", "3"])
    assert plan.exit_code == 0, plan.output
    doc = json.loads(plan.stdout)
    assert any("RTX 2080 Ti" in n for n in doc["notes"])
    adv = CliRunner().invoke(app, ["advise", ref, "--gpus", "2", "--gpu", "11GB", *args, "--calibration", str(path)])
    assert adv.exit_code == 0, adv.output
    advice = json.loads(adv.stdout)
    layouts = [r for r in advice["remedies"] if r["derived"]]
    by_name = {lay["dp"] * 100 + lay["tp"] * 10 + lay["pp"]: lay for lay in doc["layouts"] if lay["traced"] and not lay["error"]}
    assert layouts and advice["parallel"]["gpus"] == 2
    for remedy in layouts:  # the same planner, the same calibration: the same per-rank need
        c = remedy["changes"]
        lay = by_name[(c["world_size"] // (c["tp"] * c["pp"])) * 100 + c["tp"] * 10 + c["pp"]]
        assert remedy["needed_bytes"] == lay["needed_bytes"] and "sent per step per rank" in remedy["time_cost"]


def test_a_need_the_check_misses_is_traced_at_full_depth(monkeypatch, tmp_path):
    """Above DIRECT_ABOVE (here: always) the recommended layout is traced as it runs, its need the direct one."""
    from memest.estimator import estimate
    from memest.plan import parallel

    monkeypatch.setattr(parallel, "DIRECT_ABOVE", -1.0)
    monkeypatch.setattr(parallel, "layouts_for", lambda gpus, cfg: [lay for lay in layouts_for(gpus, cfg) if lay.pp == 1 and lay.tp == 1])
    ref = _deeper(tmp_path, 6)
    base = RunSpec(model=ref, batch=2, seq=32, target="cpu", optim="adamw")
    plan = parallel.plan_parallel(ref, 2, 2**30, "1 GiB", base)
    (lay,) = plan.layouts
    direct = estimate(RunSpec(model=ref, batch=2, seq=32, target="cpu", optim="adamw", world_size=2, shard="zero3"))
    assert lay.derived_from.startswith("traced at its full depth") and lay.needed_bytes == direct.needed_bytes
    assert plan.check["full_depth_needed_bytes"] == direct.needed_bytes and plan.traces == 4


def test_pruned_search_recommends_what_the_exhaustive_search_does_and_its_bounds_hold(monkeypatch, tmp_path):
    """An 8-layer tiny Llama on 8 GPUs (five of its layouts), 9.5 MB a rank: every layout traced (one process)
    against the search as plan-parallel runs it (lower bounds, stage 0 first, stopped at the first layout that
    fits, two processes). The same recommendation and need; every bound at or below the traced peak."""
    from memest.plan import parallel
    from memest.plan.parallel_bounds import LayerBytes, activation_floor

    keep = {(1, 1, 8), (2, 1, 4), (4, 1, 2), (1, 2, 4), (8, 1, 1)}
    monkeypatch.setattr(parallel, "layouts_for", lambda gpus, cfg: [lay for lay in layouts_for(gpus, cfg)
                                                                    if (lay.dp, lay.tp, lay.pp) in keep])
    ref = _deeper(tmp_path, 8)
    base = RunSpec(model=ref, batch=2, seq=128, target="cpu", optim="adamw")
    budget = 9_500_000
    full = parallel.plan_parallel(ref, 8, budget, "9.5 MB", base, check=False, prune=False, top=None, workers=1)
    fast = parallel.plan_parallel(ref, 8, budget, "9.5 MB", base, check=False, workers=2)
    by_name = {lay.name: lay for lay in full.layouts}
    assert all(lay.traced and not lay.lower_bound and not lay.error for lay in full.layouts)
    fits = [lay.name for lay in full.layouts if lay.fits]
    assert fits and [lay.name for lay in fast.layouts if lay.fits] == fits[:1] == ["dp 1 x tp 2 x pp 4"]
    assert fast.traces < full.traces
    how = {}
    for lay in fast.layouts:
        ref_lay = by_name[lay.name]
        if lay.fits:  # traced alike: the same need
            assert (lay.needed_bytes, lay.peak_bytes) == (ref_lay.needed_bytes, ref_lay.peak_bytes)
        elif lay.verdict == "does-not-fit":  # a lower bound, or the need (both below the budget's complement)
            assert not ref_lay.fits and lay.needed_bytes <= ref_lay.needed_bytes
            assert lay.lower_bound
        else:
            assert lay.verdict == "not-traced" and lay.comm_bytes > by_name[fits[0]].comm_bytes
        how[lay.name] = lay.derived_from
    assert how["dp 4 x tp 1 x pp 2"].startswith("not traced: its first stage holds")  # the activation bound
    assert "stage 0 alone" in how["dp 2 x tp 1 x pp 4"] and "search stopped" in how["dp 8 x tp 1 x pp 1"]
    # every bound below the traced peak: the one used (dp 4 x pp 2, measured on dp 2 x pp 4), and each pipeline's
    # own measured bytes per layer and micro-batch as a floor of itself
    bounded = next(lay for lay in fast.layouts if lay.name == "dp 4 x tp 1 x pp 2")
    assert budget < bounded.needed_bytes <= by_name[bounded.name].peak_bytes
    layer_params = 4 * 64 * 64 + 3 * 64 * 128 + 2 * 64  # q, k, v, o; gate, up, down; two norms
    checked = 0
    for lay in full.layouts:
        assert lay.floor_bytes <= lay.peak_bytes
        if lay.layer_bytes:  # fp32 AdamW: 4 B of weight + 8 of state a parameter before the first backward
            floor = activation_floor(LayerBytes(lay.layer_bytes, lay.name), 8 // lay.pp, lay.pp, layer_params, 12, lay.dp, lay.tp)
            assert 0.3 * lay.peak_bytes < floor <= lay.peak_bytes, lay.name
            checked += 1
    assert checked == 3


def test_expert_x_tensor_parallel_layouts_are_searched_and_traced_as_estimate_traces_them(monkeypatch):
    """MoE: ep x tp layouts (ep a multiple of tp); FSDP 2 x TP 2 x EP 2 of a tiny Mixtral planned at its real depth
    (2 layers) needs what `memest estimate` traces for that layout at uniform routing."""
    from memest.estimator import estimate
    from memest.plan import parallel

    mixtral = {"num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 32, "hidden_size": 4096,
               "intermediate_size": 14336, "num_local_experts": 8, "num_experts_per_tok": 2}
    pairs = [(lay.tp, lay.ep) for lay in layouts_for(8, mixtral) if lay.ep > 1]
    assert pairs == [(1, 2), (1, 4), (1, 8), (2, 2), (2, 4), (2, 8), (4, 4), (4, 8), (8, 8)]
    assert all(lay.dp * lay.tp == 8 and not lay.sp for lay in layouts_for(8, mixtral) if lay.ep > 1)
    # TP 2 x EP 2 on 8 GPUs: each TP rank dispatches half the tokens; the experts' FSDP over 8 / 2 = 4 copies
    base = RunSpec(model="hf:mixtral-8x7b", batch=1, seq=100, precision="bf16-mixed")
    experts = 32 * 8 * 3 * 4096 * 14336
    psi = experts + 1_000_000
    lay = Layout(dp=4, tp=2, pp=1, sp=False, ep=2)
    a2a = 32 * 4 * 50 * 2 * 4096 * 2 / 2
    tp = 32 * 4 * 2 * 1 / 2 * 100 * 4096 * 2
    assert abs(comm_bytes(lay, mixtral, base, psi) - (a2a + 3 / 4 * experts / 2 * 8 + 3 / 4 * 1_000_000 / 2 * 8 + tp)) <= 1

    ref = model_ref("hf:mixtral-tiny")
    spec = RunSpec(model=ref, batch=2, seq=32, target="cpu", optim="adamw")
    monkeypatch.setattr(parallel, "layouts_for", lambda gpus, cfg: [x for x in layouts_for(gpus, cfg) if (x.tp, x.ep) == (2, 2)])
    plan = parallel.plan_parallel(ref, 4, 2**30, "1 GiB", spec, check=False, workers=1)
    (got,) = plan.layouts
    assert got.name == "dp 2 x tp 2 x pp 1 (ep 2)" and got.fits and not got.error, got.error
    direct = estimate(RunSpec(model=ref, batch=2, seq=32, target="cpu", optim="adamw", world_size=4, tp=2, ep=2, shard="zero3"))
    assert got.peak_bytes == direct.report.peak_allocated_bytes

"""`memest plan-parallel`: layouts, their per-rank need (from cut-depth traces), ranking by communication."""

import json

from typer.testing import CliRunner

from memest.cli import app
from memest.plan.parallel import Layout, comm_bytes, layouts_for
from memest.spec import RunSpec

from .conftest import model_ref


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


def test_plan_parallel_cli_ranks_fitting_layouts_and_matches_direct_traces(monkeypatch):
    """llama-tiny-4l has 4 layers, the deeper of the two cut depths: each derived need is a direct trace's.
    Two of the three layouts of 2 GPUs (FSDP 2 and the 2-stage pipeline; TP's traces are tested elsewhere)."""
    from memest.pipeline import estimate
    from memest.plan import parallel

    monkeypatch.setattr(parallel, "layouts_for", lambda gpus, cfg: [lay for lay in layouts_for(gpus, cfg) if lay.tp == 1])
    ref = model_ref("hf:llama-tiny-4l")
    result = CliRunner().invoke(app, ["plan-parallel", ref, "--gpus", "2", "--gpu", "1GB", "--batch", "2", "--seq", "32",
                                      "--target", "cpu", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    layouts = {lay["tp"]: lay for lay in doc["layouts"] if lay["pp"] == 1}
    assert set(layouts) == {1} and any(lay["pp"] == 2 for lay in doc["layouts"])
    fitting = [lay["comm_bytes"] for lay in doc["layouts"] if lay["fits"]]
    assert fitting == sorted(fitting)
    direct = estimate(RunSpec(model=ref, batch=2, seq=32, target="cpu", world_size=2, shard="zero3"))
    assert layouts[1]["peak_bytes"] == direct.report.peak_allocated_bytes
    assert doc["check"] is not None and abs(doc["check"]["error"]) < 0.2

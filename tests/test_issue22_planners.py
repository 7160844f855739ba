"""Issue 22, the planners' items: plan-parallel's sequence and printed commands (10, 11), its verdicts (18),
whatif on --target cuda (13), --quant's per-layer params and the folklore line (15), advise's failing remedies
(17), max-batch --seq-search's cap (33)."""

import json
import shlex

from typer.testing import CliRunner

from memest.cli import app
from memest.plan import parallel
from memest.plan.parallel import Layout, layouts_for
from memest.spec import RunSpec

from .conftest import CONFIGS


def _only(monkeypatch, keep):
    monkeypatch.setattr(parallel, "layouts_for", lambda gpus, cfg: [lay for lay in layouts_for(gpus, cfg)
                                                                    if (lay.dp, lay.tp, lay.pp, lay.ep) in keep])


def _plan(args):
    result = CliRunner().invoke(app, ["plan-parallel", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_plan_parallel_without_seq_counts_communication_at_the_traced_seq(monkeypatch):
    """Item 10: without --seq the layouts are traced at the model's default length; the communication volume and
    the printed command use that length (not seq 1, not '--seq None')."""
    from memest.sources import load_source

    ref = f"hf:{CONFIGS / 'llama-tiny-4l.json'}"
    _only(monkeypatch, {(1, 2, 1, 1)})
    doc = _plan([ref, "--gpus", "2", "--gpu", "1GB", "--batch", "2", "--target", "cpu"])
    seq = load_source(ref).default_seq
    assert seq and seq > 1
    (lay,) = doc["layouts"]
    cfg = json.loads((CONFIGS / "llama-tiny-4l.json").read_text())
    traced = RunSpec(model=ref, batch=2, seq=seq, target="cpu")
    assert lay["comm_bytes"] == parallel.comm_bytes(Layout(dp=1, tp=2, pp=1, sp=True), cfg, traced, doc["param_count"])
    assert f"--seq {seq}" in lay["command"] and "None" not in lay["command"]
    assert doc["base"]["seq"] == seq


def test_plan_parallel_commands_round_trip_through_the_cli(monkeypatch):
    """Item 11: every printed command parses with the CLI and gives the layout's figure (4 layers: each layout is
    traced at its real depth), keeping --target, --checkpointing and --outputs and a runnable --gpu."""
    ref = f"hf:{CONFIGS / 'llama-tiny-4l.json'}"
    _only(monkeypatch, {(2, 1, 1, 1), (1, 2, 1, 1)})
    doc = _plan([ref, "--gpus", "2", "--gpu", "1GB", "--batch", "2", "--seq", "32", "--target", "cpu",
                 "--checkpointing", "blocks", "--outputs", "freed", "--top", "0"])
    assert len(doc["layouts"]) == 2
    for lay in doc["layouts"]:
        argv = shlex.split(lay["command"])
        assert argv[:2] == ["memest", "estimate"]
        for flag in ("--target cpu", "--checkpointing blocks", "--outputs freed", "--gpu 1GB", "--seq 32"):
            assert flag in lay["command"], (flag, lay["command"])
        result = CliRunner().invoke(app, [*argv[1:], "--json"])
        assert result.exit_code == 0, (lay["command"], result.output)
        assert json.loads(result.stdout)["needed_bytes"] == lay["needed_bytes"], lay["command"]


def test_plan_parallel_separates_not_traceable_from_not_searched(monkeypatch):
    """Item 18: a layout whose trace fails (pure TP of a MoE model on cuda: the foreach optimizer step refuses
    DTensors mixed with plain parameters) is 'not traceable' with a short reason and no temporary path; a layout
    the search stopped before is 'not searched'."""
    ref = f"hf:{CONFIGS / 'mixtral-tiny-4l.json'}"
    _only(monkeypatch, {(1, 2, 1, 1), (2, 1, 1, 2), (2, 1, 1, 1)})
    args = [ref, "--gpus", "2", "--gpu", "24GB", "--batch", "2", "--seq", "32"]
    doc = _plan(args)
    by = {(lay["dp"], lay["tp"], lay["ep"]): lay for lay in doc["layouts"]}
    broken, fits, stopped = by[(1, 2, 1)], by[(2, 1, 2)], by[(2, 1, 1)]
    assert broken["verdict"] == "not-traceable" and broken["error"] and not broken["fits"]
    # the model's own path may lie under /tmp (a clone there); no other temporary path may show
    model_path = str(CONFIGS / "mixtral-tiny-4l.json")
    assert "/tmp" not in broken["error"].replace(model_path, "") and "memest-plan-" not in broken["error"]
    assert 0 < len(broken["reason"]) <= 80 and "DTensor" in broken["reason"]
    assert fits["verdict"] == "fits" and stopped["verdict"] == "not-traced" and "not searched" in stopped["derived_from"]
    table = CliRunner().invoke(app, ["plan-parallel", *args])
    assert table.exit_code == 0, table.output
    assert "not traceable" in table.stdout and "not searched" in table.stdout
    assert "/tmp" not in table.stdout.replace(model_path, "") and "memest-plan-" not in table.stdout
    rows = [line for line in table.stdout.splitlines() if "dp 1 x tp 2" in line]
    assert rows and "not traceable" in rows[0] and "not traced" not in table.stdout.split("note:")[0]


def test_advise_skips_a_remedy_whose_trace_fails():
    """Item 17: a saver memest adds itself (here ZeRO-3, refused as for a fully frozen model) failing does not
    abort the advice; it is listed as skipped with its reason."""
    from memest.errors import MemestError
    from memest.plan.advise import advise
    from memest.plan.runner import Runner

    class Refusing(Runner):
        def run(self, **changes):
            if changes.get("shard") == "zero3":
                raise MemestError("every parameter is frozen (requires_grad=False); memest does not model FSDP")
            return super().run(**changes)

    runner = Refusing(RunSpec(model="examples/mlp.py", batch=2, target="cpu"))
    advice = advise(runner, capacity=1)
    skipped = [s["name"] for s in advice.skipped]
    assert skipped and all("ZeRO-3" in name for name in skipped)
    assert all("frozen" in s["reason"] for s in advice.skipped)
    assert advice.remedies and not any("ZeRO-3" in r.name for r in advice.remedies)


def test_max_batch_seq_search_names_the_models_positions_as_the_cap():
    """Item 33 (part): the search capped by the model's positions says so, not '--limit 1024'; a --limit below the
    positions is still named as --limit."""
    ref = f"hf:{CONFIGS / 'gpt2-tiny.json'}"  # n_positions 128
    base = ["max-batch", ref, "--seq-search", "--gpu", "24GB", "--target", "cpu", "--seq", "64"]
    result = CliRunner().invoke(app, base)
    assert result.exit_code == 0, result.output
    text = " ".join(result.stdout.split())  # the console wraps long lines
    assert "--limit" not in text and "the model's 128 positions (n_positions)" in text
    doc = json.loads(CliRunner().invoke(app, [*base, "--json"]).stdout)
    assert doc["value"] == doc["limit"] == 128 and doc["hit_limit"] and doc["cap"].startswith("the model's 128 positions")
    doc = json.loads(CliRunner().invoke(app, [*base, "--limit", "96", "--json"]).stdout)
    assert doc["value"] == 96 and doc["cap"] == "--limit 96"


def test_whatif_on_cuda_without_a_fit_derives_words_and_largest_from_the_traced_grid(tmp_path):
    """Item 13: on --target cuda a sweep traced point by point (here gpt2's ops differ between sizes) still says the
    scaling in plain words and the largest traced batch and seq that fit, from the traced grid, and says so."""
    cfg = json.loads((CONFIGS.parent.parent / "memest" / "data" / "models" / "gpt2.json").read_text())
    path = tmp_path / "gpt2-2l.json"
    path.write_text(json.dumps({**cfg, "n_layer": 2}))
    args = ["whatif", f"hf:{path}", "--seq", "256,512,1024", "--batch", "2,4", "--gpu", "3GB"]
    result = CliRunner().invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    points = doc["points"]
    assert all(p["traced"] for p in points) and doc["largest_from"] == "grid"
    fits_at_256 = [p["batch"] for p in points if p["seq"] == 256 and p["fits"]]
    fits_at_b2 = [p["seq"] for p in points if p["batch"] == 2 and p["fits"]]
    assert fits_at_256 and fits_at_b2 and len(fits_at_b2) < 3  # the budget cuts the grid
    assert doc["largest_batch"] == max(fits_at_256) and doc["largest_batch_at_seq"] == 256
    assert doc["largest_seq"] == max(fits_at_b2) and doc["largest_seq_at_batch"] == 2
    assert len(doc["plain_words"]) == 2 and all("traced grid" in w for w in doc["plain_words"])
    table = CliRunner().invoke(app, args)
    text = " ".join(table.stdout.split())  # the console wraps long lines
    assert f"largest batch that fits at seq 256: {max(fits_at_256)} (the largest traced that fits, from the traced grid" \
        in text and "each extra 1k tokens" in text


def test_quantized_layers_count_logical_parameters_and_folklore_is_left_out_where_it_does_not_apply():
    """Item 15: with --quant the per-layer params count the model's parameters (not packed 4-bit storage), as the
    summary does; the folklore formula is left out (JSON null + the reason) for QLoRA, per-rank parallel runs and
    non-training modes, and kept for a plain training step."""
    from memest.report.analysis import folklore_skipped

    ref = f"hf:{CONFIGS / 'llama-tiny.json'}"
    args = ["estimate", ref, "--batch", "2", "--seq", "32", "--quant", "nf4", "--lora", "r=8,targets=all-linear"]
    result = CliRunner().invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    cfg = json.loads((CONFIGS / "llama-tiny.json").read_text())
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    assert doc["layers"][0]["params"] == doc["param_count"]
    mlp = [lay for lay in doc["layers"] if lay["name"].endswith("layers.0.mlp.up_proj.base_layer")]
    assert mlp and mlp[0]["params"] == h * inter  # a 4-bit packed weight stores h * inter / 2 bytes
    assert doc["folklore_bytes"] is None and "LoRA" in doc["folklore_skipped"]
    table = CliRunner().invoke(app, args)
    assert "folklore formula" in table.stdout and "not applicable" in table.stdout
    assert folklore_skipped(RunSpec(model=ref, batch=2, seq=32, world_size=2, shard="zero3")).startswith("a per-rank")
    assert folklore_skipped(RunSpec(model=ref, batch=2, seq=32, mode="generate", new_tokens=4)).startswith("--mode generate")
    assert folklore_skipped(RunSpec(model=ref, batch=2, seq=32)) == ""


def test_plan_parallel_refuses_a_config_without_the_keys_it_cuts():
    """Found while reproducing item 18: a GPT-2 config (n_layer, n_embd) was an internal KeyError; now one line,
    exit 2."""
    from .test_edge import one_line_error

    result = CliRunner().invoke(app, ["plan-parallel", f"hf:{CONFIGS / 'gpt2-tiny.json'}", "--gpus", "2", "--gpu",
                                      "24GB", "--batch", "2"])
    line = one_line_error(result)
    assert "num_hidden_layers" in line and "not supported yet" in line


def test_advise_gpus_goes_on_when_the_planner_cannot_lay_the_model_out():
    """Item 17's rule for advise --gpus: the planner refusing the model (a GPT-2 config) is recorded as the parallel
    part's error, and the advice goes on (no layouts offered) instead of aborting."""
    from memest.plan.advise import Advice, parallel_remedies
    from memest.plan.runner import Runner

    runner = Runner(RunSpec(model=f"hf:{CONFIGS / 'gpt2-tiny.json'}", batch=2, seq=32, target="cpu"))
    advice = Advice(0, 1, False)
    assert parallel_remedies(runner, 1, 2, "1 B", advice) == []
    assert "num_hidden_layers" in advice.parallel["error"] and advice.parallel["gpus"] == 2

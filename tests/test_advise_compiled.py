"""`memest advise` on a compiled step (plan/advise.py): with each block compiled (--compile-scope blocks) sharding
and checkpointing are traced (tests/test_compile_blocks.py checks them against real runs), so advise offers them,
each priced by its own trace; with the whole step compiled, sharding is not traced (spec/run.py
_check_compile_parallel), and advise says so in one line instead of leaving it out in silence."""

import json

from typer.testing import CliRunner

from memest.cli import app
from memest.plan import advise as advise_mod
from memest.plan.advise import WHOLE_STEP_SHARDING, advise, candidates
from memest.plan.runner import Runner
from memest.spec import RunSpec

from .conftest import model_ref

LLAMA = model_ref("hf:llama-tiny")
SHARDING = [{"world_size": n, "shard": "zero3"} for n in (2, 4, 8)]
CHECKPOINTING = [{"checkpointing": "blocks"}, {"checkpointing": "selective"}]


def _spec(**more) -> RunSpec:
    return RunSpec(model=LLAMA, batch=2, seq=16, optim="adamw", target="cpu", **more)


def _offered(spec: RunSpec) -> tuple[list[dict], list[dict]]:
    not_offered: list[dict] = []
    return [changes for _, changes, _ in candidates(Runner(spec), not_offered)], not_offered


def test_compiled_blocks_are_offered_sharding_and_checkpointing_at_any_world_size():
    for spec in (_spec(compile_scope="blocks"), _spec(compile_scope="blocks", world_size=2, shard="none")):
        offered, not_offered = _offered(spec)
        assert all(changes in offered for changes in SHARDING + CHECKPOINTING), offered
        assert not_offered == []


def test_a_step_compiled_whole_says_why_sharding_is_not_offered():
    for spec in (_spec(compile=True), _spec()):
        offered, not_offered = _offered(spec)
        if spec.compile:
            assert not any("shard" in changes for changes in offered), offered
            assert not_offered == [{"name": "ZeRO-3 / FSDP", "reason": WHOLE_STEP_SHARDING}]
        else:  # the eager step: sharding offered as before, nothing said
            assert all(changes in offered for changes in SHARDING) and not_offered == []


def _only_sharding(monkeypatch, widths=(2,)):
    """advise over the sharding remedies alone (each a compiled trace of its own: the rest would take minutes)."""
    original = candidates

    def sharding(runner, not_offered=None):
        return [c for c in original(runner, not_offered) if c[1] in [{"world_size": n, "shard": "zero3"} for n in widths]]

    monkeypatch.setattr(advise_mod, "candidates", sharding)


def test_the_sharding_remedy_of_compiled_blocks_is_priced_by_its_trace(monkeypatch):
    _only_sharding(monkeypatch)
    base = _spec(compile_scope="blocks", world_size=2, shard="none")
    runner = Runner(base)
    advice = advise(runner, capacity=1)
    (remedy,) = advice.remedies
    assert remedy.changes == {"world_size": 2, "shard": "zero3"} and advice.skipped == []
    traced = runner.run(world_size=2, shard="zero3")
    assert any("compiled each repeated block" in n for n in traced.report.notes), traced.report.notes
    assert remedy.needed_bytes == traced.needed_bytes < advice.base_needed_bytes
    assert "--compile-scope blocks" in remedy.command and "--shard zero3" in remedy.command


def test_the_cli_says_in_one_line_why_a_whole_compiled_step_gets_no_sharding(monkeypatch):
    _only_sharding(monkeypatch)
    args = ["advise", LLAMA, "--batch", "2", "--seq", "16", "--target", "cpu", "--gpu", "1MiB", "--compile"]
    text = CliRunner().invoke(app, args)
    assert text.exit_code == 0, text.output
    said = " ".join(text.stdout.split())  # the terminal's width may wrap the line
    assert said.count("not offered: ") == 1 and f"not offered: ZeRO-3 / FSDP: {WHOLE_STEP_SHARDING}" in said, said
    doc = json.loads(CliRunner().invoke(app, [*args, "--json"]).stdout)
    assert doc["not_offered"] == [{"name": "ZeRO-3 / FSDP", "reason": WHOLE_STEP_SHARDING}]

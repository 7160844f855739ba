"""Issue 22 item 12, the remainder: `serve` prints only fixes that, re-planned, make the verdict `starts` (never
one that reaches only "may not start"); `--tp` is tried beyond 2x and a larger GPU class is named; when no fix
starts one line says so. Re-checking is cheap: a fix that cannot start even with the profile run's untraced lower
bound is never traced, and a profile run is traced once per inputs in a process."""

import json

import pytest

from memest.serve import vllm
from memest.serve.evidence import TOTALS
from memest.serve.plan import ServeSpec, load_config, plan_serve
from memest.spec.choices import ServeVerdict

from .conftest import run

GiB = 2**30
TINY = ["--max-num-batched-tokens", "256", "--max-num-seqs", "8"]
RTX3080 = dict(total_bytes=10 * GiB, card="rtx3080", compute_capability=(8, 6))  # what --gpu rtx3080 resolves to


@pytest.fixture
def traced(monkeypatch):
    """The (tp, tokens, compute capability) of every profile run traced while the test runs."""
    calls = []
    real = vllm.trace_profile_run

    def counted(config, tp, tokens, rows, dtype, cc):
        calls.append((tp, tokens, cc))
        return real(config, tp, tokens, rows, dtype, cc)

    monkeypatch.setattr(vllm, "trace_profile_run", counted)
    return calls


def verdict(spec, config) -> ServeVerdict:
    return plan_serve(spec, config, recheck=False, profiles={}).verdict


def test_tp_is_tried_beyond_2x_and_only_the_smallest_that_starts_is_printed(traced):
    cfg = load_config("hf:llama-3-8b")
    spec = ServeSpec("hf:llama-3-8b", **RTX3080)
    plan = plan_serve(spec, cfg, profiles={})
    assert plan.verdict == ServeVerdict.WILL_NOT_START
    assert [f.split(" (")[0] for f in plan.fixes] == ["--tp 8"]  # main printed "--tp 2", which does not start
    # re-planned in full (traced), tp 2 and 4 do not start (tp 2 'may not start': main printed it), tp 8 does
    verdicts = [verdict(ServeSpec("hf:llama-3-8b", **RTX3080, tp=t), cfg) for t in (2, 4, 8)]
    assert ServeVerdict.STARTS not in verdicts[:2] and verdicts[2] == ServeVerdict.STARTS
    # the re-check traced tp 1 (the plan) and tp 8 only: tp 2 and 4 fail even with the untraced lower bound
    assert sorted({t for t, _, _ in traced[:2]}) == [1, 8] and len(traced) == 2 + 3


def test_a_larger_gpu_class_is_named_and_starts():
    cfg = load_config("hf:llama-3-8b")
    plan = plan_serve(ServeSpec("hf:llama-3-8b", **RTX3080), cfg)
    assert plan.larger_gpu == f"rtx3090 ({TOTALS['rtx3090'][0] / GiB:.2f} GiB)"  # the next card up that starts
    on = ServeSpec("hf:llama-3-8b", TOTALS["rtx3090"][0], "rtx3090", compute_capability=(8, 6))
    assert verdict(on, cfg) == ServeVerdict.STARTS
    smaller = ServeSpec("hf:llama-3-8b", 16 * GiB, "rtx4080", compute_capability=(8, 9))  # between the two
    assert verdict(smaller, cfg) != ServeVerdict.STARTS


def test_cli_every_printed_fix_and_the_larger_gpu_start_when_applied():
    result = run("serve", "hf:llama-3-8b", "--gpu", "rtx3080", "--format", "json")
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["verdict"] == "will-not-start" and doc["fixes"] and doc["larger_gpu"].startswith("rtx3090 ")
    for fix in doc["fixes"]:
        flag, value = fix.split()[:2]
        after = run("serve", "hf:llama-3-8b", "--gpu", "rtx3080", flag, value, "--format", "json")
        assert json.loads(after.stdout)["verdict"] == "starts", fix
    after = run("serve", "hf:llama-3-8b", "--gpu", doc["larger_gpu"].split()[0], "--format", "json")
    assert json.loads(after.stdout)["verdict"] == "starts"
    text = run("serve", "hf:llama-3-8b", "--gpu", "rtx3080")
    assert "  fix: --tp 8 " in text.stdout and "  on a larger GPU: --gpu rtx3090 " in text.stdout


def test_no_fix_that_starts_is_said_in_one_line():
    result = run("serve", "hf:tinyllama-1.1b", "--gpu", "1GB", *TINY, env={"COLUMNS": "1000"})
    assert result.exit_code == 0, result.stderr
    out = result.stdout
    assert "MAY NOT START" not in out and "  fix:" not in out
    said = [line for line in out.splitlines() if "no single change" in line]
    assert len(said) == 1 and said[0].startswith("note: no single change")  # one line (not wrapped at 1000 columns)
    assert "--tp 2, 4, 8" in said[0] and "--gpu rtx3080" in said[0]


def test_a_fix_reaching_only_may_not_start_is_not_printed():
    """llama-3.1-8b on an RTX 3090 at 60,000 tokens: the length that fits with the expected costs reaches only
    'may not start' (main printed it with those words); the length that surely fits is printed."""
    spec = ServeSpec("hf:llama-3.1-8b", int(23.58 * GiB), "rtx3090", max_model_len=60000, max_num_batched_tokens=2048,
                     max_num_seqs=64, cuda_graphs="after")
    cfg = load_config(spec.model)
    plan = plan_serve(spec, cfg)
    lengths = [int(f.split()[1]) for f in plan.fixes if f.startswith("--max-model-len")]
    assert lengths == [plan.longest_context_low]
    from dataclasses import replace

    assert verdict(replace(spec, max_model_len=plan.longest_context), cfg) == ServeVerdict.MAY_NOT_START
    for fix in plan.fixes:
        assert "MAY NOT START" not in fix


@pytest.mark.parametrize("model, tp", [("hf:tinyllama-1.1b", 1), ("hf:tinyllama-1.1b", 2), ("hf:gpt2", 2),
                                       ("hf:qwen2.5-7b", 2)])
def test_the_untraced_floor_bounds_the_traced_profile_run(model, tp):
    """The re-check's lower bound: the same weights as the traced rank model, an activation at or below the traced
    one at every end of its range (so a floor that does not start proves the traced plan does not)."""
    cfg = load_config(model)
    spec = ServeSpec(model, 80 * GiB, "h100", tp=tp, max_num_batched_tokens=256, max_num_seqs=8)
    floor = plan_serve(spec, cfg, recheck=False, profiles={}, floor=True)
    full = plan_serve(spec, cfg, recheck=False, profiles={})
    assert floor.weights.bytes == full.weights.bytes
    a, b = floor.profile.activation, full.profile.activation
    assert 0 < a.low <= b.low and a.bytes <= b.bytes and a.high <= b.high
    assert floor.engine.kv_cache.low >= full.engine.kv_cache.low


def test_a_profile_run_is_traced_once_per_inputs_in_a_process(traced):
    cfg = load_config("hf:tinyllama-1.1b")
    spec = ServeSpec("hf:tinyllama-1.1b", 80 * GiB, "h100", max_num_batched_tokens=192, max_num_seqs=4,
                     compute_capability=(8, 0))
    first = plan_serve(spec, cfg)
    again = plan_serve(spec, load_config("hf:tinyllama-1.1b"))  # the same config loaded again
    assert len(traced) <= 1 and again.profile.activation == first.profile.activation

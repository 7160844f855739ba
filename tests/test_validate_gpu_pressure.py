"""scripts/validate_gpu_pressure.py on the CPU: the plan (predicted allocated within 80-97% of the card),
the budget, the record / snapshot / summary writers on synthetic stats. No GPU; memest's estimate mocked
with a linear model (real estimates are checked against real runs in the GPU validation itself)."""

from __future__ import annotations

import importlib.util
import json
import pickle
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GiB = 2**30


@pytest.fixture(scope="module")
def vp():
    sys.path.insert(0, str(ROOT / "scripts"))
    spec = importlib.util.spec_from_file_location("validate_gpu_pressure", ROOT / "scripts" / "validate_gpu_pressure.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def linear(base: int, per: int, calls: list | None = None):
    def est(batch):
        if calls is not None:
            calls.append(batch)
        a = base + per * batch
        return {"allocated": a, "reserved": int(a * 1.02), "needed_expected": int(a * 1.05),
                "needed_high": int(a * 1.1), "needed_floor": int(a * 1.03), "needed_low": a}
    return est


@pytest.mark.parametrize("capacity", [79.19 * GiB, 139.8 * GiB, 23.6 * GiB])
@pytest.mark.parametrize("base,per", [(9 * GiB, int(2.7 * GiB)), (4 * GiB, int(0.35 * GiB)), (20 * GiB, 6 * GiB // 10)])
def test_plan_lands_in_range(vp, capacity, base, per):
    capacity = int(capacity)
    if base + per > 0.97 * capacity:
        pytest.skip("batch 1 alone is above the range")
    calls = []
    plan = vp.plan_model(linear(base, per, calls), capacity)
    assert plan["batch"] is not None
    share = plan["estimate"]["allocated"] / capacity
    assert 0.80 <= share <= 0.97, share
    assert plan["oom_estimate"]["allocated"] > capacity
    assert plan["oom_batch"] > plan["batch"]
    assert len(calls) <= 6  # a few estimates, not a sweep


def test_plan_nonlinear_is_corrected(vp):
    # allocated grows faster than linear (attention-like term): the first guess overshoots, then corrects
    def est(batch):
        a = 3 * GiB + batch * GiB + batch * batch * GiB // 8
        return {"allocated": a, "reserved": a, "needed_expected": a, "needed_high": a, "needed_floor": a}
    capacity = 80 * GiB
    plan = vp.plan_model(est, capacity)
    assert plan["batch"] is not None and 0.80 <= est(plan["batch"])["allocated"] / capacity <= 0.97


def test_plan_none_when_batch_one_too_big(vp):
    plan = vp.plan_model(linear(100 * GiB, GiB), 80 * GiB)
    assert plan["batch"] is None
    assert plan["oom_batch"] == 1


def test_runs_from_plan_order(vp):
    plan = {"models": [{"config": ["m", 1, "adamw", "bf16-mixed"], "batch": 8, "estimate": {"allocated": 1},
                        "oom_batch": 9, "oom_estimate": {"allocated": 2}},
                       {"config": ["n", 1, "adamw", "bf16-mixed"], "batch": None, "estimate": None,
                        "oom_batch": 1, "oom_estimate": {"allocated": 3}}]}
    runs = vp.runs_from_plan(plan)
    assert [(r["config"][0], r["batch"], r["alloc_conf"], r["expect"]) for r in runs] == [
        ("m", 8, "", "fits"), ("m", 8, "expandable_segments:True", "fits"), ("m", 9, "", "oom"), ("n", 1, "", "oom")]


def test_budget(vp):
    now = [0.0]
    b = vp.Budget(420, clock=lambda: now[0], first_guess=90)
    assert b.can_start()
    now[0] = 335.0  # 85 s left, under the first guess
    assert not b.can_start()
    now[0] = 100.0
    b.record(40.0)
    b.record(25.0)
    assert b.longest == 40.0
    now[0] = 379.0  # 41 s left >= longest run
    assert b.can_start()
    now[0] = 381.0
    assert not b.can_start()


def stats(alloc, retries=0):
    return {"allocated_bytes.all.peak": alloc, "reserved_bytes.all.peak": alloc + 2**20,
            "num_alloc_retries": retries, "num_ooms": 0, "active_bytes.all.peak": alloc}


def test_step_record_keeps_raw_stats(vp):
    s = stats(5 * GiB, retries=3)
    r = vp.step_record(2, s, 5 * GiB, 6 * GiB, 70 * GiB, 7 * GiB, 0.5)
    assert r["num_alloc_retries"] == 3 and r["memory_stats"] == s and r["memory_stats"] is not s
    assert r["nvml_device_used"] == 70 * GiB and r["oom"] is None


def snapshot(n_segments, blocks_each):
    return {"segments": [{"device": 0, "address": i * 2**21, "total_size": 2**21, "allocated_size": 2**20,
                          "active_size": 2**20, "requested_size": 2**20 - 8, "segment_type": "large", "stream": 0,
                          "blocks": [{"size": 512, "state": "active_allocated", "frames": [{"filename": "x" * 200}]}
                                     for _ in range(blocks_each)]}
                         for i in range(n_segments)],
            "device_traces": [[{"action": "alloc"}] * 7]}


def test_snapshot_summary_and_size_limit(vp, tmp_path):
    snap = snapshot(3, 2)
    summary = vp.snapshot_summary(snap)
    assert summary["segment_count"] == 3 and summary["total_size"] == 3 * 2**21
    assert summary["allocated_size"] == 3 * 2**20 and summary["trace_entries"] == 7
    assert summary["segments"][0]["blocks"] == 2
    small = vp.save_snapshot(snap, tmp_path / "a")
    assert small.endswith(".pickle") and pickle.loads(Path(small).read_bytes()) == snap
    big = vp.save_snapshot(snapshot(50, 400), tmp_path / "b", max_bytes=10_000)
    assert big.endswith(".segments.json") and not (tmp_path / "b.pickle").exists()
    assert json.loads(Path(big).read_text())["segment_count"] == 50


def run_entry(est):
    return {"config": ["hf:llama-3.2-1b", 2048, "adamw", "bf16-mixed"], "batch": 12, "alloc_conf": "", "expect": "fits",
            "memest": est}


def test_compare_ran_and_verdict(vp):
    cap = 80 * GiB
    steps = [vp.step_record(i, stats(60 * GiB + i), 60 * GiB + i, 66 * GiB, 70 * GiB, 68 * GiB, 0.1) for i in range(6)]
    est = linear(0, GiB)(63)  # allocated 63 GiB: +5% against 60
    row = vp.compare(run_entry(est), {"steps": steps, "oom": None}, cap)
    assert row["steps_run"] == 6 and row["verdict"] == "fits" and row["verdict_holds"] is True
    assert row["error_allocated_pct"] == pytest.approx(100 * (63 * GiB - (60 * GiB + 5)) / (60 * GiB + 5))
    # memest says does-not-fit for a run that ran: the check fails
    bad = linear(0, GiB)(90)
    row = vp.compare(run_entry(bad), {"steps": steps, "oom": None}, cap)
    assert row["verdict"] == "does-not-fit" and row["verdict_holds"] is False
    # an OOM run: recorded, the verdict listed, no error figures
    oom_steps = steps[:1] + [vp.step_record(1, stats(79 * GiB), 79 * GiB, 79 * GiB, 80 * GiB, 79 * GiB, 0.1, "step 1: OOM")]
    row = vp.compare(run_entry(bad), {"steps": oom_steps, "oom": "step 1: OOM"}, cap)
    assert row["oomed"] and row["steps_run"] == 1 and row["verdict_holds"] is None and "error_allocated_pct" not in row


def test_summary_markdown_and_bundle(vp, tmp_path):
    cap = 80 * GiB
    steps = [vp.step_record(0, stats(60 * GiB), 60 * GiB, 66 * GiB, 70 * GiB, 68 * GiB, 0.1)]
    rows = [vp.compare(run_entry(linear(0, GiB)(63)), {"steps": steps, "oom": None}, cap)]
    env = {"gpu": "NVIDIA H100 80GB HBM3", "driver": "x", "cuda": "13.0", "torch": "2.11", "date": "d"}
    text = vp.summary_markdown(env, cap, rows, [run_entry(None) | {"why": "budget: 10 s left"}])
    assert "| hf:llama-3.2-1b seq 2048 bf16-mixed | 12 | default |" in text
    assert "+5.00%" in text and "budget: 10 s left" in text
    folder = tmp_path / "pressure"
    folder.mkdir()
    (folder / "summary.md").write_text(text)
    target = vp.bundle(folder, tmp_path / "out" / "pressure.tar.gz")
    with tarfile.open(target) as tar:
        assert "pressure/summary.md" in tar.getnames()


def test_validate_gpu_forwards_pressure(vp, tmp_path, monkeypatch):
    # `validate_gpu.py --pressure --plan-only ...` reaches the pressure script (estimate mocked: no trace)
    sys.path.insert(0, str(ROOT / "scripts"))
    import validate_gpu
    import validate_gpu_pressure

    seen = {}
    monkeypatch.setattr(validate_gpu_pressure, "make_plan",
                        lambda capacity, cc, workers: seen.update(capacity=capacity, cc=cc) or {"models": []})
    monkeypatch.setattr(sys, "argv", ["validate_gpu.py", "--pressure", "--plan-only", "--capacity", "80GiB",
                                      "--out", str(tmp_path)])
    validate_gpu.main()
    assert seen == {"capacity": 80 * GiB, "cc": [9, 0]}
    assert json.loads((tmp_path / "plan.json").read_text()) == {"models": []}

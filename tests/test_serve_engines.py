"""The serving-engine seam (serve/engine.py): engines are reached only through serve/engines.py's registry, so a
third engine registered there yields a plan, a view, a check row and a colocate figure with no other change."""

from __future__ import annotations

import ast
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

import memest
from memest.app import ServeRun, resolve_gpu
from memest.errors import MemestError
from memest.plan.check import check_serve_config
from memest.report.views import serve_view
from memest.serve.budget import Part
from memest.serve.colocate import colocate
from memest.serve.engine import Gate, ServeEngine, ServePlan, Setup, Sizes
from memest.serve.engines import ENGINES, engine_for
from memest.serve.gpu import serve_total
from memest.serve.plan import ServeSpec, load_config, plan_serve
from memest.serve.sglang import SglangEngine
from memest.serve.vllm import VllmEngine
from memest.serve.weights import Weights
from memest.spec.choices import Engine, ServeVerdict

GiB = 2**30
WEIGHTS = 3 * GiB
TOKEN_BYTES = 1 << 16  # what the fake engine charges per KV token


class HalfEngine(ServeEngine):
    """A made-up engine: it keeps half the GPU, loads 3 GiB of weights and gives the rest to the KV cache."""

    def __init__(self, setup: Setup):
        self.setup = setup
        share = setup.spec.total_bytes // 2
        self.budget = SimpleNamespace(share=share, to_dict=lambda: {"share": share, "weights": WEIGHTS})

    @classmethod
    def plan(cls, setup: Setup) -> ServePlan:
        engine = cls(setup)
        plan = ServePlan(setup.spec, setup.model_name, setup.max_model_len, setup.max_positions, 0.5, "half, always",
                         7, 99, "made up", setup.kv, Weights(WEIGHTS, WEIGHTS, 0, WEIGHTS // 2), None, engine,
                         context=setup.context, notes=[*setup.notes, "a third engine"])
        plan.longest_context = engine.sizes()[1].tokens
        if plan.longest_context < setup.max_model_len:
            plan.verdict = ServeVerdict.WILL_NOT_START
            plan.reasons.append("the half share is too small")
        return plan

    @property
    def kv_cache(self) -> Part:
        return Part.exact("KV cache", self.budget.share - WEIGHTS, "half the GPU - weights")

    def sizes(self) -> tuple[Sizes, Sizes, Sizes]:
        tokens = max(self.kv_cache.bytes, 0) // TOKEN_BYTES
        one = Sizes(None, tokens, tokens / self.setup.max_model_len, tokens // self.setup.max_model_len)
        return one, one, one

    def steps(self) -> list[Part]:
        return [Part.exact("x 0.5", self.budget.share, "half"), Part.exact("- weights", WEIGHTS, "made up")]

    def capacity_lines(self) -> list[str]:
        return [f"half-engine pool: {self.sizes()[1].tokens:,} tokens"]

    def gate(self, sequences: int) -> Gate:
        needed = WEIGHTS + sequences * self.setup.max_model_len * TOKEN_BYTES
        return Gate(needed, needed, needed, self.budget.share, "x half")


@pytest.fixture
def half(monkeypatch):
    monkeypatch.setitem(ENGINES, "half", HalfEngine)
    return load_config("hf:gpt2")


def test_registry_holds_each_engine_choice():
    assert set(ENGINES) == set(Engine) and engine_for(Engine.VLLM) is VllmEngine
    assert engine_for("sglang") is SglangEngine  # a plain string finds the member's engine
    with pytest.raises(MemestError, match="unknown serving engine 'tensorrt'"):
        engine_for("tensorrt")


def test_a_registered_engine_yields_a_plan_and_a_view(half):
    plan = plan_serve(ServeSpec("hf:gpt2", 80 * GiB, "h100", max_model_len=1024, engine="half"), half)
    tokens = (40 * GiB - WEIGHTS) // TOKEN_BYTES
    assert isinstance(plan.engine, HalfEngine) and plan.tokens == tokens and plan.sequences == tokens // 1024
    assert plan.verdict == ServeVerdict.STARTS and plan.starts and plan.non_torch is None
    assert plan.vllm is None and plan.sglang is None and plan.notes[-1] == "a third engine"

    view = serve_view(ServeRun(plan, resolve_gpu("h100", need_budget=True), "made up"))
    doc = view.doc
    assert doc["engine"] == "half" and doc["budget"] == {"share": 40 * GiB, "weights": WEIGHTS}
    assert doc["kv_tokens"] == doc["kv_tokens_low"] == doc["kv_tokens_high"] == tokens and doc["blocks"] is None
    assert doc["kv_cache_bytes"] == 40 * GiB - WEIGHTS and doc["verdict"] == "starts"
    table, *lines = view.blocks
    assert [r[0] for r in table.rows] == ["GPU total", "x 0.5", "- weights", "= KV cache"]
    assert table.rows[-1][1] == f"{(40 * GiB - WEIGHTS) / GiB:.2f} GiB"
    assert f"half-engine pool: {tokens:,} tokens" in lines and "note: a third engine" in lines


def test_a_registered_engine_gates_check_and_colocate(half):
    gpu = resolve_gpu("h100", need_budget=True)
    config = SimpleNamespace(name="half", path="half.yaml", values={"model": "hf:gpt2"}, margin=0.1,
                             serve={"engine": "half", "max_model_len": 1024, "min_concurrency": 2})
    row = check_serve_config(config, gpu, None)
    needed = WEIGHTS + 2 * 1024 * TOKEN_BYTES
    assert row.needed_bytes == needed and row.required_bytes == math.ceil(needed * 1.1)
    assert row.budget_bytes == serve_total(gpu)[0] // 2 and row.budget_label == f"{gpu.budget_label} x half"
    assert row.verdict == "fits" and row.seq == 1024

    plan = plan_serve(ServeSpec("hf:gpt2", 80 * GiB, "h100", max_model_len=1024, engine="half"), half)
    c = colocate((GiB, GiB, GiB), 80 * GiB, 0.5, plan)
    assert c.smallest_utilization == math.ceil((WEIGHTS + 1024 * TOKEN_BYTES) / (80 * GiB) * 100) / 100
    assert f"engine KV cache: {plan.tokens:,} tokens at this share" in c.notes


def test_an_engine_that_does_not_start_is_refused_everywhere(half):
    plan = plan_serve(ServeSpec("hf:gpt2", 6 * GiB, None, max_model_len=1024, engine="half"), half)
    assert plan.verdict == ServeVerdict.WILL_NOT_START and not plan.starts
    assert colocate((GiB, GiB, GiB), 6 * GiB, 0.5, plan).verdict == "does-not-fit"


def test_serve_verdict_words_are_the_json_values():
    assert [str(v) for v in ServeVerdict] == ["starts", "may-not-start", "will-not-start"]


def _imports(path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module} | \
        {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}


def test_serve_and_check_never_import_the_app_layer():
    """No app <-> plan/check circle: the serve helpers live in serve/, which imports neither the app layer nor the
    planners or views above it; check imports serve, and app imports check only."""
    root = Path(memest.__file__).parent
    for path in sorted((root / "serve").glob("*.py")):
        above = {m for m in _imports(path) if m.startswith(("memest.app", "memest.plan", "memest.report",
                                                            "memest.cli", "memest.api"))}
        assert not above, f"{path.name} imports {above}"
    assert not {m for m in _imports(root / "plan" / "check.py") if m.startswith("memest.app")}
    assert not {m for m in _imports(root / "report" / "views.py") if m.startswith("memest.serve")}

"""The per-layer table: every parameter counted once, in the module that owns it (the first module to
register it, in named_modules order), so the rows add up to the model."""

import pytest

from memest.estimator import estimate
from memest.spec import RunSpec

from .conftest import model_ref
from .test_hf_configs import PUBLISHED


def _leaves(report):
    names = [row.name for row in report.layers]
    return [row for row in report.layers if not any(n.startswith(row.name + ".") for n in names if row.name)
            and (row.name or len(names) == 1)]


@pytest.fixture(scope="module")
def gpt2():
    return estimate(RunSpec(model="hf:gpt2", batch=1, seq=32, optim="adam", target="cpu")).report


def test_gpt2_leaf_rows_add_up_to_the_model(gpt2):
    assert gpt2.param_count == PUBLISHED["gpt2"]
    leaves = _leaves(gpt2)
    assert sum(row.params for row in leaves) == gpt2.param_count
    assert sum(row.param_bytes for row in leaves) == gpt2.param_bytes
    top = next(row for row in gpt2.layers if row.name == "")
    assert (top.params, top.param_bytes) == (gpt2.param_count, gpt2.param_bytes)


def test_gpt2_tied_embedding_counted_once(gpt2):
    rows = {row.name: row for row in gpt2.layers}
    wte, lm_head = rows["transformer.wte"], rows["lm_head"]
    assert wte.params == 50257 * 768  # the one matrix, in the module that registers it first
    assert lm_head.params == lm_head.param_bytes == lm_head.grad_bytes == lm_head.optimizer_bytes == 0
    assert rows["transformer"].params + lm_head.params == gpt2.param_count
    # model state rows add up as well: gradients and Adam's state of each parameter once
    leaves = _leaves(gpt2)
    for key in ("grad_bytes", "optimizer_bytes"):
        assert sum(getattr(row, key) for row in leaves) == getattr(rows[""], key)
    assert any("lm_head.weight" in note and "transformer.wte.weight" in note for note in gpt2.notes)


def test_tied_model_file_rows_add_up():
    report = estimate(RunSpec(model=model_ref("tied"), batch=2, seq=16, target="cpu")).report
    rows = {row.name: row for row in report.layers}
    assert rows["embed"].params == 2000 * 128 and rows["head"].params == 0
    assert sum(row.params for row in _leaves(report)) == report.param_count == rows[""].params

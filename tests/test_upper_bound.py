"""--data-dependent upper-bound (features/upper_bound.py): size-bounded data-dependent ops traced at their bound,
against the same step run for real on CPU (validate/cpu_truth.py, torch.profiler memory events).

The model: a graph convolution that inserts self loops as torch_geometric's add_remaining_self_loops does
(`edge_index[:, edge_index[0] != edge_index[1]]`, then the loops), a boolean-mask selection of nodes that
carries gradients (`h[keep]`, whose backward scatters into zeros) and a masked_select over a broadcast mask.
On inputs where every mask selects all (no self loops in the graph, every node and column kept) the bound is
attained and the estimate must be exact; on inputs where half the edges are loops and half the nodes and
columns are dropped it must not be below the real peak (measured: +68.5% kept loop, +60.5% freed, torch 2.13).
"""

import json

import pytest
import torch
from torch import nn

import memest
from memest.errors import TraceError
from memest.features.registry import trace_step
from memest.sources import load_source
from memest.sources.callables import callable_source
from memest.spec import RunSpec
from memest.spec.config import config_from_dict
from memest.validate.cpu_truth import measure_cpu_peak

from .conftest import model_ref

NODES, EDGES = 300, 1200


class SelfLoopGCN(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin1 = nn.Linear(16, 32)
        self.lin2 = nn.Linear(32, 7)

    def conv(self, x, edge_index, lin):
        n = x.shape[0]
        mask = edge_index[0] != edge_index[1]  # torch_geometric.utils.add_remaining_self_loops
        loops = torch.arange(n).view(1, -1).repeat(2, 1)
        edge_index = torch.cat([edge_index[:, mask], loops], dim=1)
        h = lin(x)
        return torch.zeros_like(h).index_add_(0, edge_index[1], h[edge_index[0]])

    def forward(self, x, edge_index, keep, cols):
        h = self.conv(x, edge_index, self.lin1).relu()
        h = h[keep]
        return self.lin2(h), torch.masked_select(h, cols)


def _inputs(loop_share: float, keep_share: float):
    def inputs(batch):
        gen = torch.Generator().manual_seed(0)
        n, e = NODES * batch, EDGES * batch
        src = torch.randint(0, n, (e,), generator=gen)
        dst = (src + 1 + torch.randint(0, n - 1, (e,), generator=gen)) % n  # no self loops
        dst = torch.where(torch.rand(e, generator=gen) < loop_share, src, dst)
        keep = torch.rand(n, generator=gen) < keep_share if keep_share < 1 else torch.ones(n, dtype=torch.bool)
        cols = torch.rand(32, generator=gen) < keep_share if keep_share < 1 else torch.ones(32, dtype=torch.bool)
        return torch.randn(n, 16, generator=gen), torch.stack([src, dst]), keep, cols

    return inputs


def _loss(out, _inputs):
    return out[0].logsumexp(-1).mean() + out[1].mean()


def _estimate_and_truth(loop_share: float, keep_share: float, outputs: str):
    source = callable_source(SelfLoopGCN, _inputs(loop_share, keep_share), _loss)
    spec = RunSpec(model=source.origin, batch=2, target="cpu", data_dependent="upper-bound", outputs=outputs)
    trace = trace_step(source, spec)
    return trace, trace.peak()[0], measure_cpu_peak(source, spec)["peak_bytes"]


@pytest.mark.parametrize("outputs", ["kept", "freed"])
def test_bound_attained_is_exact(outputs):
    trace, estimated, real = _estimate_and_truth(0.0, 1.0, outputs)
    assert estimated == real, f"estimated {estimated} B, measured {real} B ({100 * (estimated - real) / real:+.3f}%)"
    assert trace.bounded_ops == {"index.Tensor (boolean mask)": 4, "index_put (boolean mask)": 2, "masked_select": 2}
    assert any("upper bound" in note for note in trace.notes)


def test_bound_not_attained_is_the_safe_side():
    _, estimated, real = _estimate_and_truth(0.5, 0.5, "kept")
    gap = (estimated - real) / real
    assert estimated >= real, f"estimated {estimated} B below the measured {real} B"
    assert gap > 0.2, f"half the edges are loops and half the nodes dropped, yet the bound is only {100 * gap:+.1f}% above"


@pytest.mark.parametrize("rows", [100, 1000])  # 6,400 elements: serial kernel; 64,000 (> GRAIN_SIZE): parallel
def test_masked_select_same_shape_mask(rows):
    class Select(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(64, 64)

        def forward(self, x, mask):
            return torch.masked_select(self.lin(x), mask)

    source = callable_source(Select, lambda b: (torch.randn(rows, 64), torch.ones(rows, 64, dtype=torch.bool)),
                             lambda out, _: out.mean())
    spec = RunSpec(model=source.origin, target="cpu", data_dependent="upper-bound")
    estimated, real = trace_step(source, spec).peak()[0], measure_cpu_peak(source, spec)["peak_bytes"]
    assert estimated == real, f"estimated {estimated} B, measured {real} B"


@pytest.mark.parametrize("name", ["nonzero", "unique"])
def test_real_values_need_less(name):
    """The test models' own inputs: about half of h > 0; 512 ids among 100 values. Both upper bounds."""
    ref = model_ref(name)
    spec = RunSpec(model=ref, batch=64, target="cpu", data_dependent="upper-bound")
    source = load_source(ref)
    estimated, real = trace_step(source, spec).peak()[0], measure_cpu_peak(source, spec)["peak_bytes"]
    assert estimated > real, f"{name}: estimated {estimated} B, measured {real} B"


def test_refuse_is_the_default_and_names_the_flag():
    ref = model_ref("nonzero")
    with pytest.raises(TraceError, match="--data-dependent upper-bound"):
        trace_step(load_source(ref), RunSpec(model=ref, batch=2, target="cpu"))
    assert RunSpec(model=ref).data_dependent == "refuse"


def test_kernels_removed_after_the_trace_even_when_it_fails():
    from torch._library.simple_registry import singleton

    before = {op: list(singleton.find(f"aten::{op}").fake_impl.kernels) for op in ("nonzero", "index.Tensor")}
    ref = model_ref("data_dependent")  # .item(): refused in both modes
    with pytest.raises(TraceError, match=r"_local_scalar_dense"):
        trace_step(load_source(ref), RunSpec(model=ref, batch=2, target="cpu", data_dependent="upper-bound"))
    trace_step(load_source(model_ref("nonzero")), RunSpec(model=model_ref("nonzero"), batch=2, data_dependent="upper-bound"))
    assert {op: list(singleton.find(f"aten::{op}").fake_impl.kernels) for op in before} == before
    with pytest.raises(TraceError):  # and refuse mode refuses again
        trace_step(load_source(model_ref("nonzero")), RunSpec(model=model_ref("nonzero"), batch=2, target="cpu"))


def test_api_yaml_and_json():
    est = memest.estimate(model_ref("unique"), batch=4, data_dependent="upper-bound")
    doc = json.loads(est.to_json())
    assert doc["bounded_ops"] == {"unique": 2} and doc["spec"]["data_dependent"] == "upper-bound"
    assert any("upper bound" in n and "sort buffers" in n for n in doc["notes"])
    cfg = config_from_dict({"model": model_ref("unique"), "data_dependent": "upper-bound"})
    assert cfg.spec().data_dependent == "upper-bound"
    with pytest.raises(memest.MemestError, match="refuse, upper-bound"):
        RunSpec(model="x.py", data_dependent="bound")


def test_cli_flag():
    from typer.testing import CliRunner

    from memest.cli import app

    result = CliRunner().invoke(app, ["estimate", model_ref("nonzero"), "--batch", "2", "--data-dependent",
                                      "upper-bound", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["bounded_ops"] == {"index.Tensor (boolean mask)": 2, "index_put (boolean mask)": 2}

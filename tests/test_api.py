"""The Python API (memest.estimate): the same pipeline as the CLI, from a reference or from factories
built under fake tensors, checked against a real CPU run of the same step."""

import json

import pytest
import torch
from torch import nn

import memest
from memest.errors import MemestError
from memest.sources.callables import callable_source
from memest.spec import RunSpec
from memest.validate.cpu_truth import measure_cpu_peak

from .conftest import model_ref


class Net(nn.Module):
    def __init__(self, width=256):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, width), nn.GELU(), nn.Linear(width, width), nn.GELU())
        self.head = nn.Linear(width, 10)

    def forward(self, x):
        return self.head(self.body(x))


def make_inputs(batch_size):
    return (torch.randn(batch_size, 64),)


def ce_loss(output, inputs):
    return nn.functional.cross_entropy(output, torch.zeros(output.shape[0], dtype=torch.long))


def test_factories_match_a_real_cpu_run():
    est = memest.estimate(lambda: Net(512), inputs=make_inputs, loss=ce_loss, batch=32, optim="adamw", target="cpu")
    source = callable_source(lambda: Net(512), make_inputs, ce_loss)
    real = measure_cpu_peak(source, RunSpec(model="api", batch=32, optim="adamw", target="cpu"))
    assert est.peak_allocated_bytes == pytest.approx(real["peak_bytes"], rel=0.005)
    assert est.report.model_type == "Net"


def test_reference_gives_the_cli_numbers():
    from typer.testing import CliRunner

    from memest.cli import app

    est = memest.estimate(model_ref("mlp"), batch=4, optim="adam")
    doc = json.loads(CliRunner().invoke(app, ["estimate", model_ref("mlp"), "--batch", "4", "--json"]).stdout)
    assert est.peak_allocated_bytes == doc["peak_allocated_bytes"]
    assert est.device_bytes == doc["device"]["device_bytes"]
    assert est.breakdown == doc["breakdown_at_peak"] and sum(est.breakdown.values()) == est.peak_allocated_bytes
    assert [r.name for r in est.layers] == [r["name"] for r in doc["layers"]]


def test_fits_takes_sizes_cards_and_bytes():
    est = memest.estimate(model_ref("mlp"), batch=4)
    needed = est.needed_bytes
    assert est.fits("11GB") and est.fits("rtx2080ti") and est.fits(needed)
    assert not est.fits("100MiB") and not est.fits(needed // 2)


def test_to_json_is_the_estimate_document():
    est = memest.estimate(lambda: Net(), inputs=make_inputs, batch=2, target="cpu")
    doc = json.loads(est.to_json())
    assert doc["schema_version"] == 1 and doc["peak_allocated_bytes"] == est.peak_allocated_bytes
    assert doc["needed_bytes"] == est.needed_bytes == est.peak_allocated_bytes  # --target cpu: no device model


def test_inputs_with_a_seq_and_other_options():
    def lm_inputs(batch_size, seq_len=32):
        return (torch.randint(0, 100, (batch_size, seq_len)),)

    def lm():
        return nn.Sequential(nn.Embedding(100, 32), nn.Linear(32, 100))

    short = memest.estimate(lm, inputs=lm_inputs, batch=2, target="cpu")
    long = memest.estimate(lm, inputs=lm_inputs, batch=2, seq=256, target="cpu", grad_accum=2)
    assert short.report.spec["seq"] == 32  # the inputs factory's default, shown
    assert long.peak_allocated_bytes > short.peak_allocated_bytes and long.report.spec["grad_accum"] == 2


@pytest.mark.parametrize("kwargs,needle", [
    ({"model": Net(), "inputs": make_inputs}, "factory"),
    ({"model": Net}, "inputs="),
    ({"model": Net, "inputs": torch.randn(2, 64)}, "callable"),
    ({"model": model_ref("mlp"), "inputs": make_inputs}, "model factory"),
    ({"model": Net, "inputs": make_inputs, "optim": "lion"}, "unknown optim='lion'"),  # the keyword (issue 22 item 27)
])
def test_api_errors_say_what_to_pass(kwargs, needle):
    with pytest.raises(MemestError, match=needle):
        memest.estimate(**kwargs)


def test_the_api_allocates_nothing_real():
    import resource

    # the factory runs under fake tensors: an 8 GiB layer (plus its gradient) costs no real memory
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    est = memest.estimate(lambda: nn.Linear(32768, 65536), inputs=lambda b: (torch.randn(b, 32768),), batch=1,
                          target="cpu", optim="sgd")
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - peak_before
    assert est.report.param_bytes == 32768 * 65536 * 4 + 65536 * 4
    assert est.peak_allocated_bytes > 2 * est.report.param_bytes  # weights + gradients, traced
    assert grown < 2**30, grown

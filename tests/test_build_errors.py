"""Errors raised while building the model or its inputs: the real error is kept (type and first line);
the CUDA hint is added only when the error is about a CUDA device that is not there."""

import pytest
from typer.testing import CliRunner

from memest.cli import app
from memest.errors import TraceError
from memest.features.registry import trace_step
from memest.sources import load_source
from memest.spec import RunSpec

from .conftest import model_ref


def _trace_error(name: str) -> str:
    ref = model_ref(name)
    with pytest.raises(TraceError) as info:
        trace_step(load_source(ref), RunSpec(model=ref, target="cpu"))
    return str(info.value)


def test_error_mentioning_cuda_keeps_the_real_error():
    message = _trace_error("build_bad_option")
    assert "ValueError: bad cuda_kernel_size option" in message
    assert "CUDA device" not in message


def test_a_cuda_call_keeps_the_error_and_adds_the_hint():
    message = _trace_error("build_cuda_call")
    assert "building the model raised AssertionError: Torch not compiled with CUDA enabled" in message  # torch's words
    assert "calls CUDA itself" in message and "--target cuda" in message


@pytest.mark.parametrize("name,needle", [("build_bad_option", "cuda_kernel_size"), ("build_cuda_call", "calls CUDA")])
def test_build_errors_are_one_line_exit_2(name, needle):
    result = CliRunner().invoke(app, ["estimate", model_ref(name)])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in result.output


def test_cuda_call_in_the_forward_gets_the_hint():
    message = _trace_error("forward_cuda_call")
    assert "the forward raised AssertionError: Torch not compiled with CUDA enabled" in message
    assert "calls CUDA itself" in message

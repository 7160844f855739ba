import contextlib
import os
from pathlib import Path

import pytest

# The CLI's tables are as wide as COLUMNS says (memest/report/console.py; 160 when it is unset and stdout is not
# a terminal). pytest-xdist's workers inherit COLUMNS=80 (README runs the suite on two workers), a developer's
# shell may export another width: the tests that read a table assert on the unset default, and the few that need
# a width set it themselves.
os.environ.pop("COLUMNS", None)

ROOT = Path(__file__).resolve().parent.parent
MODELS = Path(__file__).resolve().parent / "models"
CONFIGS = Path(__file__).resolve().parent / "configs"


def model_ref(name: str) -> str:
    """tests/models/NAME.py, examples/NAME.py (NAME:factory for another factory), or hf:tests/configs/NAME.json."""
    if name.startswith("hf:"):
        return f"hf:{CONFIGS / (name[3:] + '.json')}"
    name, sep, factory = name.partition(":")
    for folder in (MODELS, ROOT / "examples"):
        path = folder / f"{name}.py"
        if path.exists():
            return f"{path}{sep}{factory}"
    raise FileNotFoundError(name)


def traced_making(spec: dict, monkeypatch, cls: type, patches=()) -> tuple:
    """``spec`` traced (trace_step) with each ``(owner, attribute, value)`` of ``patches`` set meanwhile: (the Trace, the
    instances of ``cls`` made while tracing), for comparing a step traced with a shortcut on and off."""
    from memest.features.registry import trace_step
    from memest.sources import load_source
    from memest.spec import RunSpec

    made: list = []
    original_init = cls.__init__

    def init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        made.append(self)

    with monkeypatch.context() as patch:
        patch.setattr(cls, "__init__", init)
        for owner, attribute, value in patches:
            patch.setattr(owner, attribute, value)
        trace = trace_step(load_source(spec["model"]), RunSpec(**spec))
    return trace, made


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: traces full-size configs (seconds each)")
    _skip_steps_with_onednn_half_matmuls()
    _traces_collect_after_compile_as_the_truth_does(config)


def _traces_collect_after_compile_as_the_truth_does(config) -> None:
    """The suite's traces see dynamo's post-compile collection as the ground truth does: a full one, freeing the
    compile's reference cycle (and the first call's position ids it holds) as the compile ends, whatever this
    long-lived test process collected before (memest/validate/collector.py says why it otherwise depends on it)."""
    import contextlib

    from memest.validate.collector import full_collection_after_compile

    stack = contextlib.ExitStack()
    stack.enter_context(full_collection_after_compile())
    config.add_cleanup(stack.close)


ONEDNN_HALF = ("the real step ran {n} bf16/fp16 matmuls through oneDNN (this CPU: AVX-512/AMX), whose reorders and "
               "scratchpads memest does not model (its report says so; targets/cpu onednn_half_matmul): the byte-exact "
               "comparison is claimed on CPUs where they run ATen's own kernels (AVX2) and in fp32")


class _RankOnOneDNN(dict):
    """A gloo rank's row (distributed_truth) whose real step ran oneDNN bf16/fp16 matmuls: reading a measured figure
    of it skips the test that reads it. Only that case's rows: a batch of cases measured in one launch keeps the
    others (a whole batch skipped for one bf16 case among fp32 ones, before: each of its tests measured the batch
    again, then skipped)."""

    MEASURED = ("peak_bytes", "state_bytes", "phase_peaks")

    def __getitem__(self, key):
        if key in self.MEASURED:
            pytest.skip(ONEDNN_HALF.format(n=dict.__getitem__(self, "onednn_half_matmuls")))
        return dict.__getitem__(self, key)


def _skip_steps_with_onednn_half_matmuls() -> None:
    """On a CPU where oneDNN runs bf16/fp16 matmuls, a test whose real step (cpu_truth, or a gloo rank of its case in
    distributed_truth) ran one skips, naming why, as a convolution test skips on a CPU whose oneDNN convolutions
    memest does not model (real_cpu_peak). The truth functions count those matmuls (``onednn_half_matmuls``); the
    wrappers are installed before any test module imports them, and only on such CPUs (and with oneDNN on: a module
    using ``aten_cpu_kernels`` runs ATen's kernels and compares to the byte)."""
    from memest.targets.cpu import onednn_half_matmul
    from memest.validate import cpu_truth, distributed_truth

    if not onednn_half_matmul():
        return
    measure, peaks = cpu_truth._measure, distributed_truth.measure_distributed_peaks

    def measured(*args, **kwargs):
        result = measure(*args, **kwargs)
        if result.get("onednn_half_matmuls"):
            pytest.skip(ONEDNN_HALF.format(n=result["onednn_half_matmuls"]))
        return result

    def distributed(*args, **kwargs):
        results = peaks(*args, **kwargs)
        return [[_RankOnOneDNN(r) if r.get("onednn_half_matmuls") else r for r in ranks] for ranks in results]

    cpu_truth._measure, distributed_truth.measure_distributed_peaks = measured, distributed


@pytest.fixture
def ref():
    return model_ref


def lowest_of_runs(spec, ranks: list[dict], traced=None, more: int = 4) -> list[dict]:
    """``ranks`` (measure_distributed_peaks' rows of ``spec``) with each rank's lowest peak of this run and up to
    ``more`` runs, stopping once no rank reads above ``traced(rank_row)`` (its traced peak, when given). gloo's
    worker thread freeing a collective's buffer late on this 2-core machine only ever lifts a measured peak
    (docs/sharding.md): a context-parallel CP 2 case read +1.6% to +5.8% on one rank in 2 of 10 runs with the two
    cores busy (the lifted peak moved to FSDP's next all-gather), the rest within 12 B of the trace, and under CI
    plus other jobs three runs in a row were lifted once. The harness now waits for gloo's worker threads after each
    collective (distributed_truth._gloo_workers_settle_after_each_wait: 16 of 16 runs of that case exact), so this is
    a second guard only. A truth test whose ranks read above the trace measures again; an estimate that is low on
    every run still fails."""
    above = (lambda r: True) if traced is None else (lambda r: r["peak_bytes"] > traced(r))
    return _measured_again_while(spec, ranks, above, lambda a, b: min(a, b, key=lambda r: r["peak_bytes"]), more)


def lowest_phase_peaks_of_runs(spec, ranks: list[dict], above, more: int = 4) -> list[dict]:
    """``ranks`` with each rank's ``phase_peaks`` the lowest of this run and up to ``more`` runs (phase by phase),
    measured again while ``above(rank_row)`` says a rank reads above its traced phases: :func:`lowest_of_runs` for
    the per-phase peaks of a marked step (features/grpo.py). GRPO's generation phase read +64 B / +128 B on one DDP
    rank in one of two CI runs of the suite (2026-11-29; exact in isolation, and on the other run); with the collector
    off in the ranks one run read +132 B and the run after it exact: the lift follows the rank process's history
    (reference cycles and when they are collected, what the forkserver's earlier forks left), not the step. A lifted
    reading only ever raises a measured peak; an estimate that is low on every run still fails."""

    def lowest(a: dict, b: dict) -> dict:
        return {**a, "peak_bytes": min(a["peak_bytes"], b["peak_bytes"]),
                "phase_peaks": {k: min(v, b["phase_peaks"][k]) for k, v in a["phase_peaks"].items()}}

    return _measured_again_while(spec, ranks, above, lowest, more)


def _measured_again_while(spec, ranks: list[dict], above, lowest, more: int) -> list[dict]:
    """``ranks``, each merged by ``lowest(row, new_row)`` with up to ``more`` runs of ``spec``, measured again while
    ``above(row)`` holds for one of them (the loop of :func:`lowest_of_runs` and :func:`lowest_phase_peaks_of_runs`)."""
    from memest.validate.distributed_truth import measure_distributed_peaks

    for _ in range(more):
        if not any(above(r) for r in ranks):
            break
        again = measure_distributed_peaks([spec])[0]
        ranks = [lowest(a, b) for a, b in zip(ranks, again, strict=True)]
    return ranks


_RUNNER = []


def run(*args, env=None):
    """The CLI in-process on ``args`` (each made a string), as a user would type them."""
    from typer.testing import CliRunner

    from memest.cli import app

    if not _RUNNER:
        _RUNNER.append(CliRunner())
    return _RUNNER[0].invoke(app, [str(a) for a in args], env=env)


def one_line_error(result, code=2, *, alone: bool = False, full_prefix: bool = False, traceback: bool = True,
                   internal: bool = False) -> str:
    """The one error line of a CLI ``result`` that exited ``code``. The strictness: ``alone``: it is stderr's only
    line, starting 'memest: error: ' (else: the only line starting 'memest: error' among progress lines, and with
    ``full_prefix`` starting 'memest: error: '); ``traceback``: stderr holds no 'Traceback'; ``internal``: nor
    'internal error'. Each test file binds the strictness it has always asserted."""
    assert result.exit_code == code, (result.exit_code, result.stdout, result.stderr)
    if alone:
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("memest: error: "), result.stderr
    else:
        lines = [line for line in result.stderr.strip().splitlines() if line.startswith("memest: error")]
        assert len(lines) == 1, result.stderr
        if full_prefix:
            assert lines[0].startswith("memest: error: "), result.stderr
    if traceback:
        assert "Traceback" not in result.stderr, result.stderr
    if internal:
        assert "internal error" not in result.stderr, result.stderr
    return lines[0]


def real_cpu_peak(source, spec) -> int:
    """The real CPU step's peak bytes (memest.validate.cpu_truth.measure_cpu_peak) for a test that compares it with
    the trace to the byte. Skips where that comparison is not claimed: the model has convolutions and this CPU is not
    AVX-512, for which memest's oneDNN convolution rules are written (targets/cpu/onednn_conv.py, docs/limitations.md;
    tests/test_accuracy_cpu.py's AVX512 mark). oneDNN and ATen pick other kernels per ISA: on an AVX2 AMD EPYC a
    Qwen2-VL patch embedding's backward held 757,376 B memest does not add, and in bf16 the Conv3d ran ATen's
    slow_conv3d, whose column buffer (a resize_) made the peak."""
    import torch
    from torch import nn

    from memest.targets.cpu import conv_modelled
    from memest.validate.cpu_truth import measure_cpu_peak

    if not conv_modelled() and any(isinstance(m, nn.modules.conv._ConvNd) for m in source.build_model().modules()):
        pytest.skip("the model has convolutions; memest's oneDNN convolution rules are for AVX-512 CPUs, this one is "
                    f"{torch.backends.cpu.get_cpu_capability()}")
    return measure_cpu_peak(source, spec)["peak_bytes"]


def onednn_bf16() -> bool:
    """oneDNN runs bf16 kernels (mkldnn_rnn_layer in bf16) only on CPUs with AVX-512 (its bf16 check); elsewhere a
    bf16 LSTM runs ATen's own ops or fails to build a primitive, so a test of oneDNN's bf16 LSTM cannot run."""
    import torch

    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


@contextlib.contextmanager
def onednn(enabled: bool):
    """torch's oneDNN switch (``torch.backends.mkldnn.enabled``, nothing else of ``mkldnn.flags``) set for a block:
    the trace reads it where the CPU kernel depends on it (targets/cpu: ``_scaled_mm``'s oneDNN float8 path, oneDNN's
    bf16/fp16 matmuls), cpu_truth's real step runs under it, and distributed_truth's gloo ranks get the caller's."""
    import torch

    was = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = enabled
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = was


@pytest.fixture(scope="module")
def aten_cpu_kernels():
    """A module's traces and real steps with oneDNN off, both alike: ATen's own CPU kernels, the ones every CPU
    without AVX-512 runs anyway (nothing changes there). On AMX CPUs oneDNN's float8 matmul (``mkldnn_scaled_mm``,
    tensorwise scales) is the slow part of a float8 step: 0.5 s for one 128 x 256 x 1024 product against 1.3 ms
    emulated (torch 2.13.0+cpu, Intel Xeon with AMX-INT8), 75 s for a transformer step that takes 0.6 s without it.
    Its memory rule is checked call by call (tests/test_fp8.py's kernel-rule test) and in one whole step with oneDNN
    on (test_fp8.py); its bf16 matmuls, whose scratch is not modelled, run ATen's kernels too, so those steps compare
    to the byte here as on AVX2 CPUs instead of skipping."""
    with onednn(False):
        yield


def step_kernels(source, spec):
    """The oneDNN switch a truth test runs one step under, traced and real alike: off (``aten_cpu_kernels``'s
    reasons) for a bf16/fp16 step of a model without convolutions or RNNs, torch's default otherwise (memest's CPU
    rules for convolutions and LSTMs are oneDNN's: targets/cpu/onednn_conv.py, onednn_rnn.py). For a file that mixes
    such models with convolutional or recurrent ones."""
    from torch import nn

    from memest.spec.choices import Precision

    if Precision(spec.precision) == Precision.FP32:
        return contextlib.nullcontext()
    oneDNN_modelled = (nn.modules.conv._ConvNd, nn.RNNBase)
    if any(isinstance(m, oneDNN_modelled) for m in source.build_model().modules()):
        return contextlib.nullcontext()
    return onednn(False)

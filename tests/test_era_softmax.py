"""The benchmark's reproduction of torch < 1.11 softmax autograd (scripts/models/hf_bert_large_2022.py,
used to score Hugging Face's 2022 V100 runs): it holds the softmax input until backward, one scores tensor
per layer more than today's softmax, and memest traces it as the real CPU run allocates."""

from memest.features.registry import trace_step
from memest.sources import load_source
from memest.spec import RunSpec
from memest.trace.events import Category
from memest.validate.cpu_truth import measure_cpu_peak

from .conftest import model_ref
from .models.legacy_softmax import DIM, HEADS, LAYERS


def _trace(factory: str, batch=2, seq=32):
    ref = model_ref(f"legacy_softmax:{factory}")
    spec = RunSpec(model=ref, target="cpu", batch=batch, seq=seq, optim="sgd")
    source = load_source(ref)
    return trace_step(source, spec), source, spec


def _saved_activation_bytes(trace) -> int:
    return sum(r.nbytes for r in trace.storages if r.category == Category.ACTIVATIONS and r.iteration == 1)


def test_legacy_softmax_holds_one_scores_tensor_more_per_layer():
    legacy, _, _ = _trace("build_model")
    today, _, _ = _trace("build_today")
    scores = 2 * HEADS * 32 * 32 * 4  # batch x heads x seq x seq, fp32
    assert _saved_activation_bytes(legacy) - _saved_activation_bytes(today) == LAYERS * scores
    assert DIM % HEADS == 0


def test_legacy_softmax_traced_as_the_real_cpu_run():
    trace, source, spec = _trace("build_model")
    real = measure_cpu_peak(source, spec)["peak_bytes"]
    assert abs(trace.peak()[0] - real) <= 0.001 * real  # measured: 24 B of 740 kB (a CPU scalar)

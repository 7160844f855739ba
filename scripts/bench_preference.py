"""One --preference step at a larger scale than tests/test_preference_methods.py: traced peak vs the real CPU step
running trl's own step code (the tests' stand-in trainers), on hf:gpt2's config (124M, vocab 50,257, random weights).

    PYTHONPATH=$PWD python scripts/bench_preference.py orpo 256      # method, seq; batch 2, adamw, fp32
"""

from __future__ import annotations

import sys
import time

sys.path.insert(0, ".")

from memest.features import preference_kto, preference_logits  # noqa: E402
from memest.features.registry import trace_step  # noqa: E402
from memest.sources import load_source  # noqa: E402
from memest.spec import RunSpec  # noqa: E402
from memest.validate.cpu_truth import measure_cpu_peak  # noqa: E402
from tests.test_preference_methods import _trl_kto_forward, _trl_logits_forward  # noqa: E402


def main(method: str, seq: int, model: str = "hf:gpt2") -> None:
    spec = RunSpec(model=model, batch=2, seq=seq, target="cpu", optim="adamw", preference=method)
    source = load_source(model)
    start = time.perf_counter()
    estimated = trace_step(source, spec).peak()[0]
    traced_s = time.perf_counter() - start
    preference_logits.LogitsPreferenceStep.forward = _trl_logits_forward
    preference_kto.KTOStep.forward = _trl_kto_forward
    start = time.perf_counter()
    real = measure_cpu_peak(source, spec)
    print(f"{method} {model} batch 2 seq {seq}: traced {estimated:,} B, measured {real['peak_bytes']:,} B, "
          f"difference {estimated - real['peak_bytes']:,} B (op at the real peak {real['op_at_peak']}); "
          f"trace {traced_s:.0f} s, real step {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), *sys.argv[3:])

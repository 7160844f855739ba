"""--mode inference against a real torch.inference_mode() forward of the same inputs (issue 22, 25a).

For tiny configs of external transformers families (Qwen2, Falcon, BLOOM, Gemma-2, Mamba: their own
transformers code) and the nanoGPT-style model file tests/models/nanogpt.py: memest's traced peak, and the
CPU allocator's peak (torch.profiler memory events) of one real forward of the source's example inputs as
built, labels included, independent of memest's step code. Prints one line per model.

    PYTHONPATH=. python scripts/inference_accuracy.py [--batch 4] [--seq 128]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from memest.features.registry import trace_step  # noqa: E402
from memest.sources import load_source  # noqa: E402
from memest.spec import RunSpec  # noqa: E402
from tests.test_issue22_accuracy import FAMILIES, _real_forward_peak  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    args = parser.parse_args()
    import transformers

    with tempfile.TemporaryDirectory() as tmp:
        refs = []
        for model_type, (arch, kw) in FAMILIES.items():
            config = transformers.AutoConfig.for_model(model_type, **kw).to_dict()
            config["architectures"] = [arch]
            path = Path(tmp) / f"{model_type}.json"
            path.write_text(json.dumps(config))
            refs.append((f"hf:{path}", args.seq))
        refs.append((str(ROOT / "tests" / "models" / "nanogpt.py"), None))  # its block size is the sequence
        for ref, seq in refs:
            spec = RunSpec(model=ref, batch=args.batch, seq=seq, target="cpu", mode="inference")
            estimated, _ = trace_step(load_source(ref), spec).peak()
            real = _real_forward_peak(ref, args.batch, seq)
            print(f"{Path(ref).stem}: estimated {estimated:,} B, real forward {real:,} B, "
                  f"{100 * (estimated - real) / real:+.3f}%", flush=True)


if __name__ == "__main__":
    main()

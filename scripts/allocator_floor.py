"""The allocator floor against the replay's need, per allocator setting and number of traced steps
(docs/accuracy.md, "Near capacity"). CPU only: fake tensors and the allocator replay.

    python scripts/allocator_floor.py

Prints, per step and steps traced: peak reserved (unconstrained), floor and need (smallest allocator
limit the replay completes in), in MiB, for the default allocator and expandable_segments:True.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from memest.device.allocator import allocator_floor, min_device_limit, parse_alloc_conf, replay  # noqa: E402
from memest.device.usage import allocator_events  # noqa: E402
from memest.estimator import estimate  # noqa: E402
from memest.spec import RunSpec  # noqa: E402

MIB = 2**20
STEPS = {
    "hf:gpt2 batch 4 seq 256 bf16-mixed": dict(model="hf:gpt2", batch=4, seq=256, precision="bf16-mixed"),
    "transformer batch 2 seq 128": dict(model=str(ROOT / "examples/transformer.py"), batch=2, seq=128),
    "gpt2-tiny batch 4 seq 128": dict(model=f"hf:{ROOT / 'tests/configs/gpt2-tiny.json'}", batch=4, seq=128),
}


def main() -> None:
    print("step | steps traced | allocator | peak reserved | floor | need (MiB)")
    for name, kw in STEPS.items():
        for iterations in (1, 2, 3):
            result = estimate(RunSpec(optim="adamw", iterations=iterations, **kw))
            events = allocator_events(result.trace, result.report.device.fixed_costs)
            for conf_text in ("", "expandable_segments:True"):
                conf = parse_alloc_conf(conf_text)
                run = replay(events, conf)
                need = min_device_limit(events, conf, unconstrained=run)
                print(f"{name} | {iterations} | {conf_text or 'default'} | {run.peak_reserved / MIB:.0f} | "
                      f"{allocator_floor(events, conf) / MIB:.0f} | {need / MIB:.0f}")


if __name__ == "__main__":
    main()

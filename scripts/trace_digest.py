"""A digest of every traced Trace (sha256 of dataclasses.asdict: every StorageRecord, event, phase mark, module
record, FLOP count, note) for a set of steps, as JSON: run it on two checkouts and compare, to show that a change
to the tracer changes no byte of any trace. Usage: PYTHONPATH=CHECKOUT python scripts/trace_digest.py OUT.json"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys

from memest.features.registry import trace_step
from memest.sources import load_source
from memest.spec import RunSpec

LLAMA, GPT2 = "hf:tests/configs/llama-tiny.json", "hf:tests/configs/gpt2-tiny.json"
SPECS = [
    dict(model=LLAMA, batch=2, seq=64, target="cuda"),
    dict(model=LLAMA, batch=2, seq=64, target="cuda", activation_offload="torchtune"),
    dict(model=GPT2, batch=4, seq=64, target="cuda", activation_offload="torchtune"),
    dict(model=LLAMA, batch=2, seq=64, target="cpu", optim="sgd", activation_offload="torchtune"),
    dict(model=LLAMA, batch=2, seq=64, target="cuda", activation_offload="torchtune", precision="bf16-mixed",
         checkpointing="blocks"),
    dict(model=LLAMA, batch=2, seq=64, target="cuda", activation_offload="save-on-cpu"),
    dict(model="examples/transformer.py", batch=2, seq=64, target="cuda", optim="adamw"),
    dict(model="examples/transformer.py", batch=2, seq=64, target="cuda", optim="adamw", fp8="tensorwise"),
    dict(model="examples/transformer.py", batch=2, seq=64, target="cuda", optim="adamw", fp8="rowwise",
         precision="bf16-mixed"),
    dict(model="examples/transformer.py", batch=2, seq=64, target="cpu", optim="sgd", fp8="tensorwise"),
    dict(model=LLAMA, batch=2, seq=128, target="cuda", fp8="tensorwise", checkpointing="blocks"),
    dict(model=LLAMA, batch=2, seq=64, target="cuda", mode="inference"),
    dict(model="hf:tests/configs/mixtral-tiny.json", batch=2, seq=64, target="cuda", shard="zero3", world_size=2),
    dict(model="examples/transformer.py", batch=2, seq=64, target="cuda", optim="adamw", fp8="rowwise"),
    dict(model=LLAMA, batch=2, seq=64, target="cuda", fp8="tensorwise", shard="zero3", world_size=2,
         fp8_all_gather="float8-precomputed"),
    dict(model="examples/transformer.py", batch=2, seq=64, target="cuda", optim="adamw", fp8="mxfp8",
         compute_capability=(10, 0)),
    dict(model=LLAMA, batch=2, seq=64, target="cuda", fp8="mxfp8-wgrad-hp", compute_capability=(10, 0),
         precision="bf16", checkpointing="blocks"),
    dict(model="examples/transformer.py", batch=2, seq=64, target="cpu", optim="sgd", fp8="mxfp8-emulated"),
    # --optim-in-backward: torch.optim's update functions replayed per parameter (features/optim_in_backward.py)
    dict(model=GPT2, batch=2, seq=32, target="cuda", optim="adamw", optim_in_backward=True),
    dict(model=LLAMA, batch=1, seq=8, target="cpu", optim="adamw", optim_in_backward=True),
    dict(model=GPT2, batch=1, seq=8, target="cuda", optim="sgd-momentum", optim_in_backward=True),
    dict(model=LLAMA, batch=2, seq=32, target="cuda", optim="adamw", optim_in_backward=True, shard="zero3",
         world_size=2),
    dict(model=LLAMA, batch=2, seq=64, target="cuda", optim="adamw", shard="zero2", world_size=2,
         checkpointing="selective"),
    # --checkpointing selective: the blocks' recomputations replayed (trace/recompute.py)
    dict(model="examples/transformer.py", batch=2, seq=64, target="cuda", optim="adamw", precision="bf16-mixed",
         checkpointing="selective"),
    dict(model="examples/transformer.py", batch=2, seq=64, target="cpu", optim="adamw", checkpointing="selective"),
    dict(model=LLAMA, batch=2, seq=64, target="cuda", precision="bf16-mixed", checkpointing="selective"),
    dict(model=GPT2, batch=2, seq=64, target="cpu", checkpointing="selective", grad_accum=2),
    dict(model=LLAMA, batch=2, seq=64, target="cuda", checkpointing="selective", activation_offload="torchtune"),
    dict(model=LLAMA, batch=2, seq=64, target="cuda", checkpointing="selective", fp8="tensorwise"),
    dict(model=LLAMA, batch=2, seq=32, target="cuda", optim="adamw", checkpointing="selective", optim_in_backward=True),
    dict(model=LLAMA, batch=2, seq=64, target="cuda", optim="adamw", shard="zero3", world_size=2,
         checkpointing="selective", precision="bf16-mixed"),
    dict(model="tests/models/sac_transformer.py", batch=2, seq=64, target="cuda", optim="sgd",
         checkpointing="selective:checkpoint_policy"),
    dict(model="tests/models/sac_hf.py", batch=2, seq=64, target="cpu", optim="sgd",
         checkpointing="selective:checkpoint_policy"),
    # vision-language: the replays pass over KnownValues (sources/hf_values.py); Qwen2.5-VL's window blocks
    dict(model="hf:tests/configs/qwen2-vl-tiny.json", batch=2, seq=32, images=2, image_size="140x250", target="cuda",
         precision="bf16-mixed", optim="adamw", checkpointing="selective"),
    dict(model="hf:tests/configs/qwen2.5-vl-tiny.json", batch=1, seq=16, images=1, image_size="140x250", target="cpu",
         checkpointing="selective"),
    dict(model="tests/models/videomae_tiny.py", batch=2, target="cpu", optim="adamw"),
]


def main(out: str) -> None:
    digests = {}
    for spec in SPECS:
        key = json.dumps(spec, sort_keys=True)
        trace = trace_step(load_source(spec["model"]), RunSpec(**spec))
        text = repr(dataclasses.asdict(trace))
        digests[key] = [hashlib.sha256(text.encode()).hexdigest(), len(trace.events), trace.peak()[0]]
        print(key, digests[key], flush=True)
    with open(out, "w") as f:
        json.dump(digests, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])

"""Per-layer saved activations of transformers' Llama vs torchtitan's Llama (scripts/models/titan_llama.py),
Llama-2-7B shapes, bf16 weights (torchtitan's FSDP2 MixedPrecisionPolicy(param_dtype=bf16): the whole forward in
bf16). Two measurements, printed as tables:

1. real CPU run (no fakes): every tensor autograd saves while the second decoder layer runs, from its graph node
   (name, shape, dtype, bytes; one row per storage; weights, buffers and tensors shared by all layers left out),
   at --batch x --seq, then scaled linearly to 8 x 2048 (exact for everything but attention, whose saved output
   and logsumexp are linear in seq too);
2. memest's estimate (--target cuda --precision bf16): the layer's activation_bytes row, 2-layer models,
   at 8 x 2048 directly.

    PYTHONPATH=. python scripts/compare_llama_layers.py [--batch 1 --seq 128] [--no-memest]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts" / "models"))
import titan_llama  # noqa: E402

GIB = 1024**3
BUNDLED = ROOT / "memest" / "data" / "models" / "llama-2-7b.json"


def hf_llama(dim: int, layers: int, heads: int, hidden: int, vocab: int):
    import transformers

    config = transformers.LlamaConfig(hidden_size=dim, intermediate_size=hidden, num_hidden_layers=layers,
                                      num_attention_heads=heads, num_key_value_heads=heads, vocab_size=vocab,
                                      max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0,
                                      tie_word_embeddings=False, use_cache=False, attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(config)


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def saved_in_layer(model, layer, tokens) -> list[dict]:
    """Tensors autograd saves while ``layer`` runs forward: one row per storage, with the graph nodes that
    saved it; weights/buffers and storages also saved outside ``layer`` are marked."""
    inside, outside, state = {}, set(), {"in": False}

    def pack(t):
        (inside.setdefault(_storage(t), t) if state["in"] else outside.add(_storage(t)))
        return t

    pre = layer.register_forward_pre_hook(lambda *_: state.__setitem__("in", True))
    post = layer.register_forward_hook(lambda *_: state.__setitem__("in", False))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(tokens)
    finally:
        pre.remove()
        post.remove()
    logits = out.logits if hasattr(out, "logits") else out
    frozen = {_storage(p) for p in list(model.parameters()) + list(model.buffers())}
    who: dict[int, list[str]] = {}
    seen, stack = set(), [logits.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for attr in dir(node):
            if attr.startswith("_saved_"):
                try:
                    val = getattr(node, attr)
                except RuntimeError:
                    continue
                for t in val if isinstance(val, tuple) else (val,):
                    if isinstance(t, torch.Tensor) and _storage(t) in inside:
                        who.setdefault(_storage(t), []).append(f"{node.name()}.{attr[7:]}")
        stack.extend(n for n, _ in node.next_functions)
    rows = []
    for ptr, t in inside.items():
        kind = "weight/buffer" if ptr in frozen else "shared" if ptr in outside else "layer"
        rows.append({"saved_by": ", ".join(sorted(set(who.get(ptr, ["?"])))), "shape": list(t.shape),
                     "dtype": str(t.dtype).replace("torch.", ""), "bytes": t.untyped_storage().nbytes(), "kind": kind})
    return rows


def memest_layer_bytes(batch: int, seq: int) -> dict[str, int]:
    import memest

    cfg = json.loads(BUNDLED.read_text())
    cfg["num_hidden_layers"] = 2
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "llama-2-7b-2layers.json"
        path.write_text(json.dumps(cfg))
        hf = memest.estimate(f"hf:{path}", batch=batch, seq=seq, precision="bf16", target="cuda", optim="adamw")
    titan = memest.estimate(f"{ROOT / 'scripts/models/titan_llama.py'}", batch=batch, seq=seq, precision="bf16",
                            target="cuda", optim="adamw")
    rows = {r.name: r.activation_bytes for r in hf.layers} | {"titan:" + r.name: r.activation_bytes for r in titan.layers}
    return {"transformers": rows["model.layers.1"], "torchtitan": rows["titan:layers.1"]}


def measure(batch: int, seq: int, dim: int = titan_llama.DIM, heads: int = titan_llama.HEADS,
            vocab: int = titan_llama.VOCAB) -> dict[str, list[dict]]:
    hidden = titan_llama.ffn_hidden(dim)
    torch.manual_seed(0)
    tokens = torch.randint(0, vocab, (batch, seq))
    out = {}
    for name, build, layer_of in (
        ("transformers", lambda: hf_llama(dim, 2, heads, hidden, vocab), lambda m: m.model.layers[1]),
        ("torchtitan", lambda: titan_llama.make(dim, 2, heads, vocab, hidden, max_seq=max(seq, 64)), lambda m: m.layers[1]),
    ):
        model = build().to(torch.bfloat16)
        out[name] = saved_in_layer(model, layer_of(model), tokens)
        del model
    return out


def layer_total(rows: list[dict]) -> int:
    return sum(r["bytes"] for r in rows if r["kind"] == "layer")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--no-memest", action="store_true")
    args = ap.parse_args()
    scale = (8 * 2048) / (args.batch * args.seq)
    result = measure(args.batch, args.seq)
    for name, rows in result.items():
        print(f"\n{name}: saved by the 2nd decoder layer, real CPU run, batch {args.batch} seq {args.seq} bf16")
        print(f"{'saved by (autograd node.field)':70} {'shape':22} {'dtype':9} {'bytes':>10} {'at 8x2048 MiB':>13}  kind")
        for r in sorted(result[name], key=lambda r: -r["bytes"]):
            print(f"{r['saved_by'][:70]:70} {str(r['shape']):22} {r['dtype']:9} {r['bytes']:>10} "
                  f"{r['bytes'] * scale / 2**20:>13.1f}  {r['kind']}")
        print(f"per-layer total (kind=layer): {layer_total(rows)} B -> {layer_total(rows) * scale / GIB:.3f} GiB at 8x2048")
    diff = layer_total(result["transformers"]) - layer_total(result["torchtitan"])
    print(f"\ntransformers - torchtitan per layer: {diff} B -> {diff * scale / GIB:.3f} GiB at 8x2048")
    if not args.no_memest:
        est = memest_layer_bytes(8, 2048)
        print("\nmemest estimate (--target cuda --precision bf16, 8x2048), activation_bytes of layers.1:")
        for name, b in est.items():
            print(f"  {name:13} {b / GIB:.3f} GiB")
        print(f"  difference    {(est['transformers'] - est['torchtitan']) / GIB:.3f} GiB")


if __name__ == "__main__":
    main()

"""scripts/models/titan_llama.py (torchtitan's Llama ops) beside transformers' Llama: memest's per-layer saved
activations against what autograd really saves on the CPU (scripts/compare_llama_layers.py), tiny shapes."""

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "scripts" / "models"))

import compare_llama_layers as cmp  # noqa: E402
import titan_llama  # noqa: E402

import memest  # noqa: E402

DIM, HEADS, VOCAB, HIDDEN, BATCH, SEQ = 64, 4, 128, titan_llama.ffn_hidden(64, 16), 2, 32


def _builders():
    return {
        "transformers": (lambda: cmp.hf_llama(DIM, 2, HEADS, HIDDEN, VOCAB), "model.layers.1"),
        "torchtitan": (lambda: titan_llama.make(DIM, 2, HEADS, VOCAB, HIDDEN, max_seq=SEQ), "layers.1"),
    }


@pytest.fixture(scope="module")
def measured():
    torch.manual_seed(0)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ))
    out = {}
    for name, (build, _) in _builders().items():
        model = build().to(torch.bfloat16)
        layer = model.model.layers[1] if name == "transformers" else model.layers[1]
        out[name] = cmp.saved_in_layer(model, layer, tokens)
    return out


@pytest.mark.parametrize("name", ["transformers", "torchtitan"])
def test_memest_layer_matches_cpu_saved_tensors(measured, name):
    build, row = _builders()[name]

    def inputs(batch_size, seq_len=SEQ):
        return (torch.randint(0, VOCAB, (batch_size, seq_len)),)

    def loss(output, batch):
        logits = output.logits if hasattr(output, "logits") else output
        return logits.float().mean()

    est = memest.estimate(build, inputs, batch=BATCH, seq=SEQ, precision="bf16", target="cpu", loss=loss)
    layer = {r.name: r.activation_bytes for r in est.layers}[row]
    assert layer == cmp.layer_total(measured[name])


def test_titan_norm_saves_fp32_on_cpu(measured):
    """On the CPU nn.RMSNorm runs composite: each norm keeps its fp32 input and fp32 normalized output."""
    fp32_rows = [r for r in measured["torchtitan"] if r["kind"] == "layer" and r["dtype"] == "float32"
                 and r["shape"] == [BATCH, SEQ, DIM]]
    assert len(fp32_rows) == 4

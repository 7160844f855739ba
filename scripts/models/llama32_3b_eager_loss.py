"""transformers' Llama with the shapes of torchtune's Llama 3.2 3B (benchmarks/configs/llama-3.2-3b.json), its
loss computed outside the model as torchtune's recipe does: the model returns bf16 logits, the fp32 upcast and
the cross-entropy run after it. For scripts/bench_gpu_recipes.py's compile isolation: with --compile the model
is compiled (torch.compile(model)) and the upcast and the loss stay outside the graph, where torchtune's
TransformerDecoder makes its fp32 logits eagerly (self.output(h).float(),
https://github.com/meta-pytorch/torchtune/blob/1814feb17a9038e1a8053ce93111bd26774a8db6/torchtune/modules/transformer.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

CONFIG = Path(__file__).resolve().parents[2] / "benchmarks" / "configs" / "llama-3.2-3b.json"


def build_model() -> torch.nn.Module:
    # use_cache=False, as memest's hf: source builds a model for training (memest/sources/hf.py) and torchtune's
    # training forward keeps no KV cache: with transformers' default (True) each decoder layer updates the forward's
    # DynamicCache at its own layer_idx, a guard that recompiles the shared block forward under --compile-scope blocks
    fields = {k: v for k, v in json.loads(CONFIG.read_text()).items() if not k.startswith("_")}
    return LlamaForCausalLM(LlamaConfig(**{**fields, "use_cache": False}))


def example_inputs(batch_size: int, seq_len: int = 4096):
    return {"input_ids": torch.randint(0, 128256, (batch_size, seq_len))}


def compute_loss(output, inputs) -> torch.Tensor:
    logits = output.logits.float()
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), inputs["input_ids"].reshape(-1))

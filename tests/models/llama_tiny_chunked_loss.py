"""The tiny Llama (tests/configs/llama-tiny.json, vocab 8192 so the loss weighs on the peak, use_cache=False) with
torchtune's CEWithChunkedOutputLoss after it, 4 chunks, eager: the tiny stand-in of
scripts/models/llama32_3b_chunked_loss.py (tests/test_compile_blocks.py; llama_tiny_chunked_compiled_loss.py
compiles its compute_cross_entropy)."""

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "llama-tiny.json"
CHUNKS = 4


def build_model() -> torch.nn.Module:
    fields = {k: v for k, v in json.loads(CONFIG.read_text()).items() if not k.startswith("_")}
    return LlamaForCausalLM(LlamaConfig(**{**fields, "use_cache": False, "vocab_size": 8192}))


def example_inputs(batch_size: int, seq_len: int = 64):
    return {"input_ids": torch.randint(0, 8192, (batch_size, seq_len))}


def _compute_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), labels, reduction="sum", ignore_index=-100)


def chunked_loss(compute_cross_entropy):
    """CEWithChunkedOutputLoss's forward over ``compute_cross_entropy`` (eager here, compiled in
    llama_tiny_chunked_compiled_loss.py)."""

    def compute_loss(output, inputs) -> torch.Tensor:
        labels = inputs["input_ids"]
        total_elements = (labels != -100).sum()
        total = 0.0
        for logits, target in zip(output.logits.chunk(CHUNKS, dim=1), labels.chunk(CHUNKS, dim=1), strict=True):
            total += compute_cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))
        return total / total_elements

    return compute_loss


compute_loss = chunked_loss(_compute_cross_entropy)

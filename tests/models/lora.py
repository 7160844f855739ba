"""LoRA fine-tuning as peft's docs write it: get_peft_model(model, LoraConfig(...)) in build_model.
build_model: a plain torch model with LoRA on its attention projections; build_llama: a tiny transformers
Llama (tests/configs/llama-tiny.json's) with LoRA on q_proj and v_proj. Needs peft (memest[peft])."""

import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB, DIM = 1000, 64


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.query = nn.Linear(DIM, DIM)
        self.key = nn.Linear(DIM, DIM)
        self.value = nn.Linear(DIM, DIM)
        self.out = nn.Linear(DIM, DIM)
        self.ff = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x):
        h = self.norm(x)
        q, k, v = (lin(h).unflatten(-1, (4, DIM // 4)).transpose(1, 2) for lin in (self.query, self.key, self.value))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2)
        x = x + self.out(attn)
        return x + self.ff(x)


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block() for _ in range(2)])
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, input_ids, labels=None):
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build_model():
    return get_peft_model(TinyLM(), LoraConfig(r=8, lora_alpha=16, target_modules=["query", "value"]))


def build_llama():
    config = LlamaConfig(
        hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, max_position_embeddings=256, use_cache=False,
    )
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.05, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    return get_peft_model(LlamaForCausalLM(config), lora)


def example_inputs(batch_size, seq_len=64):
    ids = torch.randint(0, VOCAB, (batch_size, seq_len))
    return {"input_ids": ids, "labels": ids.clone()}


def compute_loss(output, inputs):
    if hasattr(output, "loss"):
        return output.loss
    return F.cross_entropy(output.flatten(0, 1), inputs["labels"].flatten())

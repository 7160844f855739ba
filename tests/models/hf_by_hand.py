"""transformers models built by hand in a model file, as users write them: config classes, no hub.
build_model is tests/configs/llama-tiny.json's model (the same as hf:tests/configs/llama-tiny.json);
build_qwen2 a tiny Qwen2 that takes long sequences; build_adapter_style freezes the model but one projection
and makes the embeddings' output require grad, as peft and transformers' gradient checkpointing do."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

VOCAB = 1000


def build_model():
    config = LlamaConfig(
        hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, use_cache=False,
    )
    return LlamaForCausalLM(config)


def build_qwen2():
    config = Qwen2Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, max_position_embeddings=4096, use_cache=False,
    )
    return Qwen2ForCausalLM(config)


def build_adapter_style():
    model = build_model()
    for p in model.parameters():
        p.requires_grad_(False)
    model.model.layers[0].self_attn.q_proj.weight.requires_grad_(True)
    model.enable_input_require_grads()  # a forward hook: the embeddings' output becomes a leaf that requires grad
    return model


def example_inputs(batch_size, seq_len=64):
    ids = torch.randint(0, VOCAB, (batch_size, seq_len))
    return {"input_ids": ids, "labels": ids.clone()}

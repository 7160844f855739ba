"""--mode inference and --mode generate: the forward without autograd, and greedy decoding with a
KV cache (prompt = --seq tokens, then --new-tokens one at a time).

Generation is written out rather than calling model.generate(): generate() reads values to decide
when to stop (EOS checks), which fake tensors cannot do; the loop below makes the same forward calls
(prefill with the whole prompt, then one token at a time, logits kept for the last position only).
"""

from __future__ import annotations

import inspect

import torch

from memest.errors import MemestError
from memest.spec import RunSpec
from memest.spec.choices import Cache
from memest.trace.events import Phase


def run_inference(model, inputs, call_model, mark) -> None:
    mark(Phase.FORWARD)
    with torch.inference_mode():
        out = call_model(model, inputs)
    del out


def make_cache(model, spec: RunSpec, prompt_len: int):
    import transformers

    if spec.cache == Cache.STATIC:
        return transformers.StaticCache(config=model.config, max_cache_len=prompt_len + spec.new_tokens)
    return transformers.DynamicCache(config=model.config)


def check_generate(model, inputs) -> None:
    if not (isinstance(inputs, dict) and "input_ids" in inputs and hasattr(model, "config")):
        raise MemestError(
            "--mode generate needs a transformers decoder (hf:NAME with a causal-LM head such as gpt2 or "
            "llama-2-7b); use --mode inference for other models"
        )
    if not type(model).__name__.endswith(("ForCausalLM", "LMHeadModel")):
        raise MemestError(
            f"--mode generate: {type(model).__name__} is not a causal LM; use an hf: decoder such as gpt2, "
            "or --mode inference"
        )


def run_generate(model, inputs, spec: RunSpec, mark) -> None:
    ids = inputs["input_ids"]
    prompt_len = ids.shape[1]
    kwargs = {"use_cache": True}
    if "logits_to_keep" in inspect.signature(model.forward).parameters:
        kwargs["logits_to_keep"] = 1  # what generate() asks for: logits of the last position only
    with torch.inference_mode():
        cache = make_cache(model, spec, prompt_len)
        mark(Phase.FORWARD)  # prefill
        out = model(input_ids=ids, past_key_values=cache, cache_position=torch.arange(prompt_len), **kwargs)
        token = out.logits[:, -1:].argmax(-1)
        del out
        mark(Phase.DECODE)
        for step in range(spec.new_tokens - 1):
            position = torch.arange(prompt_len + step, prompt_len + step + 1)
            out = model(input_ids=token, past_key_values=cache, cache_position=position, **kwargs)
            token = out.logits[:, -1:].argmax(-1)
            del out
        del cache, token

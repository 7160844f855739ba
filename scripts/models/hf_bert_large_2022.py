"""bert-large-uncased sequence classification as Hugging Face's January 2022 V100 runs ran it
(transformers' "Model training anatomy" / "efficient training on one GPU" pages; see
scripts/bench_gpu_published.py): transformers 4.16's own BertForSequenceClassification code on the
torch installed here, with the one autograd difference of torch < 1.11 that changes what a BERT step
saves.

Needs transformers 4.16 importable (the scoring benchmark runs this file in a subprocess with it on
PYTHONPATH, outside memest's environment):

    pip install --target /tmp/tf416 --no-deps transformers==4.16.2 huggingface_hub==0.4.0 sacremoses \
        requests urllib3 idna certifi charset-normalizer click joblib

What is reproduced, each from its source:
- the model code: transformers 4.16.2 `modeling_bert.py` (eager attention: scores / sqrt(d) + the
  extended attention mask Trainer's inputs imply, softmax, dropout, matmul; the mask is fp32, so under
  fp16 autocast the softmax input is fp32 by type promotion);
- gradient checkpointing (`build_checkpointed`): 4.16's `gradient_checkpointing_enable()`, whose
  BertEncoder calls `torch.utils.checkpoint.checkpoint` without `use_reentrant`: the reentrant variant;
- torch < 1.11 softmax autograd: `_softmax`'s derivative was `_softmax_backward_data(grad, result, dim,
  self)`, so autograd saved the softmax *input* as well as its output (pytorch/pytorch#64000, "Backward
  formulas for softmax/logsoftmax reference self ... we retain reference to self and use more memory
  than needed"; changed to `self.scalar_type()` by pytorch/pytorch#65242 for torch 1.11 — transformers'
  `pytorch_utils.softmax_backward_data` passes `self` for torch < 1.11 and `self.dtype` after). Under
  torch 1.10's CUDA autocast softmax is an fp32-policy op, so the saved input is the fp32 one.
  `LEGACY_SOFTMAX=0` in the environment turns this off (today's torch).
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import torch

CONFIG = Path(__file__).with_name("hf_bert_large_seqcls.json")
TRANSFORMERS_ERA = "4.16"


def _transformers():
    import transformers

    if not transformers.__version__.startswith(TRANSFORMERS_ERA):
        raise ImportError(f"this model file reproduces transformers {TRANSFORMERS_ERA}'s BERT; transformers "
                          f"{transformers.__version__} is importable (see the module docstring)")
    from transformers.models.bert import modeling_bert

    return modeling_bert


class _Softmax110(torch.autograd.Function):
    """softmax whose backward holds its input and output, as torch <= 1.10's SoftmaxBackward did."""

    @staticmethod
    def forward(ctx, x, dim):
        out = torch._softmax(x, dim, False)
        ctx.dim = dim
        ctx.save_for_backward(x, out)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, out = ctx.saved_tensors
        return torch._softmax_backward_data(grad, out, ctx.dim, x.dtype), None


def _legacy_softmax(x, dim=None, _stacklevel=3, dtype=None):
    if dtype is not None:
        x = x.to(dtype)
    elif x.dtype in (torch.float16, torch.bfloat16) and torch.is_autocast_enabled("cuda"):
        x = x.float()  # torch 1.10 autocast: softmax casts its input to fp32 (that copy is what it saved)
    return _Softmax110.apply(x, dim)


def _with_legacy_softmax(forward):
    @functools.wraps(forward)
    def wrapped(*args, **kwargs):
        original = torch.nn.functional.softmax
        torch.nn.functional.softmax = _legacy_softmax
        try:
            return forward(*args, **kwargs)
        finally:
            torch.nn.functional.softmax = original

    return wrapped


def build_model(checkpointing: bool = False):
    modeling_bert = _transformers()
    config = {k: v for k, v in json.loads(CONFIG.read_text()).items() if not k.startswith("_")}
    model = modeling_bert.BertForSequenceClassification(modeling_bert.BertConfig(**config))
    if os.environ.get("LEGACY_SOFTMAX", "1") != "0":
        for module in model.modules():  # also in the reentrant checkpoint's recompute
            if isinstance(module, modeling_bert.BertSelfAttention):
                module.forward = _with_legacy_softmax(module.forward)
    if checkpointing:
        model.gradient_checkpointing_enable()  # 4.16: reentrant torch.utils.checkpoint per BertLayer
    return model


def build_checkpointed():
    return build_model(checkpointing=True)


def example_inputs(batch_size: int, seq_len: int = 512):
    """The pages' dummy data: input_ids and labels only (BertModel then builds an all-ones mask)."""
    return {"input_ids": torch.randint(100, 30000, (batch_size, seq_len)),
            "labels": torch.randint(0, 2, (batch_size,))}


def compute_loss(output, inputs):
    return output.loss

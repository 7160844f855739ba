"""--loss-head: the LM head and its cross-entropy computed chunk by chunk, so the logits of the whole
batch never exist at once. Traced replacements of a transformers causal LM's head + loss, run for real
on fake tensors (the trace sees their allocations) and on real CPU tensors (the ground truth runs the
same code through run_step):

chunked[:N]  torchtune's ``LinearCrossEntropyLoss`` (torchtune/modules/loss/cross_entropy_loss.py,
             ``forward`` and ``compute_cross_entropy``): hidden states and targets split into N chunks
             along the sequence (default 8, torchtune's ``num_output_chunks``); per chunk the selected
             rows are copied, projected, upcast to fp32 and reduced by ``cross_entropy(reduction="sum")``.
             Autograd as usual: each chunk's fp32 log-softmax is saved for backward, so what shrinks is
             the rest of the head (the whole logits, their fp32 copy, the output holding them).
             Same FLOPs as the plain head, in N smaller matmuls.
chunked-output[:N]
             torchtune's older ``CEWithChunkedOutputLoss`` (torchtune/modules/loss/ce_chunked_output_loss.py
             with ``TransformerDecoder.chunked_output`` in torchtune/modules/transformer.py, pytorch/torchtune
             at bd2a0fc7c31430972728494fa01aaeeb0ebf1ba1; axolotl's ``chunked_cross_entropy`` copies it,
             src/axolotl/monkeypatch/loss/chunked.py): the model returns N chunks of logits (every chunk made,
             in the compute dtype), then each chunk is upcast to fp32 and cross-entropied one at a time. What
             shrinks is only the fp32 copy of the logits (one chunk at a time instead of all); the logits
             themselves and every chunk's fp32 log-softmax (saved for backward) are as large as the plain
             head's. Same FLOPs as the plain head.
fused        Liger-Kernel's fused linear cross entropy (src/liger_kernel/ops/fused_linear_cross_entropy.py,
             ``fused_linear_cross_entropy_forward`` and ``LigerFusedLinearCrossEntropyFunction``; wired into
             transformers models by src/liger_kernel/transformers/model/loss_utils.py,
             ``LigerForCausalLMLoss``): chunks of rows sized so one chunk's logits are about as large as
             the hidden states (next power of 2 of BT / ceil(V / H)); per chunk the logits are made, a
             Triton kernel overwrites them in place with their gradient, and the gradients of the head's
             input and weight are accumulated — all during forward. Nothing of the logits is saved;
             backward only scales the two gradients in place. Same FLOPs as the plain head (no
             recompute with Liger's mean/sum reduction: the head's backward matmuls run in forward).
             Liger needs Triton and a GPU: this is Liger's algorithm re-expressed in torch ops from its
             source, traced and run on CPU, not Liger itself measured (the report says so).

Each returns an output whose ``loss`` is set and ``logits`` is None, as Liger's patched forwards do in
training (``skip_logits``): a loop that keeps the output (--outputs kept) keeps no logits.

They apply to transformers causal LMs (``*ForCausalLM``, ``*LMHeadModel``) whose output embedding is an
``nn.Linear`` and whose forward does not transform the logits before the loss (Gemma-2's
``final_logit_softcapping``, Cohere's ``logit_scale``, Granite's ``logits_scaling``). What is not
modelled: torchtune masks ignored targets out before the projection (``hidden_chunk[mask]``, which
needs values fake tensors do not have): every row is projected here, as when every target counts (the
last position of each sequence, which has no next token, is then ignored by the loss instead).
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch
import torch.nn.functional as F

from memest.errors import MemestError
from memest.features.base import StepFeature
from memest.spec.choices import LossHead, Target
from memest.trace.dtype import HALF

IGNORE_INDEX = -100  # transformers' and torch's label ignore_index
TORCHTUNE_CHUNKS = 8  # torchtune LinearCrossEntropyLoss(num_output_chunks=8), CEWithChunkedOutputLoss's default too
LIGER_CHUNK_MEM_CONST = 1  # Liger's _CHUNK_MEM_CONST (its default; its test_triton_flce_chunk_memory_budget asserts 1)
# transformers config fields whose forward changes the logits between the head and the loss
_LOGIT_SOFTCAP = ("final_logit_softcapping",)
_LOGIT_SCALES = ("logit_scale", "logits_scaling")


def describe(spec) -> str:
    """One line for the report: what --loss-head traced and what it costs in time."""
    kind, chunks = LossHead.of(spec.loss_head)
    if kind is LossHead.CHUNKED:
        return (
            f"loss head: chunked, {chunks or TORCHTUNE_CHUNKS} chunks (torchtune LinearCrossEntropyLoss): LM head + "
            "cross-entropy per chunk, each chunk's fp32 log-softmax saved; 0% more FLOPs (smaller matmuls)"
        )
    if kind is LossHead.CHUNKED_OUTPUT:
        return (
            f"loss head: chunked-output, {chunks or TORCHTUNE_CHUNKS} chunks (torchtune CEWithChunkedOutputLoss, "
            "pytorch/torchtune bd2a0fc): every chunk's logits made, each upcast to fp32 and cross-entropied one at a "
            "time (only the fp32 copy shrinks; each chunk's fp32 log-softmax saved); 0% more FLOPs"
        )
    if kind is LossHead.FUSED:
        return (
            "loss head: fused linear cross-entropy (Liger-Kernel): head gradients computed in forward chunk by chunk, "
            "no logits saved; 0% more FLOPs (no recompute with mean reduction); needs liger-kernel (Triton, CUDA); "
            "an estimate from Liger's source (its algorithm in torch ops), not Liger itself measured"
        )
    return ""


@contextlib.contextmanager
def loss_head_scope(model: torch.nn.Module, spec):
    """While entered, ``model`` (a transformers causal LM) computes its loss with ``spec.loss_head``;
    its own forward and head come back on exit. Nothing changes for ``standard``."""
    kind, chunks = LossHead.of(spec.loss_head)
    if kind is LossHead.STANDARD:
        yield
        return
    lm = _unwrap(model)
    head = causal_lm_head(lm, spec.loss_head)
    if kind is LossHead.CHUNKED:
        loss = functools.partial(_chunked_loss, head, chunks or TORCHTUNE_CHUNKS)
    elif kind is LossHead.CHUNKED_OUTPUT:
        loss = functools.partial(_chunked_output_loss, head, chunks or TORCHTUNE_CHUNKS)
    else:
        kernels = _Kernels(spec.target == Target.CUDA, spec.compute_capability[0], _autocast_dtype(spec))
        loss = functools.partial(_fused_loss, head, kernels)
    with _patched(lm, "forward", _lm_forward(lm.base_model, head)), _patched(head, "forward", loss):
        yield


def causal_lm_head(model: torch.nn.Module, flag: str = "chunked") -> torch.nn.Linear:
    """The LM head that --loss-head replaces, or a MemestError saying why it does not apply."""
    name = type(model).__name__
    config = getattr(model, "config", None)
    own_model = (
        "; in your own model file, compute the loss chunk by chunk in forward or compute_loss: memest traces what "
        "it runs"
    )
    if config is None or not name.endswith(("ForCausalLM", "LMHeadModel")):
        raise MemestError(
            f"--loss-head {flag} replaces the LM head and loss of a transformers causal LM (hf: models whose class "
            f"ends in ForCausalLM or LMHeadModel); {name} is not one{own_model}"
        )
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear) or getattr(model, "base_model", model) is model:
        raise MemestError(
            f"--loss-head {flag}: {name}'s output embedding is not an nn.Linear after a base model, so memest cannot "
            f"split it{own_model}"
        )
    for attr in _LOGIT_SOFTCAP + _LOGIT_SCALES:
        value = getattr(config, attr, None)
        if value is not None and not (attr in _LOGIT_SCALES and value == 1):
            raise MemestError(
                f"--loss-head {flag}: {name} transforms its logits before the loss ({attr}={value}), which the "
                f"chunked heads memest traces do not do; use --loss-head standard"
            )
    return head


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside a DistributedDataParallel wrapper (FSDP2 wraps in place) and inside peft's PeftModel
    (``get_base_model()``: the transformers model, its layers holding the adapters)."""
    from torch.nn.parallel import DistributedDataParallel

    model = model.module if isinstance(model, DistributedDataParallel) else model
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) and getattr(model, "peft_config", None) is not None else model


@contextlib.contextmanager
def _patched(obj, name: str, value):
    """``obj.name = value`` as an instance attribute, and exactly what was there before on exit."""
    missing = object()
    before = obj.__dict__.get(name, missing)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if before is missing:
            delattr(obj, name)
        else:
            setattr(obj, name, before)


def _lm_forward(base: torch.nn.Module, head: torch.nn.Module):
    """The causal LM's forward with the loss computed by ``head(hidden, labels)``: the base model's last
    hidden state goes to the head (called as a module, so its memory is the head's), and the output
    carries the loss with no logits (Liger's lce_forward with skip_logits)."""

    def forward(*args, labels=None, **kwargs):
        from transformers.modeling_outputs import CausalLMOutputWithPast

        if labels is None:
            raise MemestError("--loss-head computes a training loss and needs labels among the model's inputs")
        hidden = base(*args, **kwargs)[0]
        return CausalLMOutputWithPast(loss=head(hidden, labels))

    return forward


def _shifted(labels: torch.Tensor) -> torch.Tensor:
    """transformers' causal-LM targets (ForCausalLMLoss, and Liger's LigerForCausalLMLoss): labels
    padded with ignore_index and shifted left by one, so position t predicts token t + 1."""
    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].contiguous()


# ------------------------------------------------------------------------------ chunked (torchtune)


def _chunked_loss(head: torch.nn.Linear, chunks: int, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """torchtune LinearCrossEntropyLoss.forward on the shifted targets: mean over counted targets."""
    targets = _shifted(labels)
    total_elements = (targets != IGNORE_INDEX).sum()
    total_loss = 0.0
    for hidden_chunk, target_chunk in zip(
        hidden.tensor_split(chunks, dim=1), targets.tensor_split(chunks, dim=1), strict=True
    ):
        total_loss += _chunk_cross_entropy(head, hidden_chunk, target_chunk)
    return total_loss / total_elements


def _chunk_cross_entropy(head: torch.nn.Linear, hidden_chunk: torch.Tensor, target_chunk: torch.Tensor) -> torch.Tensor:
    """torchtune LinearCrossEntropyLoss.compute_cross_entropy. Its ``hidden_chunk[mask_chunk]`` copies
    the rows whose target counts; fake tensors have no values, so every row is copied (one copy of the
    chunk, as when all count) and ignored targets are left to cross_entropy's ignore_index."""
    mask_chunk = target_chunk != IGNORE_INDEX  # noqa: F841 (allocated as torchtune allocates it)
    rows = hidden_chunk.new_empty(hidden_chunk.shape).copy_(hidden_chunk).flatten(0, 1)
    targets = target_chunk.new_empty(target_chunk.shape).copy_(target_chunk).flatten()
    logits = F.linear(rows, head.weight, head.bias)  # torchtune: self.linear_projection(hidden_chunk)
    return F.cross_entropy(logits.float(), targets, reduction="sum", ignore_index=IGNORE_INDEX)


# ------------------------------------------------------------------- chunked output (torchtune, older)


def _chunked_output_loss(head: torch.nn.Linear, chunks: int, hidden: torch.Tensor, labels: torch.Tensor):
    """torchtune TransformerDecoder.chunked_output (``[self.output(chunk) for chunk in
    h.tensor_split(num_output_chunks, dim=1)]``) then CEWithChunkedOutputLoss on the shifted targets."""
    logits = [F.linear(chunk, head.weight, head.bias) for chunk in hidden.tensor_split(chunks, dim=1)]
    return CEWithChunkedOutputLoss(chunks)(logits, _shifted(labels))


class CEWithChunkedOutputLoss(torch.nn.Module):
    """torchtune's CEWithChunkedOutputLoss (torchtune/modules/loss/ce_chunked_output_loss.py at bd2a0fc):
    the same ops in the same order, called as a module as torchtune calls it (Module.__call__ holds the
    targets until the loss returns). tests/test_loss_head_chunked_output.py swaps in torchtune's own class
    for the real step and compares."""

    def __init__(self, num_output_chunks: int = TORCHTUNE_CHUNKS, ignore_index: int = IGNORE_INDEX) -> None:
        super().__init__()
        self.num_output_chunks, self.ignore_index = num_output_chunks, ignore_index

    def compute_cross_entropy(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float(), labels, ignore_index=self.ignore_index, reduction="sum")

    def forward(self, logits: list[torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
        total_elements = (labels != self.ignore_index).sum()
        labels = [target_chunk.reshape(-1) for target_chunk in labels.tensor_split(self.num_output_chunks, dim=1)]
        logits = [logit_chunk.reshape(-1, logit_chunk.size(-1)) for logit_chunk in logits]
        total_loss = 0.0
        for logits_chunk, labels_chunk in zip(logits, labels, strict=True):
            total_loss += self.compute_cross_entropy(logits_chunk, labels_chunk)
        return total_loss / total_elements


# --------------------------------------------------------------------------------- fused (Liger)


class _Kernels:
    """Which of Liger's code paths a run takes: they depend on the device (CUDA or not), the GPU
    generation (sm80+ for the addmm accumulation paths) and autocast."""

    def __init__(self, cuda: bool, cc_major: int, autocast_dtype: torch.dtype | None) -> None:
        self.cuda, self.cc_major, self.autocast_dtype = cuda, cc_major, autocast_dtype


def _autocast_dtype(spec) -> torch.dtype | None:
    return HALF[spec.precision] if spec.mixed else None


def _fused_loss(head: torch.nn.Linear, kernels: _Kernels, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Liger's LigerForCausalLMLoss: shifted targets, hidden states flattened to BT x H, mean reduction."""
    targets = _shifted(labels).view(-1)
    rows = hidden.view(-1, hidden.shape[-1])
    return _FusedLinearCrossEntropy.apply(rows, head.weight, head.bias, targets, kernels)


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """LigerFusedLinearCrossEntropyFunction (reduction="mean"): gradients made in forward and saved;
    backward scales them in place by the incoming gradient."""

    @staticmethod
    def forward(ctx, x, weight, bias, target, kernels):
        loss, grad_input, grad_weight, grad_bias = _fused_forward(x, weight, bias, target, kernels)
        ctx.save_for_backward(grad_input.detach(), _detach(grad_weight), _detach(grad_bias))
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        # fused_linear_cross_entropy_backward: Liger skips the scaling when grad_output == 1 (a value
        # read fake tensors cannot make); either way in place (its element_mul_kernel), no allocation
        grad_input, grad_weight, grad_bias = ctx.saved_tensors
        for grad in (grad_input, grad_weight, grad_bias):
            if grad is not None:
                grad.mul_(grad_output)
        return grad_input, grad_weight, grad_bias, None, None


def _detach(t):
    return t.detach() if t is not None else None


def _fused_forward(x, weight, bias, target, kernels: _Kernels):
    """fused_linear_cross_entropy_forward with Liger's defaults (chunk_mem_const 1, accum_dtype None, no
    z-loss, no class weights), each allocation where Liger makes it. Runs with grad mode off (inside
    the autograd Function), under the caller's autocast, as Liger's amp_custom_fwd leaves it."""
    rows, hidden_size = x.shape
    vocab = weight.shape[0]
    chunk_size = liger_chunk_size(rows, hidden_size, vocab)
    num_chunks = math.ceil(rows / chunk_size)

    grad_input = torch.zeros_like(x)
    grad_weight = torch.zeros_like(weight) if weight.requires_grad else None
    grad_bias = torch.zeros_like(bias) if bias is not None else None
    loss_1d = torch.zeros(rows, dtype=torch.float32, device=x.device)
    n_non_ignore = (target != IGNORE_INDEX).sum()  # Liger: .item(); a 0-d tensor here (no values to read)

    use_mm_out = _can_use_mm_out(x, weight, kernels)
    logits_storage = (
        torch.empty((chunk_size, vocab), dtype=x.dtype, device=x.device)
        if use_mm_out and (bias is None or bias.dtype == x.dtype)
        else None
    )
    for chunk_id in range(num_chunks):
        start, end = chunk_id * chunk_size, min((chunk_id + 1) * chunk_size, rows)
        x_chunk = x[start:end]
        if logits_storage is not None:
            logits_chunk = logits_storage[: end - start]
            torch.mm(x_chunk, weight.t(), out=logits_chunk)
            if bias is not None:
                logits_chunk.add_(bias)
        else:
            logits_chunk = x_chunk @ weight.t()
            if bias is not None:
                logits_chunk = logits_chunk + bias
        logits_chunk = logits_chunk.contiguous()
        target_chunk = target[start:end].contiguous()
        loss_1d[start:end] = _cross_entropy_in_place(logits_chunk, target_chunk, n_non_ignore)
        grad_logits_chunk = logits_chunk
        del logits_chunk

        if use_mm_out and grad_logits_chunk.dtype == grad_input.dtype:
            torch.mm(grad_logits_chunk, weight, out=grad_input[start:end])
        else:
            grad_input[start:end] = grad_logits_chunk @ weight
        if grad_weight is not None:
            _accumulate_grad_weight(grad_weight, grad_logits_chunk, x_chunk, kernels)
        if grad_bias is not None:
            torch.add(grad_bias, grad_logits_chunk.sum(dim=0), out=grad_bias)
        del grad_logits_chunk, x_chunk, target_chunk
    del logits_storage
    loss = torch.sum(loss_1d)
    if grad_weight is not None:
        grad_weight = grad_weight.to(weight.dtype)
    if grad_bias is not None:
        grad_bias = grad_bias.to(bias.dtype)
    return loss, grad_input, grad_weight, grad_bias


def liger_chunk_size(rows: int, hidden: int, vocab: int, chunk_mem_const: int = LIGER_CHUNK_MEM_CONST) -> int:
    """Liger's token-chunk rule (fused_linear_cross_entropy_forward): ``inc_factor = cdiv(V, C * H)``,
    ``chunk_size = min(next_power_of_2(cdiv(BT, inc_factor)), BT)``: one chunk's logits about the size of
    the hidden states."""
    inc_factor = -(-vocab // (chunk_mem_const * hidden))  # triton.cdiv
    return min(_next_power_of_2(-(-rows // inc_factor)), rows)


def _can_use_mm_out(x, weight, kernels: _Kernels) -> bool:
    """Liger's _can_use_mm_out: CUDA (not ROCm), grad mode off, same dtype for input and weight, and under
    autocast only when the input already has the autocast dtype."""
    if not kernels.cuda or torch.is_grad_enabled() or x.dtype != weight.dtype:
        return False
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return False
    return kernels.autocast_dtype is None or x.dtype == kernels.autocast_dtype


def _accumulate_grad_weight(grad_weight, grad_logits_chunk, x_chunk, kernels: _Kernels) -> None:
    """Liger's three paths: on sm80+ CUDA a 16-bit chunk gradient is accumulated by addmm straight into
    grad_weight (an fp32 accumulator with out_dtype, or one of its own dtype), after a copy of the
    input chunk to that dtype when they differ; otherwise (fp32 gradients, other devices) the legacy
    ``grad_weight += mm(...).float()``, which makes a vocab x hidden temporary per chunk."""
    grad_logits_t = grad_logits_chunk.t()
    low = grad_logits_t.dtype in (torch.float16, torch.bfloat16)
    sm80 = kernels.cuda and kernels.cc_major >= 8
    if sm80 and low and grad_weight.dtype in (torch.float32, grad_logits_t.dtype):
        input_chunk = x_chunk.to(grad_logits_t.dtype)
        if grad_weight.dtype == torch.float32:
            torch.addmm(grad_weight, grad_logits_t, input_chunk, out_dtype=torch.float32, out=grad_weight)
        else:
            torch.addmm(grad_weight, grad_logits_t, input_chunk, out=grad_weight)
        del input_chunk
    else:
        grad_weight += torch.mm(grad_logits_chunk.t(), x_chunk).float()


def _cross_entropy_in_place(logits: torch.Tensor, target: torch.Tensor, n_non_ignore: torch.Tensor) -> torch.Tensor:
    """What liger_cross_entropy_kernel (src/liger_kernel/ops/cross_entropy.py) does to one chunk, in
    torch ops that allocate only per-row vectors (the Triton kernel, one program per row, allocates
    nothing): returns each row's loss / n and overwrites ``logits`` with (softmax - one-hot) / n, zero
    for rows whose target is ignore_index."""
    valid = target != IGNORE_INDEX
    index = torch.where(valid, target, 0).unsqueeze(-1)
    picked = logits.gather(-1, index).float()
    row_max = logits.amax(-1, keepdim=True)
    logits.sub_(row_max).exp_()
    denom = logits.sum(-1, keepdim=True, dtype=torch.float32)
    loss = (denom.log() + row_max.float() - picked).squeeze(-1) * valid / n_non_ignore
    logits.div_(denom)
    logits.scatter_add_(-1, index, torch.full_like(index, -1, dtype=logits.dtype))
    logits.mul_((valid.unsqueeze(-1) / n_non_ignore).to(logits.dtype))
    return loss


def _next_power_of_2(n: int) -> int:
    """triton.next_power_of_2."""
    return 1 << (n - 1).bit_length() if n > 1 else 1


class LossHeadFeature(StepFeature):
    """--loss-head chunked|fused: the LM head and loss replaced around the user's loop (real runs too)."""

    name = "loss-head"

    def loop(self, model, spec) -> contextlib.AbstractContextManager:
        return loss_head_scope(model, spec)

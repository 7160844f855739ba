"""QLoRA's quantized base weights (``--quant nf4|fp4``): a fake-tensor stand-in for bitsandbytes' Linear4bit.

bitsandbytes' Params4bit cannot wrap fake tensors (its quantization runs real kernels on real data), so
memest replaces each quantized ``nn.Linear`` with :class:`Linear4bitModel`, whose storages and forward /
backward allocations are those of bitsandbytes 0.50 (the version installed and read for this; sources are
``bitsandbytes/...`` paths of github.com/bitsandbytes-foundation/bitsandbytes, 0.50.x):

Stored, per layer of N x K weights, n = N*K elements (``functional.quantize_4bit``, ``quantize_blockwise``):
  - packed weight: uint8 ``[(n + 1) // 2, 1]`` (two 4-bit codes per byte; ``quant_storage=torch.uint8``); under
    FSDP (--shard zero3 / zero2) the same bytes viewed as the model's dtype, ``bnb_4bit_quant_storage=torch_dtype``,
    so FSDP shards and all-gathers them like the other weights (the FSDP-QLoRA recipe: Answer.AI's fsdp_qlora,
    train.py's ``replace_linear(model.model, Linear4bit, ..., quant_storage=torch_dtype)``,
    https://github.com/AnswerDotAI/fsdp_qlora/blob/05ed9f2a60f96a0795cb082bceab70a9b19fd213/train.py, and
    peft's guide, https://github.com/huggingface/peft/blob/5d602fdbff04c33c1c4de55cda9d4ae1d7cb7e40/docs/source/accelerate/fsdp.md);
    the quantization state below is no parameter, so FSDP leaves it whole on every rank;
  - ``absmax``: one per block of ``blocksize`` = 64 elements (quantize_4bit's default), float32; with double
    quantization (``compress_statistics=True``, transformers' ``bnb_4bit_use_double_quant``) uint8 instead,
    plus the nested state: ``absmax`` float32 per 256 blocks, its own ``code`` (a copy of the 256-value
    dynamic map, ``code.to(A.device, copy=True)``) and ``offset`` (a 0-d float32, ``_absmax.mean()``);
  - ``code``: the 16-value NF4 / FP4 table (``get_4bit_type``, float32), one per layer;
  - the bias (if any) in its dtype.
Forward (``nn/modules.py`` Linear4bit.forward: input cast to the compute dtype, output cast back;
``autograd/_functions.py`` MatMul4Bit.forward -> ``backends/cuda/ops.py`` gemm_4bit): for more than
``CUDA_CUSTOM_MAX_M`` = 1536 rows (batch x seq tokens) the dequant + F.linear fallback
(``_dequant_linear_fallback``): nested absmax dequantised to float32 and offset (two float32 [blocks]
tensors), the whole weight dequantised to the compute dtype, F.linear, all freed on return. Nothing is
saved for backward but the packed weight (``ctx.tensors = (None, B)``, not through save_for_backward):
the layer's input is not kept. At 1536 rows or fewer bitsandbytes may pick its own fused kernel by a
per-GPU heuristic (``_gemm_4bit_use_custom_cuda``), which allocates no dequantised weight: the fallback
is traced there too (the upper side), and the report says so.
Backward (MatMul4Bit.backward): ``F.dequantize_4bit`` (``functional.py``): nested absmax dequantised to
float32 (+ offset in place), the whole weight dequantised in the weight's stored dtype
(``quant_state.dtype``), cast to the gradient's dtype if it differs, then ``grad_output @ W``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

BLOCKSIZE = 64  # functional.quantize_4bit: `if blocksize is None: blocksize = 64`
NESTED_BLOCKSIZE = 256  # quantize_4bit: quantize_blockwise(_absmax - offset, blocksize=256)
CODE_4BIT = 16  # get_4bit_type: 16 float32 values (nf4 / fp4)
CODE_DYNAMIC = 256  # create_dynamic_map(): 256 float32 values, copied per nested state
CUDA_CUSTOM_MAX_M = 1536  # backends/cuda/ops.py: _gemm_4bit_custom_max_m (CUDA)


def blocks(n: int, blocksize: int) -> int:
    return -(n // -blocksize)


def stored_layout(n: int, double_quant: bool, bias_bytes: int = 0) -> dict[str, int]:
    """Bytes bitsandbytes stores for one 4-bit weight of ``n`` elements, by tensor (the unit test checks
    these against bitsandbytes' own quantize_4bit of a real tensor)."""
    b = blocks(n, BLOCKSIZE)
    out = {"weight": (n + 1) // 2, "code": 4 * CODE_4BIT}
    if double_quant:
        out |= {"absmax": b, "nested_absmax": 4 * blocks(b, NESTED_BLOCKSIZE), "nested_code": 4 * CODE_DYNAMIC,
                "offset": 4}
    else:
        out["absmax"] = 4 * b
    if bias_bytes:
        out["bias"] = bias_bytes
    return out


class Linear4bitModel(nn.Linear):
    """bitsandbytes' Linear4bit as memest traces it. A ``nn.Linear`` (as Linear4bit is), so peft's
    target matching and ``all-linear`` see the layers they see on a bitsandbytes model; its own
    ``__init__`` holds only what bitsandbytes stores."""

    def __init__(self, linear: nn.Module, quant_type: str, double_quant: bool, compute_dtype: torch.dtype,
                 quant_storage: torch.dtype = torch.uint8):
        nn.Module.__init__(self)
        if isinstance(linear, nn.Linear):
            self.in_features, self.out_features = linear.in_features, linear.out_features
        else:  # transformers' Conv1D (GPT-2): weight [in, out], replaced alike (replace_with_bnb_linear)
            self.in_features, self.out_features = linear.weight.shape
        self.quant_type, self.double_quant, self.compute_dtype = quant_type, double_quant, compute_dtype
        self.quant_dtype = linear.weight.dtype  # quant_state.dtype: the dtype the weight was quantized from
        device = linear.weight.device
        n = self.in_features * self.out_features
        b = blocks(n, BLOCKSIZE)
        # quant_storage (bnb_4bit_quant_storage): the packed bytes viewed as that dtype, [(n + 1) // 2 / itemsize, 1]
        # (backends/default/ops.py _quantize_4bit_impl: `packed.squeeze().view(quant_storage).unsqueeze(1)`)
        packed = (n + 1) // 2 // quant_storage.itemsize
        weight = torch.zeros((packed, 1), dtype=quant_storage, device=device)
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight.logical_numel = n  # what the weight was: parameter counts stay those of the model
        self.bias = linear.bias
        if self.bias is not None:
            self.bias.requires_grad_(False)
        self.register_buffer("code", torch.zeros(CODE_4BIT, device=device))
        if double_quant:
            self.register_buffer("absmax", torch.zeros(b, dtype=torch.uint8, device=device))
            self.register_buffer("nested_absmax", torch.zeros(blocks(b, NESTED_BLOCKSIZE), device=device))
            self.register_buffer("nested_code", torch.zeros(CODE_DYNAMIC, device=device))
            self.register_buffer("offset", torch.zeros((), device=device))
        else:
            self.register_buffer("absmax", torch.zeros(b, device=device))

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, {self.quant_type}, "
                f"double_quant={self.double_quant}")

    def _absmax(self, forward: bool) -> list[torch.Tensor]:
        """The float32 absmax temporaries of one dequantisation (kept alive until it returns)."""
        if not self.double_quant:
            return []
        dq = torch.zeros(self.absmax.shape, dtype=torch.float32, device=self.absmax.device)
        if forward:  # _dequant_linear_fallback: absmax_dq, then `absmax = absmax_dq + absmax_offset`
            return [dq, dq + self.offset]
        dq += self.offset  # functional.dequantize_4bit: `absmax += quant_state.offset`
        return [dq]

    def dequantized(self, dtype: torch.dtype, forward: bool) -> torch.Tensor:
        held = self._absmax(forward)
        w = torch.zeros((self.out_features, self.in_features), dtype=dtype, device=self.weight.device)
        del held
        return w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inp_dtype = x.dtype
        x = x.to(self.compute_dtype)
        bias = None if self.bias is None else self.bias.to(self.compute_dtype)
        return _MatMul4bit.apply(x, self.weight, bias, self).to(inp_dtype)


class _MatMul4bit(torch.autograd.Function):
    """MatMul4Bit: saves nothing but a reference to the packed weight (ctx.tensors, not save_for_backward)."""

    @staticmethod
    def forward(ctx, x, packed, bias, layer: Linear4bitModel):
        ctx.layer = layer
        ctx.bias_grad = bias is not None and bias.requires_grad
        w = layer.dequantized(x.dtype, forward=True)
        return F.linear(x, w, bias)

    @staticmethod
    def backward(ctx, grad_output):
        layer: Linear4bitModel = ctx.layer
        grad_bias = grad_output.sum(0) if ctx.bias_grad else None
        grad_x = None
        if ctx.needs_input_grad[0]:
            w = layer.dequantized(layer.quant_dtype, forward=False).to(grad_output.dtype)
            grad_x = torch.matmul(grad_output, w)
        return grad_x, None, grad_bias, None


def output_linear(model: nn.Module) -> set[str]:
    """Names of the modules transformers' bitsandbytes quantizer leaves unquantized: the output
    embedding (``lm_head``) and anything tied to the input embedding (``get_keys_to_not_convert``)."""
    keep: set[str] = set()
    get_out = getattr(model, "get_output_embeddings", None)
    out = get_out() if callable(get_out) else None
    for name, module in model.named_modules():
        if out is not None and module is out:
            keep.add(name)
    return keep


def _is_conv1d(module: nn.Module) -> bool:
    return type(module).__name__ == "Conv1D" and type(module).__module__.startswith("transformers")


def quantize_linears(model: nn.Module, quant_type: str, double_quant: bool, compute_dtype: torch.dtype,
                     quant_storage: torch.dtype = torch.uint8) -> int:
    """Replace every nn.Linear (and transformers' Conv1D) but the output head with the stand-in, as
    transformers' bitsandbytes integration (``replace_with_bnb_linear``) replaces them with Linear4bit (embeddings and norms are not linear and stay as they are).
    Returns the number of layers replaced."""
    return replace_linears(model, lambda child: Linear4bitModel(child, quant_type, double_quant, compute_dtype,
                                                                quant_storage))


def replace_linears(model: nn.Module, make) -> int:
    """Replace every nn.Linear (and transformers' Conv1D) but the output head with ``make(layer)``, as
    transformers' ``replace_with_bnb_linear`` walks the model. Returns the number of layers replaced."""
    keep = output_linear(model)
    replaced = 0
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if (type(child) is nn.Linear or _is_conv1d(child)) and full not in keep:
                setattr(module, child_name, make(child))
                replaced += 1
    return replaced


def lora_layer_class(clone: bool = True):
    """peft's LoRA layer for bitsandbytes' Linear4bit (``peft/tuners/lora/bnb.py`` Linear4bit.forward, peft
    0.21), on memest's stand-in: defined only where peft imports bitsandbytes, so memest carries its
    forward: the base result cloned ("As per Tim Dettmers, for 4bit, we need to defensively clone here"),
    the input cast to the adapter's dtype and the adapter's output cast back when autocast is off.
    ``clone=False``: peft's Linear8bitLt.forward (the same, without the clone; features/quant_int8.py)."""
    from peft.tuners.lora.layer import Linear as LoraLinear

    class LoraBnbLinear(LoraLinear):
        def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            result = self.base_layer(x, *args, **kwargs)
            if clone:
                result = result.clone()
            for active_adapter in self.active_adapters:
                if active_adapter not in self.lora_A.keys():
                    continue
                lora_A, lora_B = self.lora_A[active_adapter], self.lora_B[active_adapter]
                dropout, scaling = self.lora_dropout[active_adapter], self.scaling[active_adapter]
                requires_conversion = not torch.is_autocast_enabled()
                if requires_conversion:
                    expected_dtype = result.dtype
                    x = self._cast_input_dtype(x, lora_A.weight.dtype)
                output = lora_B(lora_A(dropout(x))) * scaling
                if requires_conversion:
                    output = output.to(expected_dtype)
                result = result + output
            return result

    LoraBnbLinear.__name__ = LoraBnbLinear.__qualname__ = "Lora4bitLinear" if clone else "Lora8bitLinear"
    return LoraBnbLinear

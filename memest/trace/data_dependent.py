"""Ops whose result depends on tensor values, which fake tensors do not have: what the error says.

Two kinds. A value read (``.item()``, a Python ``if`` on a tensor) has no bound: the forward must not
need it. A size-bounded op has an output whose size depends on values but cannot exceed a size known
from its inputs — ``nonzero`` (and boolean-mask indexing, which runs it) at most one row per input
element, ``unique`` at most the input's elements, CTC's alignment table at most the targets' padded
width. For those the message says the bound and how to write the step so that it is traced at that
bound, and names ``--data-dependent upper-bound`` (features/upper_bound.py), which traces those ops at their
bound (nonzero, boolean-mask indexing, masked_select, unique; not CTC, whose fake kernel is in
trace/fake_kernels.py).
"""

from __future__ import annotations

UPPER_BOUND = "--data-dependent upper-bound"  # the flag that traces size-bounded ops at their bound
_FLAG = (f"pass {UPPER_BOUND} (YAML data_dependent: upper-bound, API data_dependent=\"upper-bound\") to trace it at "
         "that bound (the estimate is then an upper bound)")
_MASK = (
    "it is size-bounded: at most one entry per element of its input (boolean-mask indexing x[mask] runs "
    f"it). {_FLAG[0].upper()}{_FLAG[1:]}; or, to estimate the bound without it, keep every element instead — torch.where(mask, x, 0) or x * mask — about the "
    "memory of a mask that selects all (less nonzero's numel x ndim int64 indices); graph layers that insert self loops this way (torch_geometric's "
    "GCNConv) take add_self_loops=False with edges that already hold them"
)
_UNIQUE = (
    f"it is size-bounded: at most as many values as its input. {_FLAG[0].upper()}{_FLAG[1:]}; or, to estimate the bound, use the input in its "
    "place (every value distinct), e.g. behind a flag the model file sets"
)
_CTC = (
    "fake tensors have no kernel for it, even with integer lengths (torch treats its alignment table as "
    "data-dependent); the table is batch x input length x (2 x longest target + 1) floats, the longest target "
    "at most the targets' padded width. To estimate, trace with another loss on the same output (the default: "
    "its mean) and add that table"
)
# aten op name (without overload) -> what is known about its size, and the way out (the first two: bounded
# by --data-dependent upper-bound)
SIZE_BOUNDED = {
    "nonzero": _MASK,
    "nonzero_static": _MASK,
    "masked_select": _MASK,
    "_unique2": _UNIQUE,
    "unique_dim": _UNIQUE,
    "unique_consecutive": _UNIQUE,
    "unique_dim_consecutive": _UNIQUE,
    "_ctc_loss": _CTC,
}

VALUE_FREE = (
    "make the forward value-free: no .item() or Python branches on tensors, torch.where instead of "
    "boolean-mask indexing or nonzero"
)


def op_base_name(op: str) -> str:
    """'aten.nonzero.default' -> 'nonzero'."""
    parts = op.split(".")
    return parts[1] if len(parts) >= 2 and parts[0] == "aten" else op


def explain(where: str, op: str, hint: str = VALUE_FREE) -> str:
    """The one-line error for a data-dependent op ``op`` (e.g. 'aten.nonzero.default') met at ``where``;
    ``hint``: what to change when the op is not a known size-bounded one (the source's: a model file's
    forward can be rewritten, an hf: model's cannot)."""
    known = SIZE_BOUNDED.get(op_base_name(op))
    if known is None or hint != VALUE_FREE:  # a source's own hint (hf: models) says what applies to it
        flag = f"; or {_FLAG}" if known is not None and known is not _CTC else ""
        return (f"{where} uses a data-dependent op ({op}) whose result depends on tensor values, which fake tensors do "
                f"not have; {hint}{flag}")
    return f"{where} uses a data-dependent op ({op}): its output size depends on tensor values, which fake tensors do not have; {known}"

"""cuda_autocast, checked against torch's own lists and kernels, not guessed.

References, all from the installed torch:
1. The AutocastCUDA kernels compiled into the binary (a CPU-only build registers them too). Their op
   names must equal our table, and they run for real on fake tensors whose device is "cuda" with CUDA
   autocast switched on: the *oracle*. Every dtype below is also compared with the oracle's.
2. torch's CUDA autocast test lists, torch/testing/_internal/autocast_test_lists.py (AutocastTestLists),
   run the way test_cuda.py's _run_autocast_outofplace runs them: torch.* / Tensor.* variants, output
   dtype, and bitwise equality with a control that casts the arguments by hand with autocast off.
   The class is read from the file without importing torch.testing._internal.common_utils, whose
   import switches torch.backends global flags off for the whole process. A supplement covers the
   registered ops those lists never reach; every registered op must be reached by a passing check.
3. Whole small models: the sequence of aten ops and output dtypes under our emulation (fake CPU
   tensors) must equal the oracle's (fake CUDA tensors), composites included (MultiheadAttention,
   cross_entropy, conv1d padding="same", F.normalize, fp32 softmax of fp16 scores).
4. What the oracle cannot show (autograd on fake CUDA tensors aborts a CPU-only build): the weight
   cache, saved tensors, fake-tensor backward, checkpoint replay, disabled regions — checked against
   the rules in autocast_mode.cpp (cached_cast) and torch.autocast.
"""

from __future__ import annotations

import ast
import collections
import contextlib
import inspect
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

import memest.targets.cuda.autocast as ca
from memest.targets.cuda.autocast import cuda_autocast, cuda_autocast_scope

# torch's lists call deprecated ops (chain_matmul, frobenius_norm, cross without dim)
pytestmark = pytest.mark.filterwarnings("ignore:.*deprecated:UserWarning")

# ---------------------------------------------------------------------------------------------
# helpers: torch's lists, the oracle, op logging
# ---------------------------------------------------------------------------------------------


def load_torch_lists():
    """AutocastTestLists from torch's file, class body only (see module docstring)."""
    import torch.testing._internal as internal

    path = Path(internal.__file__).parent / "autocast_test_lists.py"
    tree = ast.parse(path.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "AutocastTestLists")
    namespace = {"torch": torch, "collections": collections, "TEST_WITH_ROCM": False}
    exec(compile(ast.Module(body=[cls], type_ignores=[]), str(path), "exec"), namespace)
    torch.manual_seed(0)
    return namespace["AutocastTestLists"](torch.device("cpu"))


def _contiguous(self, memory_format=torch.contiguous_format):
    return self if self.is_contiguous(memory_format=memory_format) else self.clone(memory_format=memory_format)


def _getitem(self, index):
    if isinstance(index, int):  # all that nn.MultiheadAttention needs
        return self.select(0, index)
    raise NotImplementedError(f"oracle: indexing fake CUDA tensors with {index!r}")


@contextlib.contextmanager
def real_cuda_autocast(dtype):
    """The compiled AutocastCUDA kernels, for tensors whose device is cuda (our fake ones)."""
    prev = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", dtype)
    # The Python bindings of Tensor.contiguous and indexing take a CUDA device guard, which a CPU-only
    # build cannot make; the ops underneath (clone, select) run fine on fake CUDA tensors. Patched on FakeTensor
    # (every tensor the oracle makes), not on torch.Tensor: assigning __getitem__ to a class and deleting it
    # leaves CPython's sequence slot changed on that class and its subclasses, and on torch.Tensor that made
    # torch.tensor([0-d tensors]) raise "len() of a 0-d tensor" for the rest of the session (Qwen2-VL's
    # get_rope_index in tests/test_hf_images.py, in the fresh-clone CI).
    FakeTensor.contiguous, FakeTensor.__getitem__ = _contiguous, _getitem
    try:
        yield
    finally:
        del FakeTensor.contiguous, FakeTensor.__getitem__
        torch.set_autocast_enabled("cuda", prev[0])
        torch.set_autocast_dtype("cuda", prev[1])
        torch.clear_autocast_cache()


def fake_cuda(mode, tree):
    def convert(t):
        if not isinstance(t, torch.Tensor):
            return t
        meta = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
        return FakeTensor(mode, meta, torch.device("cuda"))

    return tree_map(convert, tree)


def dtypes_of(out):
    return tuple(t.dtype for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))


class OpLog(TorchDispatchMode):
    """(aten op, output dtypes) of every op below autograd."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, tuple]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.namespace != "prim":
            self.ops.append((str(func.overloadpacket.__name__), dtypes_of(out), dtypes_of((args, kwargs))))
        return out


def casts(log: OpLog):
    return [(ins, outs) for name, outs, ins in log.ops if name == "_to_copy"]


# ---------------------------------------------------------------------------------------------
# 1. the table equals the binary's AutocastCUDA registrations
# ---------------------------------------------------------------------------------------------


def binary_cuda_ops() -> set[str]:
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    return {n.removeprefix("aten::") for n in torch._C._dispatch_get_all_op_names() if has(n, "AutocastCUDA")}


def test_table_equals_the_binarys_autocast_cuda_kernels():
    table = set(ca.cuda_policy_table())
    binary = binary_cuda_ops()
    assert table - binary == set(), "in our table, not registered by this torch"
    assert binary - table == set(), "registered by this torch, missing from our table"
    assert len(table) == 119


# ---------------------------------------------------------------------------------------------
# 2. torch's lists, run like _run_autocast_outofplace, plus the oracle
# ---------------------------------------------------------------------------------------------

# list name -> (module of the torch.* variant, expected output: "low" | "fp32" | "given" | "raises")
LISTS = {
    "torch_fp16": (torch, "low"),
    "nn_fp16": (torch._C._nn, "low"),
    "linalg_fp16": (torch._C._linalg, "low"),
    "methods_fp16": (None, "low"),
    "torch_fp32": (torch, "fp32"),
    "nn_fp32": (torch._C._nn, "fp32"),
    "methods_fp32": (None, "fp32"),
    "torch_need_autocast_promote": (torch, "fp32"),
    "torch_expect_builtin_promote": (torch, "given"),
    "methods_expect_builtin_promote": (None, "given"),
    "banned": (None, "raises"),
}


def parse_entry(list_name, entry):
    """(op, args, kwargs, out_type, module override, why-not-run) from the lists' several shapes."""
    op, rest = entry[0], entry[1:]
    if list_name == "banned":
        return op, rest[0], {}, None, rest[1], None
    if list_name.endswith("expect_builtin_promote"):
        return op, rest[0], {}, rest[1], None, None
    if isinstance(rest[0], str):  # ("einsum", "bkhd,bqhd->bqkh", mat0 + mat1)
        return op, (rest[0], *rest[1]), {}, None, None, (
            "list entry is malformed: 4-d equation for 2-d operands (test_cuda reads its third element as a "
            "skip flag, so torch never runs it); einsum is checked in SUPPLEMENT")
    kwargs = rest[1] if len(rest) > 1 and isinstance(rest[1], dict) else {}
    return op, rest[0], kwargs, None, None, None


def cast_like_torch(val, to_type):
    if isinstance(val, torch.Tensor):
        return val.to(to_type) if val.is_floating_point() else val
    if isinstance(val, (list, tuple)):
        return type(val)(cast_like_torch(v, to_type) for v in val)
    return val


def same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def variants(op, args, kwargs, module):
    """The torch.* / Tensor.* calls that exist for ``op`` (as _run_autocast_outofplace tries them)."""
    calls = []
    if module is not None and hasattr(module, op):
        calls.append(("module", lambda a: getattr(module, op)(*a, **kwargs)))
    if hasattr(torch.Tensor, op):
        calls.append(("method", lambda a: getattr(a[0], op)(*a[1:], **kwargs)))
    return calls


def outcome(fn):
    """('ok', output) or ('raises', message)."""
    try:
        return "ok", fn()
    except Exception as exc:  # noqa: BLE001 - recorded and compared
        first = str(exc).splitlines()[0] if str(exc) else ""
        return "raises", f"{type(exc).__name__}: {first[:110]}"


class ListRun:
    def __init__(self):
        self.checked = collections.Counter()  # how each call was checked -> count
        self.checked_cases: list[tuple[str, str]] = []  # (case, how)
        self.skipped: list[tuple[str, str]] = []  # (case, reason)
        self.failures: list[tuple[str, str]] = []  # (case, message)
        self.fired: set[str] = set()  # table ops whose emulated kernel ran in the call being checked
        self.exercised: set[str] = set()  # table ops whose kernel ran in a call that passed its checks

    def passed(self, case, how):
        self.checked[how] += 1
        self.checked_cases.append((case, how))
        self.exercised |= self.fired


AUTOCAST_ERRORS = ("unsafe to autocast", "Unexpected floating ScalarType")


def oracle_outcome(call, args, low):
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    cuda_args = fake_cuda(mode, args)
    with mode, real_cuda_autocast(low):
        return outcome(lambda: call(cuda_args))


def our_outcome(run, call, args, low):
    """Ours on real CPU tensors; where no CPU kernel runs it, on fake CPU tensors as memest does."""
    run.fired = set()
    with cuda_autocast(low):
        ours = outcome(lambda: call(args))
    if ours[0] == "ok" or any(e in ours[1] for e in AUTOCAST_ERRORS):
        return ours, "cpu"
    run.fired = set()
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake_args = tree_map(lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t, args)
    with mode, cuda_autocast(low):
        fake = outcome(lambda: call(fake_args))
    return (fake, "fake") if fake[0] == "ok" else (ours, "cpu")


def autocast_error(result):
    return result[0] == "raises" and next((e for e in AUTOCAST_ERRORS if e in result[1]), "other error")


def check_call(run, case, call, args, low, out_type=None, control=None, must_raise=False):
    """Compare one call with the oracle, the list's expectation and (on CPU) the hand-cast control."""
    oracle = oracle_outcome(call, args, low)
    ours, where = our_outcome(run, call, args, low)
    if oracle[0] == "raises" and autocast_error(oracle) != "other error":
        if autocast_error(ours) == autocast_error(oracle):
            run.passed(case, "raises as CUDA autocast does")
        else:
            gave = ours[1] if ours[0] == "raises" else dtypes_of(ours[1])
            run.failures.append((case, f"CUDA autocast raises {oracle[1]!r}; ours gave {gave}"))
        return
    if must_raise:
        run.failures.append((case, f"expected an autocast error, got {ours}"))
        return
    if ours[0] == "raises":
        if oracle[0] == "raises":
            run.skipped.append((case, f"runs on no tensors here: CPU/fake CPU: {ours[1]}; fake CUDA: {oracle[1]}"))
        else:
            run.failures.append((case, f"ours raised {ours[1]!r}; CUDA autocast gives {dtypes_of(oracle[1])}"))
        return
    got = dtypes_of(ours[1])
    if oracle[0] == "ok" and got != dtypes_of(oracle[1]):
        run.failures.append((case, f"ours {got}, CUDA autocast {dtypes_of(oracle[1])}"))
        return
    if out_type is not None and isinstance(ours[1], torch.Tensor) and ours[1].dtype != out_type:
        run.failures.append((case, f"ours {ours[1].dtype}, the list expects {out_type}"))
        return
    if control is not None and where == "cpu":
        expected = outcome(control)
        if expected[0] == "raises" or not same(ours[1], expected[1]):
            run.failures.append((case, "result differs from the hand-cast control"))
            return
    how = ("oracle" if oracle[0] == "ok" else "list only (the oracle cannot run it: " + oracle[1].split(":")[0] + ")")
    how += ", control" if control is not None and where == "cpu" else ""
    how += ", fake CPU tensors" if where == "fake" else ""
    run.passed(case, how)


def run_entry(run: ListRun, list_name: str, index: int, entry, low: torch.dtype):
    module, expectation = LISTS[list_name]
    op, args, kwargs, given, banned_module, why_not = parse_entry(list_name, entry)
    case = f"{list_name}[{index}] {op} ({str(low).removeprefix('torch.')})"
    if why_not:
        run.skipped.append((case, why_not))
        return
    if list_name == "banned":
        module = banned_module
    calls = variants(op, args, kwargs, module)
    if not calls:
        run.failures.append((case, "neither a torch.* nor a Tensor.* variant exists"))
        return
    run_as = {"low": low, "fp32": torch.float32, "given": torch.float32}.get(expectation)
    out_type = given if given is not None else run_as
    for variant, call in calls:
        control = None
        if run_as is not None:  # _run_autocast_outofplace's control: cast by hand, autocast off
            if variant == "module":
                control = lambda call=call: call(cast_like_torch(args, run_as))  # noqa: E731
            else:
                control = lambda call=call: call(  # noqa: E731
                    (args[0].to(run_as), *cast_like_torch(tuple(args[1:]), run_as))
                )
        check_call(run, f"{case} {variant}", call, args, low, out_type, control, must_raise=expectation == "raises")


# Ops the binary registers that torch's lists never reach, with arguments written here. Checked against
# the oracle only (dtype), on real CPU tensors, else on fake CPU tensors.
def supplement():
    n = 8
    x16 = torch.randn(n, n, dtype=torch.float16)
    x32 = torch.randn(n, n)
    img = torch.randn(1, 2, 4, 4, dtype=torch.float16)
    vol = torch.randn(1, 2, 4, 4, 4, dtype=torch.float16)
    seq = torch.randn(1, 2, 4, dtype=torch.float16)
    q = torch.randn(1, 2, 4, 8)
    nn_ = torch._C._nn
    return [
        ("einsum", lambda a: torch.einsum("ij,jk->ik", *a), (x32, x32)),
        ("native_layer_norm", lambda a: torch.native_layer_norm(a[0], (n,), None, None, 1e-5), (x16,)),
        ("frobenius_norm.dim", lambda a: torch.frobenius_norm(a[0], [0, 1]), (x16,)),
        ("nuclear_norm", lambda a: torch.nuclear_norm(a[0]), (x16,)),
        ("nuclear_norm.dim", lambda a: torch.nuclear_norm(a[0], [0, 1]), (x16,)),
        ("huber_loss", lambda a: nn_.huber_loss(*a), (x16, x16)),
        ("linalg_vector_norm", lambda a: torch.linalg.vector_norm(a[0]), (x16,)),
        ("linalg_matrix_norm", lambda a: torch.linalg.matrix_norm(a[0], 1), (x16,)),
        ("linalg_matrix_norm.str_ord", lambda a: torch.linalg.matrix_norm(a[0], "fro"), (x16,)),
        ("scaled_dot_product_attention", lambda a: F.scaled_dot_product_attention(*a), (q, q, q)),
        ("_thnn_fused_lstm_cell", lambda a: torch.ops.aten._thnn_fused_lstm_cell(*a),
         (torch.randn(2, 16), torch.randn(2, 16), torch.randn(2, 4), torch.randn(16), torch.randn(16))),
        ("_thnn_fused_gru_cell", lambda a: torch.ops.aten._thnn_fused_gru_cell(*a),
         (torch.randn(2, 12), torch.randn(2, 12), torch.randn(2, 4), torch.randn(12), torch.randn(12))),
        ("_scaled_dot_product_flash_attention",
         lambda a: torch.ops.aten._scaled_dot_product_flash_attention(*a), (q, q, q)),
        ("upsample_nearest1d", lambda a: nn_.upsample_nearest1d(a[0], [8]), (seq,)),
        ("_upsample_nearest_exact1d", lambda a: nn_._upsample_nearest_exact1d(a[0], [8]), (seq,)),
        ("upsample_nearest2d", lambda a: nn_.upsample_nearest2d(a[0], [8, 8]), (img,)),
        ("_upsample_nearest_exact2d", lambda a: nn_._upsample_nearest_exact2d(a[0], [8, 8]), (img,)),
        ("upsample_nearest3d", lambda a: nn_.upsample_nearest3d(a[0], [8, 8, 8]), (vol,)),
        ("_upsample_nearest_exact3d", lambda a: nn_._upsample_nearest_exact3d(a[0], [8, 8, 8]), (vol,)),
        ("upsample_linear1d", lambda a: nn_.upsample_linear1d(a[0], [8], False), (seq,)),
        ("upsample_bilinear2d", lambda a: nn_.upsample_bilinear2d(a[0], [8, 8], False), (img,)),
        ("_upsample_bilinear2d_aa", lambda a: nn_._upsample_bilinear2d_aa(a[0], [8, 8], False), (img,)),
        ("upsample_trilinear3d", lambda a: nn_.upsample_trilinear3d(a[0], [8, 8, 8], False), (vol,)),
        ("upsample_bicubic2d", lambda a: nn_.upsample_bicubic2d(a[0], [8, 8], False), (img,)),
        ("_upsample_bicubic2d_aa", lambda a: nn_._upsample_bicubic2d_aa(a[0], [8, 8], False), (img,)),
        ("prod.dim_int", lambda a: torch.prod(a[0], 0), (x16,)),
        ("cumprod", lambda a: torch.cumprod(a[0], 0), (x16,)),
        ("log_softmax.int", lambda a: torch.log_softmax(a[0], 0), (x16,)),
        ("sum.dim_IntList", lambda a: torch.sum(a[0], [0]), (x16,)),
        ("pow.Scalar", lambda a: torch.pow(1.5, a[0]), (x16,)),
        ("norm.ScalarOpt_dim", lambda a: torch.norm(a[0], 2, [0]), (x16,)),  # torch.norm's Python path
        ("norm.ScalarOpt_dim", lambda a: torch.ops.aten.norm.ScalarOpt_dim(a[0], 2, [0]), (x16,)),
        ("norm.Scalar", lambda a: torch.ops.aten.norm.Scalar(a[0], 2), (x16,)),
        ("_convolution.deprecated", lambda a: torch.ops.aten._convolution.deprecated(
            a[0], a[1], None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1, False, True, True),
         (img.float(), torch.randn(2, 2, 1, 1))),
        ("conv_transpose2d.input", lambda a: F.conv_transpose2d(*a), (img.float(), torch.randn(2, 2, 1, 1))),
        ("cudnn_convolution_transpose", lambda a: torch.cudnn_convolution_transpose(
            a[0], a[1], [0, 0], [0, 0], [1, 1], [1, 1], 1, False, True, True), (img.float(), torch.randn(2, 2, 1, 1))),
    ]


def run_supplement(run: ListRun, low):
    for name, call, args in supplement():
        check_call(run, f"SUPPLEMENT {name} ({str(low).removeprefix('torch.')})", call, args, low)


@pytest.fixture(scope="module")
def list_run():
    """Run every entry of torch's CUDA lists (fp16, and again under bf16) and the supplement, recording
    which of our kernels fired."""
    run = ListRun()
    original = ca._kernels

    def recording_kernels():
        def wrap(name, kernel):
            def k(*args, **kwargs):
                run.fired.add(name)
                return kernel(*args, **kwargs)

            return k

        return {name: wrap(name, kernel) for name, kernel in original().items()}

    ca._kernels = recording_kernels
    try:
        lists = load_torch_lists()
        for low in (torch.float16, torch.bfloat16):
            for list_name in LISTS:
                for i, entry in enumerate(getattr(lists, list_name)):
                    run_entry(run, list_name, i, entry, low)
            run_supplement(run, low)
    finally:
        ca._kernels = original
    return run


def test_torch_lists_agree_with_cuda_autocast(list_run):
    assert list_run.failures == [], "\n".join(f"{c}: {m}" for c, m in list_run.failures)


def test_torch_lists_mostly_run(list_run):
    checked = sum(list_run.checked.values())
    skipped = len(list_run.skipped)
    print(f"\nchecked {checked} calls, skipped {skipped}")
    for how, count in sorted(list_run.checked.items()):
        print(f"  {count:4d} checked by {how}")
    for case, why in list_run.skipped:
        print(f"  skipped {case}: {why}")
    assert checked >= 400
    assert skipped / (checked + skipped) < 0.05


# Ops no check here can run: CUDA-only kernels the fake CUDA oracle cannot run either (it falls back to
# a real CUDA kernel, or its meta function is missing).
UNREACHED = {
    "cudnn_convolution": "CUDA-only kernel; fake CUDA tensors call into the CUDA runtime",
    "cudnn_convolution_transpose": "CUDA-only kernel; fake CUDA tensors call into the CUDA runtime",
    "_thnn_fused_gru_cell": "CUDA-only kernel; fake CUDA tensors call into the CUDA runtime",
}


def test_every_registered_op_is_checked(list_run):
    """Each op of the table ran through our kernel in a call that passed its checks."""
    table = set(ca.cuda_policy_table())
    missing = table - list_run.exercised - set(UNREACHED)
    checked = len(list_run.exercised & table)
    print(f"\n{checked} of {len(table)} registered ops checked; not reachable: {sorted(UNREACHED)}")
    assert missing == set(), f"no passing check reached these ops: {sorted(missing)}"
    assert list_run.exercised & set(UNREACHED) == set(), "UNREACHED is out of date"


# ---------------------------------------------------------------------------------------------
# 3. whole models against the oracle: the same aten ops with the same dtypes
# ---------------------------------------------------------------------------------------------


class Mixed(nn.Module):
    """Ops whose CUDA autocast behaviour comes from inside composites."""

    def __init__(self, d=16, vocab=11):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.norm = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, 2, dropout=0.0)  # need_weights=True: bmm/softmax path
        self.conv = nn.Conv1d(d, d, 3, padding="same")
        self.fc = nn.Linear(d, d)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids):
        h = self.emb(ids)  # (T, B, d)
        a, _ = self.attn(self.norm(h), h, h)
        h = h + a
        h = h + self.conv(h.permute(1, 2, 0)).permute(2, 0, 1)
        h = F.gelu(self.fc(h)) + F.normalize(h, dim=-1)
        scores = torch.matmul(h, h.transpose(-1, -2))
        h = h + torch.softmax(scores, -1, dtype=torch.float32).to(h.dtype) @ h  # HF eager attention idiom
        logits = self.head(h)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids.reshape(-1))


@pytest.mark.parametrize("low", [torch.float16, torch.bfloat16])
def test_model_ops_and_dtypes_match_cuda_autocast(low):
    torch.manual_seed(0)
    model = Mixed().train()
    ids = torch.randint(0, 11, (5, 2))
    params = dict(model.named_parameters())

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with torch.no_grad():  # the oracle cannot run autograd on fake CUDA tensors in a CPU build
        cuda_params, cuda_ids = fake_cuda(mode, (params, ids))
        with mode, real_cuda_autocast(low), OpLog() as oracle:
            torch.func.functional_call(model, cuda_params, (cuda_ids,))

        fmode = FakeTensorMode(allow_non_fake_inputs=True)
        cpu_params = {k: fmode.from_tensor(v) for k, v in params.items()}
        cpu_ids = fmode.from_tensor(ids)
        with fmode, cuda_autocast(low), OpLog() as ours:
            torch.func.functional_call(model, cpu_params, (cpu_ids,))

    assert len(ours.ops) > 40 and ours.ops == oracle.ops
    names = [name for name, _, _ in ours.ops]
    assert "nll_loss_forward" in names and "_log_softmax" in names and "bmm" in names


def test_cross_entropy_as_on_cuda():
    """cross_entropy_loss passes log_softmax an explicit dtype, so log-probs stay in low precision;
    nll_loss (fp32 list) then casts them. A name-level guess ("cross_entropy is fp32") gets this wrong."""
    mode = FakeTensorMode()
    with mode:
        logits = torch.randn(4, 10, dtype=torch.bfloat16)
        target = torch.zeros(4, dtype=torch.long)
    with mode, cuda_autocast(torch.bfloat16), OpLog() as log:
        loss = F.cross_entropy(logits, target)
    assert loss.dtype == torch.float32
    assert [(n, o) for n, o, _ in log.ops] == [
        ("_log_softmax", (torch.bfloat16,)),
        ("_to_copy", (torch.float32,)),
        ("nll_loss_forward", (torch.float32, torch.float32)),
    ]


# ---------------------------------------------------------------------------------------------
# 4. the weight cache, autograd, single policies, integer tensors, fake tensors
# ---------------------------------------------------------------------------------------------


def test_weight_cast_once_per_region():
    lin = nn.Linear(8, 8)
    x = torch.randn(4, 8)
    with OpLog() as log, cuda_autocast(torch.float16):
        lin(lin(x))
    # x, weight, bias: the second call reuses the cached weight and bias casts; its input is fp16 already
    assert len(casts(log)) == 3
    assert ca._cast_cache == {}  # cleared when the region exits

    with OpLog() as log, cuda_autocast(torch.float16, cache_enabled=False):
        lin(lin(x))
    assert len(casts(log)) == 5


def test_cache_lives_across_nested_regions_and_only_holds_leaf_params():
    lin = nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)  # a leaf that requires grad: cached, like a parameter
    frozen = torch.randn(8, 8)  # no grad: never cached
    with OpLog() as log, cuda_autocast(torch.float16):
        lin(x)
        with torch.autocast("cpu", dtype=torch.float16):  # nested torch.autocast exit must not clear it
            lin(x)
        with cuda_autocast(torch.float16):
            lin(x)
        assert len(ca._cast_cache) == 3
        x @ frozen
        x @ frozen
    assert len(casts(log)) == 3 + 2
    assert ca._cast_cache == {}


def test_autograd_saves_the_cast_copies():
    lin = nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with cuda_autocast(torch.bfloat16):
            y = lin(x)
            weight_copy = ca._cast_cache[id(lin.weight)][1]
    assert y.dtype == torch.bfloat16
    # addmm saves its two matrix operands: the bf16 input copy and (a view of) the cached bf16 weight copy
    assert sorted((tuple(t.shape), t.dtype) for t in saved) == [((4, 8), torch.bfloat16), ((8, 8), torch.bfloat16)]
    assert any(t.untyped_storage().data_ptr() == weight_copy.untyped_storage().data_ptr() for t in saved)
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32
    assert lin.weight.grad.dtype == torch.float32 and lin.bias.grad.dtype == torch.float32


def test_layer_norm_and_softmax_in_fp32():
    x16 = torch.randn(4, 8, dtype=torch.float16)
    x32 = torch.randn(4, 8)
    with cuda_autocast(torch.float16):
        assert F.layer_norm(x16, (8,)).dtype == torch.float32
        assert F.layer_norm(x32, (8,)).dtype == torch.float32
        assert nn.LayerNorm(8)(x16).dtype == torch.float32
        assert F.softmax(x16, -1).dtype == torch.float32
        assert x16.softmax(-1).dtype == torch.float32
        assert F.softmax(x16, -1, dtype=torch.float16).dtype == torch.float16  # explicit dtype respected
        assert F.linear(x32, x32).dtype == torch.float16
        assert (x32 @ x32.T).dtype == torch.float16
        assert torch.exp(x16).dtype == torch.float32 and (x16 ** 2).dtype == torch.float32
        assert F.mse_loss(x16, x16).dtype == torch.float32
        assert F.normalize(x16).dtype == torch.float32  # linalg_vector_norm in fp32, then promotion
        assert F.scaled_dot_product_attention(*(torch.randn(1, 2, 4, 8),) * 3).dtype == torch.float16
        with pytest.raises(RuntimeError, match="unsafe to autocast"):
            F.binary_cross_entropy(torch.rand(4), torch.rand(4))
        # CPU autocast would promote cat; CUDA autocast leaves it to builtin promotion
        assert torch.cat([x16, x16]).dtype == torch.float16
        assert torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda") == torch.float16


def test_half_softmax_runs_half_to_float_on_fake_tensors():
    with FakeTensorMode():
        x = torch.randn(4, 8, dtype=torch.float16, requires_grad=True)
        with cuda_autocast(torch.float16), OpLog() as log:
            y = torch.softmax(x, -1)
        assert [(n, o) for n, o, _ in log.ops if n != "detach"] == [("_softmax", (torch.float32,))]
        y.sum().backward()
        assert x.grad.dtype == torch.float16


def test_integer_and_double_tensors_untouched():
    i = torch.randint(0, 5, (4, 4))
    d = torch.randn(4, 4, dtype=torch.float64)
    emb = nn.Embedding(5, 8)
    with OpLog() as log, cuda_autocast(torch.float16):
        assert torch.mm(i, i).dtype == torch.int64
        assert i.sum().dtype == torch.int64 and torch.cumsum(i, 0).dtype == torch.int64
        assert torch.mm(d, d).dtype == torch.float64
        assert torch.exp(d).dtype == torch.float64
        assert emb(i).dtype == torch.float32  # embedding is not on the CUDA list
    assert casts(log) == []


def test_disabled_regions_in_model_code():
    lin = nn.Linear(8, 8)
    x = torch.randn(4, 8)
    with cuda_autocast(torch.float16):
        with torch.autocast("cpu", enabled=False):  # HF rotary: device_type=x.device.type
            assert lin(x).dtype == torch.float32
        with torch.autocast("cuda", enabled=False):
            assert lin(x).dtype == torch.float32
            assert not torch.is_autocast_enabled("cuda")
        assert lin(x).dtype == torch.float16
        with torch.autocast("cpu", dtype=torch.bfloat16):  # a nested dtype change applies, as on CUDA
            assert nn.Linear(8, 8)(x).dtype == torch.bfloat16
            # ...but cached_cast looks casts up by source tensor alone: lin's fp16 weight copy comes back
            with pytest.raises(RuntimeError, match="same dtype"):
                lin(x)
    with cuda_autocast(torch.float16, enabled=False):
        assert lin(x).dtype == torch.float32


def test_state_restored_and_cpu_autocast_untouched_afterwards():
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    with cuda_autocast(torch.float16):
        assert torch.softmax(x, -1).dtype == torch.float32
    assert not ca.installed()
    assert not torch.is_autocast_enabled("cpu") and not torch.is_autocast_enabled("cuda")
    assert torch.get_autocast_dtype("cuda") == torch.float16 and torch.get_autocast_dtype("cpu") == torch.bfloat16
    assert torch.clear_autocast_cache is ca._torch_clear_autocast_cache
    with torch.autocast("cpu", dtype=torch.bfloat16):  # CPU autocast's own lists are back
        assert torch.softmax(x, -1).dtype == torch.bfloat16
        assert torch.cat([x, x.float()]).dtype == torch.float32
    with pytest.raises(ValueError):
        with cuda_autocast(torch.float32):
            pass


def test_fake_tensors_forward_and_backward():
    with FakeTensorMode():
        model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 10))
        x = torch.randn(4, 16)
        target = torch.randint(0, 10, (4,))
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            with cuda_autocast(torch.bfloat16), OpLog() as log:
                loss = F.cross_entropy(model(x), target)
        assert all(isinstance(t, FakeTensor) for t in saved)
        assert loss.dtype == torch.float32
        layer_norm = [o for n, o, _ in log.ops if n == "native_layer_norm"]
        assert layer_norm and layer_norm[0][0] == torch.float32
        assert sum(1 for n, _, _ in log.ops if n == "_to_copy") >= 5  # x, 2 weights, 2 biases, ...
        loss.backward()
        for p in model.parameters():
            assert p.grad is not None and p.grad.dtype == torch.float32


def test_checkpoint_recompute_needs_the_scope():
    """torch.utils.checkpoint replays the forward under torch.autocast("cpu") in backward; only with the
    kernels installed (cuda_autocast_scope) is that replay CUDA autocast, as it is on a GPU."""
    from torch.utils.checkpoint import checkpoint

    block = nn.Linear(8, 8)

    def f(x):
        return torch.softmax(block(x), -1)

    def softmax_dtypes_in_backward(scope):
        x = torch.randn(4, 8, requires_grad=True)
        with scope:
            with cuda_autocast(torch.float16):
                y = checkpoint(f, x, use_reentrant=False)
            with OpLog() as log:
                y.float().sum().backward()
            assert ca._cast_cache == {}  # the replay's torch.autocast exit cleared the casts it cached
        return [o for n, o, _ in log.ops if n == "_softmax"]

    assert softmax_dtypes_in_backward(cuda_autocast_scope()) == [(torch.float32,)]
    # without it the replay follows CPU autocast's lists (softmax stays fp16) and checkpoint notices
    with pytest.raises(torch.utils.checkpoint.CheckpointError, match="different metadata"):
        softmax_dtypes_in_backward(contextlib.nullcontext())


def test_module_cites_its_sources():
    source = inspect.getsource(ca)
    for cite in ("autocast_mode.h", "autocast_mode.cpp", "AutocastRNN.cpp", "AT_FORALL_FP32_SET_OPT_DTYPE"):
        assert cite in source


@pytest.mark.parametrize("low", [torch.float16, torch.bfloat16])
def test_lstm_follows_the_cudnn_autocast_wrapper(low):
    """AutocastRNN.cpp (CUDA builds only, so no oracle here): fp16 whatever the autocast dtype, weights
    copied per call rather than cached."""
    lstm = nn.LSTM(4, 8, num_layers=2, batch_first=True)
    x = torch.randn(2, 3, 4)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake_lstm = nn.LSTM(4, 8, num_layers=2, batch_first=True)
        fx = mode.from_tensor(x)
    for module, inp in ((lstm, x), (fake_lstm, fx)):
        with OpLog() as log, cuda_autocast(low):
            out, (h, c) = module(inp)
            module(inp)
        assert out.dtype == h.dtype == c.dtype == torch.float16
        n_weights = len(list(module.parameters()))
        # per call: input, h0, c0 and every weight; nothing cached
        assert len(casts(log)) == 2 * (3 + n_weights)
        assert ca._cast_cache == {}

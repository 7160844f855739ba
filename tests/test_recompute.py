"""trace/recompute.py: a replayed recomputation leaves the trace the recomputation itself makes.

Each step is traced with selective checkpointing's recomputations replayed and with the replays switched off
(``Recomputes.enabled``), and with SAC's modes answering metadata queries themselves and as torch's own modes
(features/selective.py ``_answering_metadata``); every field of the traces must be equal. The steps' peaks against
real CPU runs are tests/test_sac.py's."""

from __future__ import annotations

import dataclasses

import pytest
from torch.utils import checkpoint as torch_checkpoint

from memest.features import selective
from memest.trace import recompute

from .conftest import model_ref, traced_making

TRANSFORMER = "examples/transformer.py"
LLAMA = "hf:tests/configs/llama-tiny.json"
GPT2 = "hf:tests/configs/gpt2-tiny.json"
STEPS = [
    # the example (nn.TransformerEncoderLayer, memest's own checkpoint wrapper) and two transformers models (their
    # own switch: partial(forward, layer, **kwargs)); CUDA's autocast weight cache, SDPA's backend counts; CPU
    dict(model=TRANSFORMER, batch=2, seq=32, target="cuda", optim="adamw", precision="bf16-mixed",
         checkpointing="selective"),
    dict(model=TRANSFORMER, batch=2, seq=32, target="cpu", optim="adamw", checkpointing="selective"),
    dict(model=LLAMA, batch=2, seq=32, target="cuda", precision="bf16-mixed", checkpointing="selective"),
    dict(model=GPT2, batch=2, seq=32, target="cpu", checkpointing="selective", grad_accum=2),
    # a policy of the model file's own; with torchtune's
    # activation offloading, torchao's float8 (its own replays inside), FSDP2
    dict(model=model_ref("sac_transformer"), batch=2, seq=32, target="cuda", optim="sgd",
         checkpointing="selective:checkpoint_policy"),
    dict(model=LLAMA, batch=2, seq=32, target="cuda", checkpointing="selective", activation_offload="torchtune"),
    dict(model=LLAMA, batch=2, seq=32, target="cuda", optim="adamw", shard="zero3", world_size=2,
         checkpointing="selective", precision="bf16-mixed"),
    # vision-language models: their blocks run under KnownValues (image_grid_thw's real values followed), a mode the
    # replay passes over with what it follows in the key; Qwen2.5-VL's window blocks and full-attention blocks take
    # different index tensors (cu_window_seqlens, cu_seqlens)
    dict(model="hf:tests/configs/qwen2-vl-tiny.json", batch=2, seq=32, images=1, image_size="60x90", target="cuda",
         precision="bf16-mixed", optim="adamw", checkpointing="selective"),
    dict(model="hf:tests/configs/qwen2.5-vl-tiny.json", batch=1, seq=16, images=1, image_size="140x250",
         target="cpu", checkpointing="selective"),
]


def _traced(spec: dict, monkeypatch, replays_on: bool, shortcut_on: bool = True):
    patches = [(recompute.Recomputes, "enabled", replays_on)]
    if not shortcut_on:
        patches.append((selective, "_answering_metadata", lambda caching, cached: (caching, cached)))
    return traced_making(spec, monkeypatch, recompute.Recomputes, patches)


def _equal(a, b) -> None:
    da, db = dataclasses.asdict(a), dataclasses.asdict(b)
    for field in da:
        assert da[field] == db[field], f"trace field {field!r} differs"


@pytest.mark.parametrize("spec", STEPS, ids=lambda s: "-".join(str(v) for v in s.values()).replace("/", "_"))
def test_replayed_recomputations_leave_the_trace_the_ops_make(spec, monkeypatch):
    plain, _ = _traced(spec, monkeypatch, replays_on=False, shortcut_on=False)
    replayed, made = _traced(spec, monkeypatch, replays_on=True)
    assert sum(r.replayed for r in made) > 0, "no recomputation was replayed"
    _equal(plain, replayed)


def test_blocks_that_run_other_ops_are_not_replayed_from_each_other(monkeypatch):
    """tests/models/sac_uneven.py: blocks 1 and 3 run one op more than 0 and 2. Each kind is recorded once and
    replayed for its own kind only (the forward's part of the trace is in the key)."""
    spec = dict(model=model_ref("sac_uneven"), batch=2, seq=32, target="cpu", optim="sgd", checkpointing="selective")
    plain, _ = _traced(spec, monkeypatch, replays_on=False)
    replayed, made = _traced(spec, monkeypatch, replays_on=True)
    _equal(plain, replayed)
    (recomputes,) = made
    # two traced steps of four blocks: eight recomputations, two kinds recorded once each
    assert (recomputes.calls, len(recomputes.templates), recomputes.replayed) == (8, 2, 6)


def test_only_torchs_own_sac_modes_answer_metadata():
    """The metadata shortcut swaps the class of torch's two modes only (a subclass of someone else's stays as it is),
    and its modes are still torch's (isinstance), with their state."""
    caching, cached = torch_checkpoint.create_selective_checkpoint_contexts(lambda ctx, op, *a, **k: False)
    storage = caching.storage
    fast = selective._answering_metadata(caching, cached)
    assert [type(m).__name__ for m in fast] == ["_Caching", "_Cached"]
    assert isinstance(fast[0], torch_checkpoint._CachingTorchDispatchMode) and fast[0].storage is storage
    assert isinstance(fast[1], torch_checkpoint._CachedTorchDispatchMode) and fast[1].storage is storage

    class Theirs(torch_checkpoint._CachingTorchDispatchMode):
        pass

    theirs = Theirs(lambda ctx, op, *a, **k: False, {})
    assert type(selective._answering_metadata(theirs, cached)[0]) is Theirs


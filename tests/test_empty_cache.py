"""torch.cuda.empty_cache() during the step: the replay's EMPTY_CACHE event worked by hand from
c10/cuda/CUDACachingAllocator.cpp (``DeviceCachingAllocator::emptyCache`` -> ``release_cached_blocks`` ->
``release_blocks``: every cached block with no neighbour is cudaFree'd, expandable segments unmap the whole free pages
inside each free block), the trace recording the model code's calls without touching CUDA (trace/empty_cache.py),
and the loops that call it: transformers' ``torch_empty_cache_steps`` and trl's OffloadActivations under
bitsandbytes (features/empty_cache.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from memest.device.allocator import EMPTY_CACHE, CachingAllocator, parse_alloc_conf, replay
from memest.device.usage import allocator_events, empty_cache_schedules
from memest.errors import MemestError
from memest.estimator import estimate
from memest.spec import RunSpec
from memest.spec.trainers import training_args
from memest.trace.events import Phase

MiB = 1024 * 1024
KiB = 1024
ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "tests" / "configs" / "llama-tiny.json")


# --- the replay, by hand ----------------------------------------------------------------------------------
def test_only_whole_free_segments_are_released():
    # A 4 MiB request opens a 20 MiB segment (get_allocation_size: kLargeBuffer for 1-10 MiB); a second 4 MiB
    # request splits its remainder (should_split: 16 MiB left > kSmallSize). release_blocks frees only blocks with
    # no prev/next: with block 2 live the segment is split, so nothing goes; once both are free they merge
    # (free_block -> try_merge_blocks) into one whole block, which goes.
    events = [(1, 4 * MiB), (2, 4 * MiB), (1, -4 * MiB), EMPTY_CACHE, (2, -4 * MiB), EMPTY_CACHE]
    r = replay(events)
    assert (r.peak_reserved, r.final_reserved, r.num_device_frees) == (20 * MiB, 0, 1)
    assert (r.empty_cache_calls, r.empty_cache_released) == (2, 20 * MiB)
    alloc = CachingAllocator()
    one, two = alloc.malloc(4 * MiB), alloc.malloc(4 * MiB)
    alloc.free(one)
    assert alloc.empty_cache() == 0 and alloc.reserved == 20 * MiB
    alloc.check_invariants([two])


def test_the_peak_is_the_high_water_mark_and_a_released_segment_is_not_reused():
    # 30 MiB cached, then 40 MiB: the cached segment cannot serve it (get_free_block: best fit >= size), so
    # without the call the allocator holds 30 + 40; with it, the 30 MiB segment is gone first.
    grow = [(1, 30 * MiB), (1, -30 * MiB), (2, 40 * MiB)]
    assert replay(grow).peak_reserved == 70 * MiB
    assert replay(grow[:2] + [EMPTY_CACHE] + grow[2:]).peak_reserved == 40 * MiB
    # 40 MiB then 30 MiB: the cached 40 MiB segment would serve the 30 MiB (no cudaMalloc); emptied, a new 30 MiB
    # segment is cudaMalloc'd. max_memory_reserved keeps the 40 MiB high-water mark either way.
    shrink = [(1, 40 * MiB), (1, -40 * MiB), (2, 30 * MiB)]
    kept, emptied = replay(shrink), replay(shrink[:2] + [EMPTY_CACHE] + shrink[2:])
    assert kept.peak_reserved == emptied.peak_reserved == 40 * MiB
    assert (kept.num_device_allocs, kept.final_reserved) == (1, 40 * MiB)
    assert (emptied.num_device_allocs, emptied.final_reserved) == (2, 30 * MiB)


def test_small_pool_segments_go_once_wholly_free():
    # Requests of at most 1 MiB share 2 MiB small-pool segments (kSmallBuffer); the same rule applies.
    events = [(1, 100 * KiB), (2, 100 * KiB), (1, -100 * KiB), EMPTY_CACHE]
    assert replay(events).final_reserved == 2 * MiB
    assert replay([*events, (2, -100 * KiB), EMPTY_CACHE]).final_reserved == 0


def test_every_streams_free_segments_go():
    # release_cached_blocks walks the whole pools (large_blocks, small_blocks), every stream's blocks in them.
    events = [(1, 4 * MiB), (1, -4 * MiB), (2, 4 * MiB), (2, -4 * MiB), EMPTY_CACHE]
    r = replay(events, streams={1: 1})
    assert (r.peak_reserved, r.final_reserved, r.empty_cache_released) == (40 * MiB, 0, 40 * MiB)


def test_expandable_segments_unmap_whole_free_pages():
    # expandable_segments:True, large pool pages of 20 MiB: 30 MiB maps two pages (40 MiB); 4 MiB takes the free
    # mapped tail [30, 34). Block 1 freed: [0, 30) is free and holds one whole page, [0, 20): unmap_block unmaps it,
    # [20, 30) stays mapped (part of a page under [30, 34)). Block 2 freed: [20, 40) is free, unmapped, and the
    # segment, nothing of it mapped, is released (release_expandable_segment).
    conf = parse_alloc_conf("expandable_segments:True")
    events = [(1, 30 * MiB), (2, 4 * MiB), (1, -30 * MiB), EMPTY_CACHE]
    r = replay(events, conf)
    assert (r.peak_reserved, r.final_reserved, r.empty_cache_released) == (40 * MiB, 20 * MiB, 20 * MiB)
    r = replay([*events, (2, -4 * MiB), EMPTY_CACHE], conf)
    assert (r.final_reserved, r.num_segments, r.empty_cache_released) == (0, 0, 40 * MiB)


# --- the model code's calls -------------------------------------------------------------------------------
MODEL = '''
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(1024, 1)

    def forward(self, x):
        first = x.repeat(1, 200).sum(dim=1, keepdim=True)  # a 200 MiB temporary at batch 256
        {call}
        second = x.repeat(1, 300).sum(dim=1, keepdim=True)  # 300 MiB
        {call}
        {after}
        return self.lin(x) + first + second


def build_model():
    return Net()


def example_inputs(batch_size, seq_len=None):
    return (torch.randn(batch_size, 1024),)
'''


def _model(tmp_path: Path, call: str = "", after: str = "") -> str:
    path = tmp_path / f"net_{abs(hash((call, after)))}.py"
    path.write_text(MODEL.format(call=call, after=after))
    return str(path)


def _workspaces(result) -> int:
    return next(c.bytes for c in result.report.device.fixed_costs if c.name == "cublas_workspaces")


@pytest.fixture(scope="module")
def without(tmp_path_factory):
    return estimate(RunSpec(model=_model(tmp_path_factory.mktemp("net")), batch=256, optim="adam"))


@pytest.mark.parametrize(("call", "name"), [
    ("torch.cuda.empty_cache()", "torch.cuda.empty_cache"),
    ("torch.accelerator.empty_cache()", "torch.accelerator.empty_cache"),
    ("torch.get_device_module('cuda').empty_cache()", "torch.cuda.empty_cache"),  # the torch.cuda module itself
])
def test_a_forward_that_empties_the_cache_reserves_less(tmp_path, without, call, name):
    """The forward frees a 200 MiB temporary, then makes a 300 MiB one. Without the calls (the cuBLAS workspaces W,
    one handle W/2 at the first forward matmul and one at the first backward op, and a 2 MiB small-pool segment for the
    rest): step 1's forward holds 2 + W/2 + 200 + 300 MiB; step 2 fits in that cache. Each call releases the free
    temporary's segment: step 1 holds 2 + W/2 + 300, step 2 (both workspaces by then) 2 + W + 300."""
    with_calls = estimate(RunSpec(model=_model(tmp_path, call), batch=256, optim="adam"))
    assert not torch.cuda.is_initialized()
    w = _workspaces(without)
    assert without.report.device.reserved_peak_bytes == 2 * MiB + w // 2 + 500 * MiB
    assert with_calls.report.device.reserved_peak_bytes == 2 * MiB + w + 300 * MiB
    calls = with_calls.trace.empty_caches
    assert [(c.iteration, c.every) for c in calls] == [(1, 1), (1, 1), (2, 1), (2, 1)]
    assert all(c.by == f"{name}() in the forward" for c in calls)
    line = next(b for b in with_calls.report.device.range_basis if "empties the CUDA cache" in b)
    saved = (without.report.device.reserved_peak_bytes - with_calls.report.device.reserved_peak_bytes) // MiB
    assert "(4 calls)" in line and f"-{saved} MiB" in line and "release_cached_blocks" in line
    assert not any("empties the CUDA cache" in b for b in without.report.device.range_basis)


def test_the_trace_never_initialises_cuda_and_always_restores_torch(tmp_path):
    originals = (torch.cuda.empty_cache, torch.cuda.memory.empty_cache, torch.accelerator.empty_cache,
                 torch.accelerator.memory.empty_cache)
    estimate(RunSpec(model=_model(tmp_path, "torch.cuda.empty_cache()"), batch=2))
    with pytest.raises(MemestError, match="after the call"):
        estimate(RunSpec(model=_model(tmp_path, "torch.cuda.empty_cache()", "raise ValueError('after the call')"),
                         batch=2))
    assert (torch.cuda.empty_cache, torch.cuda.memory.empty_cache, torch.accelerator.empty_cache,
            torch.accelerator.memory.empty_cache) == originals
    assert not torch.cuda.is_initialized()


# --- transformers' torch_empty_cache_steps ------------------------------------------------------------------
def test_torch_empty_cache_steps_is_read_from_training_arguments(tmp_path):
    transformers = pytest.importorskip("transformers")
    data = json.loads(transformers.TrainingArguments(output_dir=str(tmp_path), torch_empty_cache_steps=4)
                      .to_json_string())
    cfg = training_args.read(tmp_path / "a.json", data)
    assert cfg.keys["empty_cache_steps"] == 4 and cfg.unknown == []
    assert any("torch_empty_cache_steps = 4" in source for source, _ in cfg.mapping)
    unset = json.loads(transformers.TrainingArguments(output_dir=str(tmp_path)).to_json_string())
    assert "empty_cache_steps" not in training_args.read(tmp_path / "a.json", unset).keys


def _trainer_step(tmp_path, every: int):
    return estimate(RunSpec(model=_model(tmp_path), batch=256, optim="adam", outputs="freed", grad_accum=2,
                            empty_cache_steps=every))


def test_torch_empty_cache_steps_empties_between_the_loss_and_backward(tmp_path):
    """Trainer.training_step: compute_loss, ``del inputs``, clear_device_cache() when global_step % N == 0, then
    backward: in every micro-step, after the outputs are freed and before backward's first allocation."""
    result = _trainer_step(tmp_path, 1)
    trace = result.trace
    backward = [i for i, _, phase in trace.phase_marks if phase is Phase.BACKWARD]
    assert [c.event for c in trace.empty_caches] == backward and len(backward) == 4  # 2 micro-steps x 2 steps
    assert all(c.every == 1 and "torch_empty_cache_steps 1" in c.by for c in trace.empty_caches)
    events = allocator_events(trace, result.report.device.fixed_costs)
    assert events.count(EMPTY_CACHE) == 4
    assert result.report.device.reserved_peak_bytes == replay(events).peak_reserved


@pytest.mark.parametrize(("every", "pairs"), [(2, 2), (3, 3)])
def test_one_step_in_n_takes_the_highest_pair_of_steps(tmp_path, every, pairs):
    """Steps 0, N, 2N... empty the cache: the run has the pair (0, 1), a pair (N-1, N) where the second empties
    after one that did not, and with N >= 3 pairs where neither does. The estimate is the highest of them."""
    result = _trainer_step(tmp_path, every)
    trace = result.trace
    schedules = empty_cache_schedules(trace)
    assert len(schedules) == pairs
    costs = result.report.device.fixed_costs
    peaks = [replay(allocator_events(trace, costs, calls)).peak_reserved for _, calls in schedules]
    assert result.report.device.reserved_peak_bytes == max(peaks)
    assert [len(calls) for _, calls in schedules][:2] == [2, 2]  # each micro-step of the step that empties
    line = next(b for b in result.report.device.range_basis if "empties the CUDA cache" in b)
    assert f"one step in {every} empties it" in line
    # the run's first two steps, the default events: step 0 empties, step 1 does not
    assert allocator_events(trace, costs).count(EMPTY_CACHE) == 2


def test_empty_cache_steps_is_a_training_option():
    with pytest.raises(MemestError, match="--empty-cache-steps"):
        RunSpec(model="examples/mlp.py", mode="inference", empty_cache_steps=2)
    with pytest.raises(MemestError, match="--empty-cache-steps"):
        RunSpec(model="examples/mlp.py", empty_cache_steps=-1)
    with pytest.raises(MemestError, match="--empty-cache-steps 1 .* --pp"):
        RunSpec(model="examples/mlp.py", empty_cache_steps=1, world_size=2, pp=2)


# --- trl's OffloadActivations under bitsandbytes --------------------------------------------------------------
@pytest.mark.parametrize("optim", ["adam8bit", "sgd"])
def test_trl_offload_empties_the_cache_at_each_step_when_bitsandbytes_is_imported(optim):
    """trl 1.16 activation_offloading.py l. 602-603: ``__enter__`` (each training_step) empties the device cache if
    bitsandbytes is in sys.modules: a bitsandbytes optimizer imports it; plain SGD does not say it is."""
    result = estimate(RunSpec(model=f"hf:{TINY}", batch=2, seq=64, optim=optim, activation_offload="trl"))
    trace = result.trace
    forward = [i for i, _, phase in trace.phase_marks if phase is Phase.FORWARD]
    note = next(n for n in result.report.notes if "--activation-offload trl" in n)
    if optim == "sgd":
        assert trace.empty_caches == [] and "not replayed" in note
        return
    assert [c.event for c in trace.empty_caches] == forward  # the start of each step's forward, before it allocates
    assert all("bitsandbytes imported, --optim adam8bit" in c.by for c in trace.empty_caches)
    assert "replayed" in note and "not replayed" not in note
    assert any("empties the CUDA cache" in b for b in result.report.device.range_basis)


def test_the_trainer_callback_reads_torch_empty_cache_steps(tmp_path):
    transformers = pytest.importorskip("transformers")
    from memest.integrations.transformers import trainer_settings

    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(TINY))
    args = transformers.TrainingArguments(output_dir=str(tmp_path), torch_empty_cache_steps=3, report_to="none")
    assert trainer_settings(args, model)["empty_cache_steps"] == 3
    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to="none")
    assert "empty_cache_steps" not in trainer_settings(args, model)


def test_a_compiled_forward_records_each_call_where_it_runs(tmp_path):
    """Under torch.compile the recorder is never traced into a graph (dynamo would replay the recording once, at the
    graph's end): each call breaks the graph and lands in event order, the second after the middle graph's output."""
    result = estimate(RunSpec(model=_model(tmp_path, "torch.cuda.empty_cache()"), batch=256, compile=True))
    calls = result.trace.empty_caches
    assert [c.iteration for c in calls] == [1, 1, 2, 2]
    first, second = calls[0].event, calls[1].event
    assert second > first
    assert all(delta > 0 for _, delta in result.trace.events[first:second])  # `second`, made between the calls
    assert not torch.cuda.is_initialized()

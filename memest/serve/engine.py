"""The serving-engine seam: what `memest serve` is asked (ServeSpec), what every engine answers (ServeEngine) and
the plan that holds one (ServePlan). Readers (views, check, colocate, the API) use only this interface; a new
engine is one module with a ServeEngine subclass and one line in serve/engines.py."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from memest.serve import evidence
from memest.serve.budget import Part
from memest.serve.kv import ModelKV
from memest.serve.profile import ProfileRun
from memest.serve.weights import Weights
from memest.spec.choices import CudaGraphs, Engine, KvDtype, ServeVerdict


@dataclass(frozen=True)
class ServeSpec:
    model: str  # hf:NAME, hf:path/config.json or hf:org/name (a decoder-only transformers config)
    total_bytes: int  # the GPU's memory as cudaMemGetInfo reports it
    card: str | None = None
    max_model_len: int | None = None  # None: the model's max_position_embeddings (vLLM's default)
    utilization: float | None = None  # vLLM gpu_memory_utilization / SGLang mem_fraction_static; None: default
    tp: int = 1
    kv_dtype: str = KvDtype.AUTO  # auto | fp8
    dtype: str = "auto"
    block_size: int = evidence.DEFAULT_BLOCK_SIZE
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    engine: str = Engine.VLLM  # a key of serve/engines.py's ENGINES
    cuda_graphs: str = CudaGraphs.PROFILED  # profiled (vLLM >= 0.21) | after (older) | none (--enforce-eager)
    compute_capability: tuple[int, int] = (9, 0)
    non_torch: Part | None = None  # measured (--non-torch-memory, --calibration); None: evidence.non_torch(tp)
    context: Part | None = None  # measured CUDA context (--calibration); None: the evidence spread


@dataclass(frozen=True)
class Setup:
    """What plan_serve resolves for every engine before the engine's own arithmetic."""

    spec: ServeSpec
    config: object  # the transformers config
    kv: ModelKV
    dtype: str  # the weights' dtype
    max_model_len: int
    max_positions: int | None  # the model's positions (None: the config gives none)
    max_num_seqs: int  # vLLM's default for the GPU unless given
    max_num_batched_tokens: int
    batching_source: str
    context: Part  # the CUDA context (measured or the evidence spread)
    notes: list[str]  # the KV notes every plan starts with
    profiles: dict = field(default_factory=dict)  # traced profile runs by their inputs, shared by the fixes' re-plans
    floor: bool = False  # a fix's first re-check: the profile run's lower bound, not traced (serve/profile.py)

    @property
    def model_name(self) -> str:
        return self.spec.model[3:]


@dataclass(frozen=True)
class Sizes:
    """What the KV cache holds at one end of its range."""

    blocks: int | None  # KV blocks (None: an engine without blocks, e.g. SGLang's token pool)
    tokens: int
    concurrency: float  # full max_model_len sequences the KV cache holds, fractional
    sequences: int  # whole max_model_len sequences at once


@dataclass(frozen=True)
class Gate:
    """What `memest check` compares for a serving config: the bytes the engine needs for some full-length
    sequences (low, expected, high) and the share of the GPU it may use."""

    low: int
    needed: int
    high: int
    budget: int
    share: str  # how the budget is taken from the GPU, after its label: 'x 0.9', 'x mem_fraction_static 0.88'


class ServeEngine(ABC):
    """One serving engine's start-up arithmetic. ``plan`` builds the engine object and its plan (verdict,
    reasons, fixes); the rest is what readers ask of it."""

    budget: object  # the engine's own budget record; its to_dict() is the JSON document's "budget"

    @classmethod
    @abstractmethod
    def plan(cls, setup: Setup) -> ServePlan:
        """The plan for ``setup``: this engine's budget, the verdict with its reasons and fixes, the notes."""

    @property
    @abstractmethod
    def kv_cache(self) -> Part:
        """The bytes the KV cache gets, expected with the range the costs' ranges give."""

    @abstractmethod
    def sizes(self) -> tuple[Sizes, Sizes, Sizes]:
        """What the KV cache holds with every cost at the high end (low), expected, and at the low end (high)."""

    @abstractmethod
    def steps(self) -> list[Part]:
        """The budget's steps from the GPU's total to the KV cache, in order (each with its range and source)."""

    @abstractmethod
    def capacity_lines(self) -> list[str]:
        """The KV cache's tokens and sequences in words, as the engine's own log would name them."""

    @abstractmethod
    def gate(self, sequences: int) -> Gate:
        """The bytes needed to hold ``sequences`` full-length sequences, and the budget they must fit."""

    @property
    def non_torch(self) -> Part | None:
        """The non-torch term subtracted before the KV cache; None where the engine subtracts none."""
        return None


@dataclass
class ServePlan:
    spec: ServeSpec
    model_name: str
    max_model_len: int
    max_positions: int | None
    utilization: float
    utilization_source: str
    max_num_seqs: int
    max_num_batched_tokens: int
    batching_source: str
    kv: ModelKV
    weights: Weights
    profile: ProfileRun | None
    engine: ServeEngine
    context: Part | None = None
    verdict: ServeVerdict = ServeVerdict.STARTS
    reasons: list[str] = field(default_factory=list)
    fixes: list[str] = field(default_factory=list)  # each re-planned: applied alone, the verdict is 'starts'
    larger_gpu: str | None = None  # the smallest catalogue GPU these settings start on (when they do not here)
    longest_context: int = 0  # the longest max_model_len one sequence fits at this budget
    longest_context_low: int = 0  # ... with every cost at the high end of its range
    longest_context_high: int = 0  # ... with every cost at the low end of its range
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    config: object = field(default=None, repr=False)  # the transformers config (for the fixes' re-computation)

    @property
    def starts(self) -> bool:
        """Starts for certain: one max_model_len sequence fits even with every cost at the high end of its range
        (the low end of the KV range). "may-not-start" is not a start."""
        return self.verdict == ServeVerdict.STARTS

    @property
    def non_torch(self) -> Part | None:
        return self.engine.non_torch

    @property
    def tokens(self) -> int:
        return self.engine.sizes()[1].tokens

    @property
    def sequences(self) -> int:
        return self.engine.sizes()[1].sequences

    @property
    def vllm(self):
        """The vLLM budget of a vLLM plan, else None (the field plans had before engines were objects)."""
        return self.engine.budget if self.spec.engine == Engine.VLLM else None

    @property
    def sglang(self):
        """The SGLang budget of an SGLang plan, else None (as vllm)."""
        return self.engine.budget if self.spec.engine == Engine.SGLANG else None


def gib(n: float) -> str:
    """Bytes as GiB with two decimals, for the reasons and fixes."""
    return f"{n / 2**30:.2f}"

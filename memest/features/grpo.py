"""--preference grpo: one step of trl's GRPOTrainer without vLLM, traced with trl's and transformers' own code.

Source: trl 1.16.0 (huggingface/trl): trl/trainer/grpo_trainer.py (``_generate_single_turn``'s regular
transformers path, ``_generate_and_score_completions``, ``_get_per_token_logps_and_entropies``, ``_compute_loss``),
trl/trainer/grpo_config.py (the defaults, read from ``GRPOConfig``'s fields, not copied), trl/trainer/utils.py
(``pad``, ``shuffle_sequence_dict``, ``split_tensor_dict``, ``use_adapter``, ``add_fused_lm_head``), trl/models/utils.py
(``disable_gradient_checkpointing``, ``_unwrap_model_for_generation``). One optimizer step, as trl runs it with
``use_vllm=False`` and ``steps_per_generation = gradient_accumulation_steps`` (GRPOConfig.__post_init__'s default):

1. generation: ``policy.generate`` (transformers' own, ``do_sample=True``, a ``DynamicCache``) under
   ``torch.no_grad()`` for ``--batch`` sequences (``per_device_train_batch_size`` completions: ``--batch /
   --generations`` prompts, each repeated ``--generations`` times by trl's RepeatSampler) of ``--seq`` prompt
   tokens, ``--completion-len`` new tokens each (``max_completion_length``; no sequence ends early at an EOS: the
   most the phase holds); then trl's EOS mask and the batch rebuilt as trl does (``pad`` of per-row tensors,
   ``shuffle_sequence_dict``, ``split_tensor_dict``).
2. reference log-probs, only when ``beta != 0`` (trl 1.16's default ``beta`` is 0.0: no reference model is
   loaded; ``--reference copy`` / ``adapter`` price ``beta != 0``): trl's ``_get_per_token_logps_and_entropies`` on
   the reference (a frozen copy, or the policy inside ``use_adapter(model, None)``) under ``torch.no_grad()``.
3. training step: trl's own ``_compute_loss`` (loss_type "dapo", token-level importance sampling, the metrics it
   logs), then backward; once per micro-step, then the optimizer step.

Gradient accumulation (``--grad-accum K``): trl's ``_prepare_inputs`` generates once per optimizer step for the whole
generation batch (``K x --batch`` completions, ``generation_batch_size``), computes the reference log-probs of all of
them (in chunks of ``--batch``), shuffles the batch (``shuffle_sequence_dict``) and splits it into K slices
(``split_tensor_dict``: views) kept in ``self._buffered_inputs``; each micro-step's ``_compute_loss`` takes one slice.
The buffer is an attribute: it is held through all K micro-steps and the optimizer step, and through the next step's
generation until that one's buffer replaces it. With ``gradient_accumulation_steps % steps_per_generation == 0`` (the
default), no old log-probs are computed.

Generation batch (``--generation-batch N``, trl's ``generation_batch_size``; grpo_config.py ``__post_init__``):
``steps_per_generation`` S = N / (``--batch`` x ``--world-size``) apart from K (N is global: per_device x
num_processes x S). Each rank's dataloader batch is S x ``--batch`` prompts' completions (grpo_trainer.py line 1275);
it gathers every rank's rewards and keeps its ``process_slice`` of the advantages. trl generates when ``self._step % S == 0`` (``_step``
counts micro-steps; ``num_iterations`` 1), for S x ``--batch`` completions split into S slices, and takes slice
``_step % S``; when ``K % S != 0`` ``_generate_and_score_completions`` also runs the policy's no-grad log-probs of the
whole generation batch (``old_per_token_logps``, in chunks of ``--batch``) before the reference's.

Gradient checkpointing (``--checkpointing blocks`` / ``blocks-reentrant``; trl's ``gradient_checkpointing`` defaults
to True, trl/trainer/base_config.py): transformers' switch on the policy's layers; trl turns it off around
``generate`` (``unwrap_model_for_generation``), which then runs with its KV cache, and around the no-grad log-probs
(``disable_gradient_checkpointing``), and back on with ``gradient_checkpointing_kwargs`` (None: transformers 5's
``use_reentrant=False``).

Data parallelism (``--world-size N`` over plain DDP, RunSpec._preference_ddp): GRPOTrainer.__init__ prepares the
policy with ``accelerator.prepare`` (DDP) and the reference with ``prepare_model(ref_model, evaluation_mode=True)``
(unwrapped: a full copy per rank); ``unwrap_model_for_generation`` generates on the unwrapped policy. The step's
gathers run as accelerate 1.15.0 runs them over the ranks (``_Accelerator``: ``num_items_in_batch =
gather(loss_mask.sum()).sum()``, the metrics' gathers and ``reduce`` in ``_compute_loss``), and the advantages are this
rank's ``process_slice`` of the gathered vector. Each of 2 real gloo ranks matches (tests/test_preference_ddp.py).
Over FSDP2 (``--shard zero3|zero2``, RunSpec._preference_fsdp): the policy and the reference copy wrapped by
parallel/trl_fsdp.py (accelerate's fsdp2_prepare_model, trl's prepare_fsdp); ``generate`` runs on the sharded policy
(trl's unwrap hands back the FSDP2 module; HF Trainer registers ``generate`` as a root forward method), the same
gathers. Each of 2 real gloo ranks and each phase match (tests/test_grpo_fsdp.py).

The rewards (user reward functions) are not traced: memest's advantages are trl's float32 ``(batch,)`` vector.
In the trace, scalar reads (the stop check of ``generate``, the metrics' ``.item()``, and ``generate``'s test for an
all-ones attention mask, which a real run with unpadded prompts drops: the trace keeps it, as with padded prompts,
one (completions, tokens) int64 tensor) get placeholders
(trace/values.py) and ``generate``'s loop runs exactly ``--completion-len`` times, as a real run does when no
sequence samples an EOS.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import types
from collections import defaultdict

import torch

from memest.errors import MemestError
from memest.features.base import StepFeature
from memest.features.preference import (
    ReferenceStep,
    add_fused_lm_head,
    frozen_copy,
    gather_for_metrics,
    no_padding,
    rank,
    reduce_sum,
    world_size,
)
from memest.spec.choices import CheckpointPolicy, Outputs, Quant, Reference, Rollout, Target
from memest.trace.values import PlaceholderScalars
from memest.units import format_bytes

TRL_SOURCE = "trl 1.16.0, trl/trainer/grpo_trainer.py (_generate_single_turn, _compute_loss) and grpo_config.py"
PHASES = ("generation", "reference log-probs", "training step")
# --rollout vllm, or a --generation-batch misaligned with the optimizer step: the policy's no-grad log-probs
OLD_LOGPS = "old log-probs"


def _trl():
    """trl's GRPO module and utils, or a MemestError saying how to install trl."""
    try:
        from trl.trainer import grpo_config, grpo_trainer, utils
    except ImportError as exc:
        raise MemestError(f"--preference grpo runs trl's own GRPOTrainer code; install trl (pip install "
                          f"'memest[trl]'): {exc}") from exc
    return grpo_trainer, grpo_config, utils


def config_defaults() -> types.SimpleNamespace:
    """GRPOConfig's field defaults (trl's own dataclass, read rather than copied)."""
    _, grpo_config, _ = _trl()
    values = {}
    for f in dataclasses.fields(grpo_config.GRPOConfig):
        if f.default is not dataclasses.MISSING:
            values[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            values[f.name] = f.default_factory()
    return types.SimpleNamespace(**values)


def generations_of(spec) -> int:
    """--generations, or GRPOConfig's num_generations default."""
    return spec.generations or config_defaults().num_generations


def completion_len_of(spec) -> int:
    """--completion-len, or GRPOConfig's max_completion_length default."""
    return spec.completion_len or config_defaults().max_completion_length


def steps_per_generation_of(spec) -> int:
    """trl's steps_per_generation: --generation-batch / (--batch x --world-size) (generation_batch_size is global,
    trl/trainer/grpo_config.py lines 1108-1110), or --grad-accum (GRPOConfig's default, generation_batch_size None)."""
    return spec.generation_batch // (spec.batch * spec.world_size) if spec.generation_batch else spec.grad_accum


def reference_of(spec) -> Reference | None:
    """The reference a GRPO step computes log-probs with: none at trl's default beta 0.0 (--reference auto)."""
    return None if spec.reference == Reference.AUTO else spec.reference


class _Accelerator:
    """What trl's code asks of its accelerator: no autocast; gathers and reductions as accelerate 1.15.0 runs them
    over this step's ranks (features/preference.py: identity gathers and a cloning reduce on one process)."""

    is_main_process = True
    sync_gradients = True
    device = torch.device("cpu")

    def __init__(self, gloo: bool = True):
        self.gloo = gloo  # --target cpu: gloo's all_gather into a list; else NCCL's all_gather_into_tensor
        self.num_processes = world_size()
        self.process_index = rank()

    @staticmethod
    def autocast():
        return contextlib.nullcontext()

    def gather(self, t):
        return gather_for_metrics(t, self.gloo)

    gather_for_metrics = gather

    @staticmethod
    def unwrap_model(model):
        return model

    @staticmethod
    def reduce(t, reduction="sum"):
        if reduction != "sum":
            raise MemestError(f"accelerator.reduce(reduction={reduction!r}) is not traced")
        return reduce_sum(t)


def stand_in_trainer(policy, reference, args, gloo: bool = True) -> types.SimpleNamespace:
    """The attributes of a GRPOTrainer that its ``_compute_loss`` and ``_get_per_token_logps_and_entropies`` read,
    set as GRPOTrainer.__init__ sets them from ``args`` (no vLLM, no MoE aux loss); its accelerator gathers over this
    step's ranks (``_Accelerator``)."""
    grpo_trainer, _, _ = _trl()
    cls = grpo_trainer.GRPOTrainer
    trainer = types.SimpleNamespace(
        model=policy, ref_model=reference, args=args, accelerator=_Accelerator(gloo), beta=args.beta,
        loss_type=args.loss_type, importance_sampling_level=args.importance_sampling_level,
        epsilon_low=args.epsilon, epsilon_high=args.epsilon_high if args.epsilon_high is not None else args.epsilon,
        top_entropy_quantile=args.top_entropy_quantile, off_policy_mask_threshold=args.off_policy_mask_threshold,
        use_vllm=False, vllm_importance_sampling_correction=args.vllm_importance_sampling_correction,
        aux_loss_enabled=False, router_aux_loss_coef=0.0, entropy_coef=args.entropy_coef,
        use_adaptive_entropy=args.use_adaptive_entropy,
        _entropy_bonus_enabled=args.entropy_coef != 0.0 or args.use_adaptive_entropy,
        _entropy_window_stats=None, _last_world_entropy=None,
        current_gradient_accumulation_steps=args.gradient_accumulation_steps,
        max_completion_length=args.max_completion_length,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
    )
    for name in ("_get_per_token_logps_and_entropies", "_compute_loss", "get_high_entropy_mask",
                 "get_off_policy_mask", "get_gamma_weights"):
        setattr(trainer, name, types.MethodType(getattr(cls, name), trainer))
    return trainer


class GRPOOutput(dict):
    """What the step's forward returns: the loss (HF Trainer's training_step calls backward on it)."""

    @property
    def loss(self) -> torch.Tensor:
        return self["loss"]


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(t)


@contextlib.contextmanager
def _fixed_length_generation(new_tokens: int):
    """transformers' ``generate`` loop run ``new_tokens`` times, as a real run that samples no EOS does: its stop
    check reads a value (``unfinished_sequences.max() == 0``) that fake tensors lack (trace/values.py answers it
    False, which alone would never stop)."""
    from transformers.generation.utils import GenerationMixin

    current = GenerationMixin._has_unfinished_sequences
    calls = itertools.count()
    GenerationMixin._has_unfinished_sequences = lambda self, *args, **kwargs: next(calls) < new_tokens
    try:
        with PlaceholderScalars():
            yield
    finally:
        GenerationMixin._has_unfinished_sequences = current


class GRPOStep(ReferenceStep):
    """The policy (and its frozen reference) as one module whose forward is one GRPOTrainer micro-step:
    generation, reference log-probs, then trl's ``_compute_loss``. The policy / reference pair, its train() (the
    reference stays in eval mode) and the frozen copy are ReferenceStep's (features/preference.py), as for DPO/KTO."""

    def __init__(self, policy, reference, adapter: bool, beta: float, completion_len: int, batch: int,
                 vllm: bool = False, accumulation: int = 1, checkpointing_kwargs: dict | None = None,
                 steps_per_generation: int | None = None):
        super().__init__(policy, reference, adapter)
        self.vllm = vllm
        self.beta = beta
        self.completion_len = completion_len
        self.batch = batch
        self.accumulation = accumulation  # gradient_accumulation_steps
        # trl's steps_per_generation: generation_batch_size / (per_device x processes) (default: accumulation)
        self.steps_per_generation = steps_per_generation or accumulation
        # trl's args.gradient_checkpointing_kwargs, re-applied when checkpointing is turned back on
        self.checkpointing_kwargs = checkpointing_kwargs
        self.events: list | None = None  # the trace's events list while tracing (GRPOFeature.contexts)
        self.gloo = True  # wrap(): accelerate's gathers over gloo (--target cpu) or NCCL
        self.phase_starts: list[tuple[str, int]] = []
        self.buffered: list[dict] | None = None  # trl's self._buffered_inputs: the generation batch's K slices
        self.generate_next = True  # an optimizer step starts (GRPOFeature.loop)
        self.optimizer_step = -1  # the optimizer steps begun so far, less one
        self.micro_step = 0  # within the optimizer step

    def _importance_sampling(self, *args):
        return _importance_sampling_fn(self, *args)

    def mark(self, name: str) -> None:
        """A phase starts: its event index while tracing; a profiler marker in a real run (validate/)."""
        if self.events is not None:
            self.phase_starts.append((name, len(self.events)))
        else:
            with torch.profiler.record_function(f"memest.grpo.{name}"):
                pass

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, **_) -> GRPOOutput:
        _, _, utils = _trl()
        args = config_defaults()
        args.beta = self.beta
        args.max_completion_length = self.completion_len
        # GRPOConfig.__post_init__ (grpo_config.py lines 1096-1112): steps_per_generation = gradient_accumulation_steps
        # unless generation_batch_size is given (then generation_batch_size / (per_device x num_processes)); the
        # generation_batch_size is global: per_device_train_batch_size x num_processes x steps_per_generation
        args.gradient_accumulation_steps = self.accumulation
        args.steps_per_generation = self.steps_per_generation
        args.generation_batch_size = self.batch * world_size() * self.steps_per_generation
        trainer = stand_in_trainer(self.policy, self.reference, args, gloo=self.gloo)
        trainer.use_vllm = self.vllm
        fake = _is_fake(input_ids)
        if self.generate_next:
            self.generate_next, self.micro_step = False, 0
            self.optimizer_step += 1
        step = self.optimizer_step * self.accumulation + self.micro_step  # trl's self._step (num_iterations 1)
        if step % args.steps_per_generation == 0 or self.buffered is None:  # trl _prepare_inputs' generate_every
            if args.steps_per_generation > 1:  # the generation batch: S x per_device_train_batch_size prompts
                input_ids, attention_mask = input_ids.repeat(args.steps_per_generation, 1), attention_mask.repeat(
                    args.steps_per_generation, 1)
            scalars = _fixed_length_generation(self.completion_len) if fake else contextlib.nullcontext()
            self.mark(OLD_LOGPS if self.vllm else PHASES[0])
            with scalars:
                batch = self._rollout(input_ids, attention_mask, args, trainer, utils)
            del input_ids, attention_mask
            # the previous buffer is released only now, when the new one replaces it
            self.buffered = utils.split_tensor_dict(batch, args.steps_per_generation)
            del batch
        inputs = self.buffered[step % args.steps_per_generation]
        self.micro_step += 1
        self.mark(PHASES[2])
        with _placeholders() if fake else contextlib.nullcontext():
            loss = trainer._compute_loss(self.policy, inputs)
        return GRPOOutput(loss=loss)

    def _checkpointing_off(self, model):
        """trl's toggle around generate and the no-grad log-probs: off if on, back on after with
        ``gradient_checkpointing_kwargs`` (trl/models/utils.py)."""
        if self.checkpointing_kwargs is None:
            return contextlib.nullcontext()
        from trl.models.utils import disable_gradient_checkpointing

        return disable_gradient_checkpointing(model, self.checkpointing_kwargs)

    def _rollout(self, input_ids, attention_mask, args, trainer, utils) -> dict:
        """trl's _generate_single_turn (regular transformers path) and _generate_and_score_completions."""
        from transformers import GenerationConfig

        config = self.policy.config
        eos = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
        pad_id = config.pad_token_id if config.pad_token_id is not None else eos[0]
        generation_config = GenerationConfig(
            max_new_tokens=self.completion_len, do_sample=True, pad_token_id=pad_id, bos_token_id=config.bos_token_id,
            eos_token_id=eos, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
            repetition_penalty=args.repetition_penalty, cache_implementation=args.cache_implementation,
            disable_compile=True,
            # trl leaves use_cache to the model's generation config: a decoder loaded by from_pretrained has
            # use_cache=True (transformers' default), memest's hf: source builds it False for training
            use_cache=True,
        )
        n, prompt_len = input_ids.shape
        if not self.vllm:
            # unwrap_model_for_generation: checkpointing off (the cache is used), then back on
            with self._checkpointing_off(self.policy), torch.no_grad():
                prompt_completion_ids = self.policy.generate(input_ids=input_ids, attention_mask=attention_mask,
                                                             generation_config=generation_config)
            completion_ids = prompt_completion_ids[:, prompt_len:]
            # Mask everything after the first EOS token (trl, before .tolist())
            is_eos = torch.isin(completion_ids, torch.tensor(eos))
            eos_idx = torch.full((is_eos.size(0),), is_eos.size(1), dtype=torch.long)
            sequence_indices = torch.arange(is_eos.size(1)).expand(is_eos.size(0), -1)
            completion_mask = (sequence_indices <= eos_idx.unsqueeze(1)).int()
            del prompt_completion_ids, completion_ids, is_eos, eos_idx, sequence_indices, completion_mask
        # the lists of token ids become tensors again, padded (trl's pad); every completion is full length
        length = self.completion_len
        prompt_ids = utils.pad([torch.zeros(prompt_len, dtype=torch.long) for _ in range(n)], padding_value=pad_id,
                               padding_side="left")
        prompt_mask = utils.pad([torch.ones(prompt_len, dtype=torch.long) for _ in range(n)], padding_value=0,
                                padding_side="left")
        completion_ids = utils.pad([torch.zeros(length, dtype=torch.long) for _ in range(n)], padding_value=pad_id,
                                   padding_side="right")
        completion_mask = utils.pad([torch.ones(length, dtype=torch.long) for _ in range(n)], padding_value=0,
                                    padding_side="right")
        prompt_completion_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        num_items_in_batch = trainer.accelerator.gather(completion_mask.sum()).sum()
        # trl computes the advantages over every rank's gathered rewards, then keeps this rank's slice (a view of the
        # whole vector, until shuffle_sequence_dict copies it); one process: the (n,) vector itself
        world, index = trainer.accelerator.num_processes, trainer.accelerator.process_index
        advantages = torch.zeros(world * n, dtype=torch.float32)[index * n:(index + 1) * n]
        out = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
               "completion_mask": completion_mask, "num_items_in_batch": num_items_in_batch,
               "advantages": advantages}
        # trl: one torch.no_grad() block with checkpointing off (disable_gradient_checkpointing) for both log-probs
        with torch.no_grad(), self._checkpointing_off(self.policy):
            if self.vllm:
                out.update(self._importance_sampling(prompt_completion_ids, attention_mask, completion_mask, args,
                                                     trainer, utils))
            elif args.gradient_accumulation_steps % args.steps_per_generation:
                # trl: generation misaligned with the optimizer step (gradient_accumulation_steps % generate_every):
                # the policy's no-grad log-probs of the completions, for importance sampling
                self.mark(OLD_LOGPS)
                old, _, _ = trainer._get_per_token_logps_and_entropies(
                    self.policy, prompt_completion_ids, attention_mask, length, batch_size=self.batch)
                out["old_per_token_logps"] = old
            if self.beta != 0.0:
                self.mark(PHASES[1])
                if self.adapter:
                    with utils.use_adapter(self.policy, adapter_name=None):
                        ref, _, _ = trainer._get_per_token_logps_and_entropies(
                            self.policy, prompt_completion_ids, attention_mask, length, batch_size=self.batch)
                else:
                    ref, _, _ = trainer._get_per_token_logps_and_entropies(
                        self.reference, prompt_completion_ids, attention_mask, length, batch_size=self.batch)
                out["ref_per_token_logps"] = ref
        del prompt_completion_ids, attention_mask
        return utils.shuffle_sequence_dict(out)  # the caller splits it into steps_per_generation slices


def _importance_sampling_fn(step, prompt_completion_ids, attention_mask, completion_mask, args, trainer, utils):
    """use_vllm=True (trl _generate_and_score_completions): vLLM's sampling log-probs (float32 lists padded), the
    policy's no-grad log-probs of the completions (old_per_token_logps), and the importance-sampling ratio of
    trl's default mode "sequence_mask" (clip_min None, clip_max 3.0: GRPOConfig). The metrics trl logs from them
    ((batch, completion) temporaries freed at once) are not traced."""
    if args.vllm_importance_sampling_mode != "sequence_mask":  # GRPOConfig's default, the one transcribed
        raise MemestError(f"trl's vllm_importance_sampling_mode {args.vllm_importance_sampling_mode!r} is not traced")
    n, length = completion_mask.shape
    sampling = utils.pad([torch.zeros(length, dtype=torch.float32) for _ in range(n)], padding_value=0.0,
                         padding_side="right")
    with torch.no_grad():
        old, _, _ = trainer._get_per_token_logps_and_entropies(step.policy, prompt_completion_ids, attention_mask,
                                                               length, batch_size=step.batch)
        diff = (old - sampling) * completion_mask
        diff = torch.nan_to_num(diff, nan=0.0)
        diff = diff.sum(dim=-1, keepdim=True)
        ratio = torch.exp(diff)
        low = args.vllm_importance_sampling_clip_min
        high = args.vllm_importance_sampling_clip_max
        invalid = (ratio < (low if low is not None else -math.inf)) | (ratio > (high if high is not None else math.inf))
        ratio = ratio.masked_fill(invalid, value=0.0)
    return {"old_per_token_logps": old, "importance_sampling_ratio": ratio, "sampling_per_token_logps": sampling}


@contextlib.contextmanager
def _placeholders():
    """trl's _compute_loss under fake tensors: its metrics' ``.item()`` reads get placeholders, and its ``nanmin`` /
    ``nanmax`` (``tensor[~torch.isnan(tensor)]``, a data-dependent size) keep every element, as a real run with no
    NaN does: the same isnan, ~, nonzero index ``(n, 1)`` int64 and ``(n,)`` copy, then the reduction."""
    grpo_trainer, _, _ = _trl()

    def kept(tensor):
        torch.isnan(tensor).all()
        mask = ~torch.isnan(tensor)
        index = torch.empty((tensor.numel(), 1), dtype=torch.long)  # nonzero(mask)
        values = torch.empty_like(tensor)  # tensor[index]
        del mask, index
        return values

    current = grpo_trainer.nanmin, grpo_trainer.nanmax
    grpo_trainer.nanmin = lambda tensor: torch.min(kept(tensor))
    grpo_trainer.nanmax = lambda tensor: torch.max(kept(tensor))
    try:
        with PlaceholderScalars():
            yield
    finally:
        grpo_trainer.nanmin, grpo_trainer.nanmax = current


def wrap(policy: torch.nn.Module, spec) -> GRPOStep:
    """GRPOTrainer.__init__'s models: trl's fused head on the policy (its peft base) and on a reference copy."""
    args = config_defaults()
    kind = reference_of(spec)
    peft = hasattr(policy, "get_base_model")
    head = {"temperature": args.temperature, "cast_lm_head_to_fp32": args.cast_lm_head_to_fp32}
    reference = frozen_copy(policy, **head) if kind == Reference.COPY else None
    if spec.quant != Quant.NONE:
        adapters_to_bf16(policy)
    add_fused_lm_head(policy.get_base_model() if peft else policy, outputs=("log_probs", "entropy"), **head)
    beta = 0.0 if kind is None else _nonzero_beta()
    step = GRPOStep(policy, reference, adapter=kind == Reference.ADAPTER, beta=beta,
                    completion_len=completion_len_of(spec), batch=spec.batch, vllm=spec.rollout == Rollout.VLLM,
                    accumulation=spec.grad_accum, checkpointing_kwargs=checkpointing_kwargs(policy, reference, spec),
                    steps_per_generation=steps_per_generation_of(spec))
    step.gloo = spec.target == Target.CPU  # accelerate's gathers: gloo on CPU, NCCL on CUDA
    return step


def adapters_to_bf16(policy) -> None:
    """GRPOTrainer.__init__ over a quantized base (``is_loaded_in_4bit`` / ``8bit``, trl 1.16.0 grpo_trainer.py):
    "the PEFT adapter weights are converted to bf16" (QLoRA paper, section 3), every trainable parameter but a DoRA
    magnitude vector, whatever peft's autocast_adapter_dtype made them; its optimizer state follows them."""
    for name, param in policy.named_parameters():
        if param.requires_grad and "lora_magnitude_vector" not in name:
            param.data = param.data.to(torch.bfloat16)


def checkpointing_kwargs(policy, reference, spec) -> dict | None:
    """trl's ``gradient_checkpointing_kwargs`` for --checkpointing blocks / blocks-reentrant (None: no checkpointing).
    The layers must be under transformers' switch (features/checkpointing.py), the one trl turns off and on; a
    reference copy made after it is switched off, as trl's reference (``create_model_from_path``) never has it."""
    policy_kind = CheckpointPolicy.of(spec.checkpointing)
    if policy_kind is CheckpointPolicy.NONE:
        return None
    if not getattr(policy, "is_activation_checkpointing", False):
        raise MemestError("--preference grpo with --checkpointing: the policy's layers are not under transformers' "
                          "gradient checkpointing switch, the one trl's GRPOTrainer turns off around generate")
    if reference is not None:
        reference.activation_checkpointing_disable()
    return {"use_reentrant": policy_kind is CheckpointPolicy.BLOCKS_REENTRANT}


def _nonzero_beta() -> float:
    """A beta != 0 for --reference copy / adapter: the value DeepSeek-R1 used, which GRPOConfig's help names
    (0.001); memory does not depend on it."""
    return 0.001


def phase_peaks(trace, starts: list[tuple[str, int]], iterations: int | None = None) -> dict[str, int]:
    """Each phase's peak live bytes in the last traced iteration that generates (the steady state: optimizer state
    held); a phase run once per micro-step (the training step) peaks at the highest of them. ``iterations``: the
    steps traced, where a step may generate more than once (--generation-batch = --batch: every micro-step) or not
    at all (a generation batch of several optimizer steps)."""
    timeline = trace.timeline()
    if not starts or not timeline:
        return {}
    per_iteration = sum(1 for name, _ in starts if name == starts[0][0])  # each iteration starts with the same phase
    if iterations:
        per_iteration = min(per_iteration, iterations)
    last = starts[-(len(starts) // max(per_iteration, 1)):]
    peaks = {}
    for k, (name, begin) in enumerate(last):
        end = last[k + 1][1] if k + 1 < len(last) else len(timeline)
        window = timeline[max(begin - 1, 0):end] if begin < len(timeline) else timeline[-1:]
        peaks[name] = max(peaks.get(name, 0), max(window))  # each micro-step's training step: the highest
    return peaks


def describe(spec) -> str:
    """One line for the report: the step traced."""
    kind = reference_of(spec)
    ref = {None: "none (trl's default beta 0.0)", Reference.COPY: "a second frozen copy of the policy (beta != 0)",
           Reference.ADAPTER: "the policy's base with the LoRA adapter disabled (beta != 0)"}[kind]
    g = generations_of(spec)
    if spec.rollout == Rollout.VLLM:
        how = ("generated by a vLLM engine (use_vllm=True: its memory is not this trace's; --colocate-serve prices a "
               "colocated one), then the policy's no-grad log-probs for vLLM's importance sampling (sequence_mask)")
    else:
        how = "generated by transformers' generate (use_vllm=False, DynamicCache)"
    k, s = spec.grad_accum, steps_per_generation_of(spec)
    accumulation = (f"; --grad-accum {k}: one generation of {k} x {spec.batch} completions per optimizer step, "
                    f"buffered (trl steps_per_generation {k}) and held through the {k} micro-steps"
                    if k > 1 and s == k else "")
    if s != k:
        accumulation = (f"; --generation-batch {spec.generation_batch} (trl generation_batch_size), over "
                        f"{spec.world_size} rank(s): one generation of {s} x {spec.batch} completions per rank every {s} micro-steps (trl steps_per_generation {s}, --grad-accum "
                        f"{k}), buffered and held until the next generation replaces it"
                        + (", with the policy's no-grad old log-probs (generation misaligned with the optimizer step)"
                           if k % s and spec.rollout != Rollout.VLLM else ""))
    if CheckpointPolicy.of(spec.checkpointing) is CheckpointPolicy.NONE:
        checkpointing = ("; no gradient checkpointing (trl's default gradient_checkpointing=True: add --checkpointing "
                         "blocks to price it)")
    else:
        checkpointing = ("; gradient checkpointing on the policy's layers, turned off by trl around generate (which "
                         "keeps its KV cache) and the no-grad log-probs")
    if spec.quant != Quant.NONE:
        checkpointing += "; the adapters cast to bf16, as GRPOTrainer.__init__ does over a quantized base"
    if spec.outputs == Outputs.KEPT:
        checkpointing += ("; --outputs kept (memest's default loop) holds the last step's output into the next "
                          "generation, where trl's Trainer drops it (training_step returns loss.detach()): add "
                          "--outputs freed for trl's loop")
    return (f"--preference grpo: trl GRPOTrainer's step ({TRL_SOURCE}): {spec.batch} completions "
            f"({spec.batch // g} prompts x {g} generations) of {spec.seq} prompt + {completion_len_of(spec)} "
            f"completion tokens, {how}, reference: {ref}, loss by trl's _compute_loss{accumulation}{checkpointing}")


class GRPOFeature(StepFeature):
    """--preference grpo: the model becomes the GRPO step; the inputs are the prompts (x generations)."""

    name = "grpo"

    def __init__(self, spec):
        self.step_module: GRPOStep | None = None

    def build(self, built, spec) -> None:
        built.model = self.step_module = wrap(built.model, spec)
        built.notes.append(describe(spec))

    def inputs(self, inputs, spec):
        ids = inputs.get("input_ids") if isinstance(inputs, dict) else None
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
            raise MemestError("--preference grpo needs a causal LM's input_ids (hf: models): the source has none")
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids, dtype=torch.long)}

    def loop(self, model, spec) -> contextlib.AbstractContextManager:
        """Each optimizer step (its K micro-steps) begins: the step counts trl's ``self._step`` from it and generates
        where ``_step % steps_per_generation == 0``. Found in ``model`` since real runs (validate/) call with new
        feature objects."""
        found = model if isinstance(model, GRPOStep) else next(
            (m for m in model.modules() if isinstance(m, GRPOStep)), None)
        if found is not None:
            found.generate_next = True
        return contextlib.nullcontext()

    def contexts(self, step) -> list[contextlib.AbstractContextManager]:
        if self.step_module is not None:
            self.step_module.events = step.trace.events
        return [no_padding()]

    def finish(self, step) -> list[str]:
        if self.step_module is None:
            return []
        peaks = phase_peaks(step.trace, self.step_module.phase_starts, step.spec.iterations)
        if not peaks:
            return []
        top = max(peaks, key=peaks.get)
        parts = ", ".join(f"{name} {format_bytes(peaks[name])} ({peaks[name]:,} B)" for name in peaks)
        return [f"GRPO phases' peaks (last iteration, traced): {parts}; the {top} phase peaks"]

"""The command line: declarations and calls. Each command parses, calls the app layer (app.py), and
hands the result's View to the one emit path; ``_run`` maps every error to its exit code."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from memest.errors import EXIT_DOES_NOT_FIT, EXIT_OK
from memest.exits import OneLineErrors, output_format, run_command
from memest.spec.choices import (
    Attention,
    Cache,
    CpRotate,
    CudaGraphs,
    DataDependent,
    Engine,
    KvDtype,
    Mode,
    Offload,
    Optimizer,
    OutputFormat,
    Outputs,
    PipelineSchedule,
    Precision,
    Quant,
    Shard,
    Target,
    ZeroGrad,
)

app = typer.Typer(
    name="memest", cls=OneLineErrors,
    help="How much GPU memory will this PyTorch training step need? Traced on fake tensors, no GPU touched.",
    no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
)

Model = Annotated[str, typer.Argument(help="model.py[:factory], hf:NAME (bundled config) or hf:path/config.json")]
Batch = Annotated[int, typer.Option("--batch", "-b", help="Batch size (per step).")]
Seq = Annotated[Optional[int], typer.Option("--seq", "-s", help="Sequence length (default: the model's own).")]
Optim = Annotated[Optimizer, typer.Option("--optim", help="adam/adamw: 2 fp32 states; sgd-momentum: 1; sgd: none; "
                                          "adafactor: factored; adam8bit: bitsandbytes 8-bit state.")]
Prec = Annotated[Precision, typer.Option("--precision", help="Weights' dtype, or -mixed: fp32 weights + autocast.")]
Tgt = Annotated[Target, typer.Option("--target", help="cuda: what a CUDA run allocates; cpu: CPU training.")]
Gpu = Annotated[Optional[str], typer.Option(
    "--gpu", help="Budget (11GB = 10^9 B, 11GiB = 2^30 B), card (rtx2080ti, a100) or device index (0).")]
Attn = Annotated[Attention, typer.Option("--attention", help="--target cuda SDPA kernel (auto: PyTorch's rules).")]
Fused = Annotated[bool, typer.Option("--fused", help="--target cuda: fused optimizer kernels instead of foreach.")]
Bench = Annotated[bool, typer.Option("--cudnn-benchmark", help="--target cuda: the run sets torch.backends.cudnn."
                                     "benchmark = True (cuDNN's algorithm search: see docs/cuda-kernels.md).")]
Accum = Annotated[int, typer.Option("--grad-accum", help="Micro-steps per optimizer step (--batch is the micro-batch).")]
Ckpt = Annotated[str, typer.Option("--checkpointing", help="none | blocks | every:N | module.name,other.name")]
Outs = Annotated[Outputs, typer.Option(
    "--outputs", help="Your loop: kept (out = model(x) held through backward, the plain loop) | freed (dropped "
    "before backward: HF Trainer, Lightning).")]
LossHd = Annotated[str, typer.Option(
    "--loss-head", help="hf: causal LMs: standard | chunked[:N] (torchtune, N chunks) | fused (Liger-Kernel).")]
Lora = Annotated[str, typer.Option(
    "--lora", help="peft LoRA: r=16,alpha=32,dropout=0.05,targets=q_proj,v_proj (or targets=all-linear; needs "
    "memest[peft]).")]
Freeze = Annotated[str, typer.Option("--freeze", help="Freeze parameters by name: glob patterns, comma-separated "
                                     "(model.embed_tokens,model.layers.[0-9].*).")]
QuantOpt = Annotated[Quant, typer.Option("--quant", help="With --lora (QLoRA): base linear weights as bitsandbytes "
                                         "stores them: nf4 | fp4 | int8 (none: as built).")]
DoubleQuant = Annotated[bool, typer.Option("--double-quant/--no-double-quant",
                                           help="--quant: bitsandbytes' double quantization of the absmax.")]
PrepKbit = Annotated[bool, typer.Option(
    "--prepare-kbit", help="--quant: peft's prepare_model_for_kbit_training (trl's SFTTrainer calls it): the "
    "non-quantized 16-bit weights cast to fp32.")]
Comp = Annotated[Optional[bool], typer.Option(
    "--compile/--no-compile", help="torch.compile the step as torch.compile(model) does (Inductor) / trace a model "
    "file that compiles itself eager; default: as the model code does.")]
DataDep = Annotated[DataDependent, typer.Option(
    "--data-dependent", help="Ops whose output size depends on values: refuse (an error naming the bound) | "
    "upper-bound (nonzero, x[mask], masked_select, unique traced at their bound: the estimate is an upper bound).")]
Fmt = Annotated[OutputFormat, typer.Option("--format", "-f", help="table | markdown | json (one document on stdout).")]
Json = Annotated[bool, typer.Option("--json", help="Same as --format json.")]
Markdown = Annotated[bool, typer.Option("--markdown", help="Same as --format markdown.")]
Debug = Annotated[bool, typer.Option("--debug", help="Also print tracebacks (exit codes stay the same).")]
Budget = Annotated[str, typer.Option("--gpu", help="Budget (24GB, 24GiB), card name or device index.")]
Calibration = Annotated[Optional[str], typer.Option(
    "--calibration", help="A profile from `memest calibrate --out FILE`: its measured costs replace the defaults.")]
Strict = Annotated[bool, typer.Option(
    "--strict", help="A tight verdict (expected fits, the high end of the range does not) counts as not fitting.")]


# The options of the traced step that estimate, whatif, max-batch and advise share; each is the RunSpec field
# of the same name (spec.py), so a command's spec is these values plus its own (``_spec``).
STEP_OPTIONS = ("model", "optim", "precision", "target", "grad_accum", "checkpointing", "outputs", "loss_head", "lora",
                "freeze", "quant", "double_quant", "prepare_kbit", "compile", "data_dependent")


def _spec(options: dict, *own: str) -> dict:
    """The RunSpec fields from a command's parsed options (its ``locals()``): the shared step options + its own."""
    return {name: options[name] for name in (*STEP_OPTIONS, *own)}


def _progress(on: bool = True):
    from memest.app import stderr_progress

    return stderr_progress if on else None


@app.command()
def estimate(
    model: Model, batch: Batch = 1, seq: Seq = None, optim: Optim = Optimizer.ADAM, precision: Prec = Precision.FP32,
    target: Tgt = Target.CUDA, attention: Attn = Attention.AUTO, fused: Fused = False, grad_accum: Accum = 1,
    checkpointing: Ckpt = "none", cudnn_benchmark: Bench = False, outputs: Outs = Outputs.KEPT,
    loss_head: LossHd = "standard", lora: Lora = "", freeze: Freeze = "", quant: QuantOpt = Quant.NONE,
    double_quant: DoubleQuant = True, prepare_kbit: PrepKbit = False, compile: Comp = None,
    data_dependent: DataDep = DataDependent.REFUSE,
    zero_grad: Annotated[ZeroGrad, typer.Option("--zero-grad", help="After the step: none (set to None) | zeros.")]
    = ZeroGrad.NONE,
    mode: Annotated[Mode, typer.Option("--mode", help="train | inference | generate (decoders, KV cache).")] = Mode.TRAIN,
    new_tokens: Annotated[int, typer.Option("--new-tokens", help="--mode generate: tokens after a --seq prompt.")] = 0,
    cache: Annotated[Cache, typer.Option("--cache", help="--mode generate: dynamic | static KV cache.")] = Cache.DYNAMIC,
    world_size: Annotated[int, typer.Option("--world-size", help="Data-parallel ranks (estimates are per rank).")] = 1,
    shard: Annotated[Shard, typer.Option("--shard", help="none | zero1 | zero2 | zero3 (FSDP full shard).")] = Shard.NONE,
    offload: Annotated[Offload, typer.Option("--offload", help="none | optimizer | params (params: --shard zero3).")]
    = Offload.NONE,
    tp: Annotated[int, typer.Option("--tp", help="Tensor-parallel ranks (--world-size = dp x tp).")] = 1,
    sp: Annotated[bool, typer.Option("--sp", help="Sequence parallel with --tp (torchtitan's plan).")] = False,
    pp: Annotated[int, typer.Option("--pp", help="Pipeline ranks (--world-size = pp x dp x tp); every one is "
                                    "reported.")] = 1,
    ep: Annotated[int, typer.Option("--ep", help="Expert-parallel ranks for MoE models (experts over ep of the "
                                    "--world-size data-parallel ranks; with --shard zero3|zero2).")] = 1,
    cp: Annotated[int, typer.Option("--cp", help="Context-parallel ranks (--world-size = dp x cp, x tp with --tp; torch's ring "
                                    "attention, hf: decoders on SDPA, with --shard zero3|zero2); every one is "
                                    "reported.")] = 1,
    cp_rotate: Annotated[CpRotate, typer.Option("--cp-rotate", help="--cp: allgather | alltoall (torch's "
                                                "set_rotate_method).")] = CpRotate.ALLGATHER,
    pp_schedule: Annotated[PipelineSchedule, typer.Option("--pp-schedule", help="1f1b | gpipe | interleaved | looped-bfs "
                                                          "(torch.distributed.pipelining's schedules).")]
    = PipelineSchedule.ONE_F_ONE_B,
    pp_virtual: Annotated[int, typer.Option("--pp-virtual", help="--pp: stages per rank of interleaved and "
                                            "looped-bfs (default 2).")] = 0,
    microbatches: Annotated[int, typer.Option("--microbatches", help="--pp: micro-batches of --batch per step "
                                              "(default: --pp).")] = 0,
    pp_split: Annotated[str, typer.Option("--pp-split", help="--pp: layers per stage, e.g. 3,3,2 (default even).")]
    = "",
    gpu: Gpu = None,
    depth: Annotated[int, typer.Option("--depth", help="Module-tree depth shown in the table.")] = 3,
    expand: Annotated[bool, typer.Option("--expand", help="Show every repeated block instead of one row per run.")]
    = False,
    plot: Annotated[Optional[str], typer.Option("--plot", help="Write memory over the step to FILE.png/.svg/.html.")]
    = None,
    fail_if_not_fits: Annotated[bool, typer.Option("--fail-if-not-fits", help="Exit 1 when it does not fit (CI).")]
    = False,
    strict: Strict = False, calibration: Calibration = None,
    colocate_serve: Annotated[Optional[float], typer.Option(
        "--colocate-serve", help="A vLLM rollout engine at this gpu_memory_utilization shares the GPU, as in trl's "
        "GRPO colocate mode (trl's default: 0.3); needs --gpu.")] = None,
    format: Fmt = OutputFormat.TABLE, json: Json = False, markdown: Markdown = False, debug: Debug = False,
) -> None:
    """Trace two training steps on fake tensors; print memory per layer, the peak and whether it fits."""
    spec = _spec(locals(), "batch", "seq", "attention", "fused", "zero_grad", "mode", "new_tokens", "cache", "world_size",
                 "shard", "offload", "cudnn_benchmark", "tp", "sp", "pp", "ep", "cp", "cp_rotate", "pp_schedule",
                 "pp_virtual", "microbatches", "pp_split")

    def work():
        from memest.app import run_estimate
        from memest.report.views import estimate_view

        fmt = output_format(format, json, markdown)
        result = run_estimate(spec, gpu, fail_if_not_fits=fail_if_not_fits, plot=plot,
                              timeline=fmt == OutputFormat.TABLE, progress=_progress(), calibration=calibration,
                              colocate=None if colocate_serve is None else {"utilization": colocate_serve})
        if result.plot_path is not None:
            typer.echo(f"memest: wrote {result.plot_path}", err=True)
        code = EXIT_DOES_NOT_FIT if fail_if_not_fits and result.passes(strict) is False else EXIT_OK
        return estimate_view(result, depth, expand), code

    run_command(work, lambda: output_format(format, json, markdown), debug)


@app.command()
def check(
    configs: Annotated[list[str], typer.Argument(help="YAML run configs (see configs/ and README).")],
    gpu: Gpu = None,
    margin: Annotated[Optional[str], typer.Option("--margin", help="Headroom: 10% (or 0.1): needed x 1.1 must fit.")]
    = None,
    batch: Annotated[Optional[int], typer.Option("--batch", "-b", help="Override every config's batch.")] = None,
    seq: Annotated[Optional[int], typer.Option("--seq", "-s", help="Override every config's seq.")] = None,
    optim: Annotated[Optional[Optimizer], typer.Option("--optim", help="Override the optimizer.")] = None,
    precision: Annotated[Optional[Precision], typer.Option("--precision", help="Override the precision.")] = None,
    grad_accum: Annotated[Optional[int], typer.Option("--grad-accum", help="Override accumulation steps.")] = None,
    checkpointing: Annotated[Optional[str], typer.Option("--checkpointing", help="Override checkpointing.")] = None,
    strict: Strict = False, calibration: Calibration = None,
    cudnn_benchmark: Annotated[Optional[bool], typer.Option(
        "--cudnn-benchmark/--no-cudnn-benchmark", help="Override cuDNN's benchmark mode.")] = None,
    outputs: Annotated[Optional[Outputs], typer.Option("--outputs", help="Override the loop: kept | freed.")] = None,
    loss_head: Annotated[Optional[str], typer.Option("--loss-head", help="Override the loss head.")] = None,
    lora: Annotated[Optional[str], typer.Option("--lora", help="Override LoRA (none: off).")] = None,
    quant: Annotated[Optional[Quant], typer.Option("--quant", help="Override the base quantization.")] = None,
    compile: Comp = None,
    data_dependent: Annotated[Optional[DataDependent], typer.Option(
        "--data-dependent", help="Override: refuse | upper-bound (size-bounded data-dependent ops at their bound).")]
    = None,
    format: Fmt = OutputFormat.TABLE, json: Json = False, markdown: Markdown = False, debug: Debug = False,
) -> None:
    """CI gate: exit 0 when every config fits its GPU or budget (tight counts as fitting unless --strict),
    1 when any does not, 2 for a bad config."""
    overrides = dict(batch=batch, seq=seq, optim=optim, precision=precision, grad_accum=grad_accum,
                     checkpointing=checkpointing, cudnn_benchmark=cudnn_benchmark, outputs=outputs,
                     loss_head=loss_head, lora=lora, quant=quant, compile=compile,
                     data_dependent=data_dependent)

    def work():
        from memest.app import run_check
        from memest.report.views import check_view

        result = run_check(configs, overrides, gpu, margin, progress=_progress(), strict=strict, calibration=calibration)
        if result.tight and not strict:
            typer.echo(f"memest: warning: TIGHT ({', '.join(r.name for r in result.tight)}): counted as fitting; "
                       "--strict counts tight as not fitting", err=True)
        return check_view(result), EXIT_OK if result.fits else EXIT_DOES_NOT_FIT

    run_command(work, lambda: output_format(format, json, markdown), debug)


def _sizes(text: Optional[str], flag: str):
    from memest.plan.whatif import parse_sizes

    return parse_sizes(text, flag)


@app.command()
def whatif(
    model: Model,
    seq: Annotated[Optional[str], typer.Option("--seq", "-s", help="Sequence lengths, e.g. 256,512,1024.")] = None,
    batch: Annotated[Optional[str], typer.Option("--batch", "-b", help="Batch sizes, e.g. 1,2,4,8.")] = None,
    optim: Optim = Optimizer.ADAM, precision: Prec = Precision.FP32, target: Tgt = Target.CUDA, grad_accum: Accum = 1,
    checkpointing: Ckpt = "none", outputs: Outs = Outputs.KEPT, loss_head: LossHd = "standard", gpu: Gpu = None,
    calibration: Calibration = None,
    lora: Lora = "", freeze: Freeze = "", quant: QuantOpt = Quant.NONE, double_quant: DoubleQuant = True, prepare_kbit: PrepKbit = False,
    compile: Comp = None, data_dependent: DataDep = DataDependent.REFUSE,
    format: Fmt = OutputFormat.TABLE, json: Json = False, markdown: Markdown = False, debug: Debug = False,
) -> None:
    """Peaks and needed memory over a grid of sequence lengths and batch sizes, the fitted scaling, and
    the largest seq and batch that fit."""
    spec = _spec(locals())

    def work():
        from memest.app import run_whatif
        from memest.report.views import whatif_view

        run = run_whatif(spec, _sizes(batch, "--batch"), _sizes(seq, "--seq"), gpu, progress=_progress(),
                         calibration=calibration)
        return whatif_view(run), EXIT_OK

    run_command(work, lambda: output_format(format, json, markdown), debug)


@app.command("max-batch")
def max_batch(
    model: Model, gpu: Budget, seq: Seq = None,
    batch: Annotated[int, typer.Option("--batch", "-b", help="Batch when searching the sequence length.")] = 1,
    seq_search: Annotated[bool, typer.Option("--seq-search", help="Search the longest sequence instead.")] = False,
    optim: Optim = Optimizer.ADAM, precision: Prec = Precision.FP32, target: Tgt = Target.CUDA, grad_accum: Accum = 1,
    checkpointing: Ckpt = "none", outputs: Outs = Outputs.KEPT, loss_head: LossHd = "standard",
    limit: Annotated[int, typer.Option("--limit", help="Largest size tried.")] = 65536, calibration: Calibration = None,
    lora: Lora = "", freeze: Freeze = "", quant: QuantOpt = Quant.NONE, double_quant: DoubleQuant = True, prepare_kbit: PrepKbit = False,
    compile: Comp = None, data_dependent: DataDep = DataDependent.REFUSE,
    format: Fmt = OutputFormat.TABLE, json: Json = False, markdown: Markdown = False, debug: Debug = False,
) -> None:
    """The largest batch (or, with --seq-search, sequence length) that fits, found by search over traces;
    exact at the boundary."""
    spec = _spec(locals(), "batch", "seq")

    def work():
        from memest.app import run_max_batch
        from memest.report.views import max_batch_view

        run = run_max_batch(spec, gpu, seq_search, limit, progress=_progress(), calibration=calibration)
        return max_batch_view(run), EXIT_OK

    run_command(work, lambda: output_format(format, json, markdown), debug)


@app.command()
def advise(
    model: Model, gpu: Budget, batch: Batch = 1, seq: Seq = None, optim: Optim = Optimizer.ADAM,
    precision: Prec = Precision.FP32, target: Tgt = Target.CUDA, grad_accum: Accum = 1, checkpointing: Ckpt = "none",
    outputs: Outs = Outputs.KEPT, loss_head: LossHd = "standard", calibration: Calibration = None,
    lora: Lora = "", freeze: Freeze = "", quant: QuantOpt = Quant.NONE, double_quant: DoubleQuant = True, prepare_kbit: PrepKbit = False,
    compile: Comp = None, data_dependent: DataDep = DataDependent.REFUSE,
    gpus: Annotated[Optional[int], typer.Option(
        "--gpus", help="Also lay the model out on this many GPUs (plan-parallel's layouts; hf: models).")] = None,
    format: Fmt = OutputFormat.TABLE, json: Json = False, markdown: Markdown = False, debug: Debug = False,
) -> None:
    """Memory savers re-traced against a budget, ranked by time cost, and the cheapest combination that
    fits, with its command line."""
    spec = _spec(locals(), "batch", "seq")

    def work():
        from memest.app import run_advise
        from memest.report.views import advise_view

        return advise_view(run_advise(spec, gpu, progress=_progress(), calibration=calibration, gpus=gpus)), EXIT_OK

    run_command(work, lambda: output_format(format, json, markdown), debug)


@app.command()
def serve(
    model: Annotated[str, typer.Argument(help="hf:NAME, hf:path/config.json or hf:org/name (a decoder LM config)")],
    gpu: Budget,
    max_model_len: Annotated[Optional[int], typer.Option("--max-model-len", help="Tokens per sequence (default: the "
                                                          "model's positions).")] = None,
    utilization: Annotated[Optional[float], typer.Option(
        "--gpu-memory-utilization", help="vLLM's share of the GPU (default 0.9); SGLang: mem_fraction_static.")] = None,
    tp: Annotated[int, typer.Option("--tp", help="Tensor-parallel GPUs (figures are per GPU).")] = 1,
    kv_dtype: Annotated[KvDtype, typer.Option("--kv-dtype", help="auto (model dtype) | fp8.")] = KvDtype.AUTO,
    block_size: Annotated[int, typer.Option("--block-size", help="Tokens per KV block (vLLM default 16).")] = 16,
    max_num_seqs: Annotated[Optional[int], typer.Option("--max-num-seqs", help="Default: vLLM's for the GPU.")] = None,
    max_num_batched_tokens: Annotated[Optional[int], typer.Option(
        "--max-num-batched-tokens", help="Tokens of the profile forward (default: vLLM's for the GPU).")] = None,
    engine: Annotated[Engine, typer.Option("--engine", help="vllm | sglang (mem_fraction_static arithmetic).")]
    = Engine.VLLM,
    cuda_graphs: Annotated[CudaGraphs, typer.Option(
        "--cuda-graphs", help="profiled (vLLM >= 0.21 subtracts them) | after (older vLLM) | none (--enforce-eager).")]
    = CudaGraphs.PROFILED,
    non_torch_memory: Annotated[Optional[float], typer.Option(
        "--non-torch-memory", help="Measured non-torch memory in GiB (your vLLM log's 'non_torch_memory' / 'non-torch' "
        "figure): replaces the evidence range.")] = None,
    calibration: Calibration = None,
    fail_if_not_starts: Annotated[bool, typer.Option(
        "--fail-if-not-starts", help="Exit 1 unless it surely starts (may not start or will not start).")] = False,
    format: Fmt = OutputFormat.TABLE, json: Json = False, markdown: Markdown = False, debug: Debug = False,
) -> None:
    """Serving capacity: the engine's start-up arithmetic (vLLM or SGLang), KV tokens and blocks, how many
    sequences fit at --max-model-len, the longest context, and whether it starts (with fixes)."""
    def work():
        from memest.app import run_serve
        from memest.report.views import serve_view

        args = dict(model=model, max_model_len=max_model_len, utilization=utilization, tp=tp, kv_dtype=str(kv_dtype),
                    block_size=block_size, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                    engine=str(engine), cuda_graphs=str(cuda_graphs), non_torch_memory=non_torch_memory)
        run = run_serve(args, gpu, progress=_progress(), calibration=calibration)
        code = EXIT_DOES_NOT_FIT if fail_if_not_starts and not run.plan.starts else EXIT_OK
        return serve_view(run), code

    run_command(work, lambda: output_format(format, json, markdown), debug)


@app.command("plan-parallel")
def plan_parallel(
    model: Model, gpu: Budget,
    gpus: Annotated[int, typer.Option("--gpus", help="How many GPUs to lay the model out on.")] = 8,
    batch: Batch = 1, seq: Seq = None, optim: Optim = Optimizer.ADAM, precision: Prec = Precision.FP32,
    target: Tgt = Target.CUDA, checkpointing: Ckpt = "none", outputs: Outs = Outputs.KEPT,
    calibration: Calibration = None,
    top: Annotated[int, typer.Option("--top", help="Stop once this many layouts fit, searched least communication first "
                                     "(0: trace every layout).")] = 1,
    format: Fmt = OutputFormat.TABLE, json: Json = False, markdown: Markdown = False, debug: Debug = False,
) -> None:
    """dp x tp (x pp) layouts of --gpus GPUs: each rank's need, those that fit ranked by communication per step."""
    def work():
        from memest.app import run_plan_parallel
        from memest.report.views import plan_parallel_view

        spec = dict(model=model, batch=batch, seq=seq, optim=optim, precision=precision, target=target,
                    checkpointing=checkpointing, outputs=outputs)
        return plan_parallel_view(run_plan_parallel(spec, gpus, gpu, progress=_progress(), calibration=calibration,
                                                     top=top)), EXIT_OK

    run_command(work, lambda: output_format(format, json, markdown), debug)


@app.command()
def gpus(format: Fmt = OutputFormat.TABLE, json: Json = False, markdown: Markdown = False, debug: Debug = False) -> None:
    """Live table of NVIDIA GPUs and their processes (NVML)."""
    def work():
        from memest.app import run_gpus
        from memest.report.views import gpus_view

        return gpus_view(run_gpus()), EXIT_OK

    run_command(work, lambda: output_format(format, json, markdown), debug)


@app.command()
def calibrate(
    device: Annotated[int, typer.Option("--device", help="NVML/CUDA index of the GPU to measure.")] = 0,
    out: Annotated[Optional[str], typer.Option("--out", help="Also write a portable profile to FILE (for "
                                               "--calibration FILE on machines without this GPU).")] = None,
    nccl: Annotated[bool, typer.Option("--nccl/--no-nccl", help="Also measure NCCL (a world of one).")] = True,
    format: Fmt = OutputFormat.TABLE, json: Json = False, debug: Debug = False,
) -> None:
    """Measure this GPU's CUDA context, libraries (cuBLAS, cuDNN, NCCL) and cuBLAS workspace once (this
    command does use the GPU, briefly, ~1 GiB); later estimates on the same GPU, driver and torch version
    use the measurements, and --out FILE makes them portable."""
    def work():
        from memest.app import run_calibrate
        from memest.report.views import calibrate_view

        return calibrate_view(run_calibrate(device, out, nccl)), EXIT_OK

    run_command(work, lambda: output_format(format, json, False), debug, hide_gpus=False)


def main() -> None:
    app()


if __name__ == "__main__":
    main()

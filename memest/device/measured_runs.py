"""This project's own GPU measurements, as data: the rows the device model's evidence rests on.

Two sources, both measured on one NVIDIA H100 80GB HBM3 (sm90), driver 580.159.04, CUDA 13.0,
cuDNN 9.19, torch 2.11.0+cu130, transformers 5.17.0, on 2026-11-22:

  PROBE_STAGES    scripts/probe_cuda.py ``overhead`` (benchmarks/gpu-probe.json): NVML used memory of
                  the process and torch's reserved, cumulative by stage of a training process, three
                  fresh processes per loading mode (all three identical; one is stored here).
  VALIDATION_RUNS scripts/validate_gpu.py (benchmarks/gpu-validation.json): 32 real two-step training
                  runs: NVML peak of the process, max_memory_allocated / max_memory_reserved, and
                  memest's allocated / reserved for the same step, re-run with `validate_gpu.py --rescore` after the
                  CUDA kernel audit (2026-11-23, defaults; the real numbers are the measured ones).

  SLACK_RUNS      the same measurement for gpt2-xl with AdamW (foreach), where the replay claims the most
                  reserved over allocated (benchmarks/gpu-slack.json, 2026-11-23, same GPU and stack).

tests/test_device_evidence.py checks these rows against the two JSON files, so they cannot drift from
what was measured; re-measuring means regenerating both.
"""

from __future__ import annotations

from typing import NamedTuple

H100_STACK = "NVIDIA H100 80GB HBM3 (sm90), driver 580.159.04, CUDA 13.0, cuDNN 9.19, torch 2.11.0+cu130"
PROBE_SOURCE = "benchmarks/gpu-probe.json (scripts/probe_cuda.py overhead, 3 fresh processes, 2026-11-22)"
VALIDATION_SOURCE = ("benchmarks/gpu-validation.json and gpu-slack.json (scripts/validate_gpu.py, 34 training runs, "
                     "2026-11-22/23)")

# loading mode -> stage -> (NVML used by the process, torch.cuda.memory_reserved()), cumulative:
# init (torch.empty(1) on cuda), cublas_fp32 (first fp32 GEMM), cublaslt_bf16 (bf16 linear forward and
# backward), cudnn_conv (conv2d forward and backward), sdpa_flash (bf16 flash SDPA forward and backward),
# nccl (init_process_group("nccl") with a world of 1 and one all_reduce).
PROBE_STAGES: dict[str, dict[str, tuple[int, int]]] = {
    "lazy": {
        "init": (545259520, 2097152),
        "cublas_fp32": (765460480, 56623104),
        "cublaslt_bf16": (866123776, 90177536),
        "cudnn_conv": (937426944, 142606336),
        "sdpa_flash": (952107008, 157286400),
        "nccl": (1541406720, 157286400),
    },
    "eager": {
        "init": (1312817152, 2097152),
        "cublas_fp32": (1872756736, 56623104),
        "cublaslt_bf16": (2011168768, 90177536),
        "cudnn_conv": (2285895680, 142606336),
        "sdpa_flash": (2306867200, 157286400),
        "nccl": (2896166912, 157286400),
    },
}


class Run(NamedTuple):
    """One real training run (two steps) and memest's estimate of it."""

    model: str
    batch: int
    seq: int | None
    optim: str
    precision: str
    options: str  # run options beyond the five above ("" when none)
    cudnn: bool  # the step runs cuDNN kernels (convolutions, batch norm, RNN)
    nvml_peak: int  # NVML used memory of the process, peak over the two steps
    allocated: int  # torch.cuda.max_memory_allocated
    reserved: int  # torch.cuda.max_memory_reserved
    memest_allocated: int
    memest_reserved: int

    @property
    def label(self) -> str:
        parts = [self.model, f"b{self.batch}"] + ([f"s{self.seq}"] if self.seq else [])
        return " ".join(parts + [self.optim, self.precision] + ([self.options] if self.options else []))

    @property
    def process_overhead(self) -> int:
        """What the process holds outside the caching allocator: NVML peak - max reserved."""
        return self.nvml_peak - self.reserved


VALIDATION_RUNS: tuple[Run, ...] = (
    Run("examples/cnn.py", 64, None, "sgd-momentum", "fp32", "", True,
        991952896, 158399488, 197132288, 111893504, 115343360),
    Run("examples/cnn.py", 256, None, "sgd-momentum", "fp32", "", True,
        1174405120, 245324800, 379584512, 244276224, 341835776),
    Run("examples/cnn.py", 256, None, "adamw", "bf16-mixed", "", True,
        998244352, 174671360, 203423744, 174671360, 184549376),
    Run("examples/mlp.py", 256, None, "adam", "fp32", "", False,
        1272971264, 489625088, 494927872, 488576512, 492830720),
    Run("examples/transformer.py", 8, 512, "adamw", "fp32", "", False,
        1660944384, 777102336, 882900992, 776057856, 882900992),
    Run("examples/transformer.py", 32, 512, "adamw", "fp32", "", False,
        3953131520, 2637362176, 3175088128, 2636317696, 3172990976),
    Run("examples/transformer.py", 32, 512, "adamw", "bf16-mixed", "", False,
        3833593856, 1974172672, 3038773248, 1973517312, 3036676096),
    Run("examples/transformer_ckpt.py", 32, 512, "adamw", "fp32", "", False,
        2740977664, 1832055808, 1962934272, 1829958656, 1960837120),
    Run("examples/transformer_ckpt.py", 32, 512, "sgd", "bf16-mixed", "", False,
        2904555520, 1513563136, 2109734912, 1511465984, 2107637760),
    Run("hf:gpt2", 4, 512, "adamw", "fp32", "", False,
        6035603456, 4973827072, 5257560064, 4971715584, 5255462912),
    Run("hf:gpt2", 8, 1024, "adamw", "bf16-mixed", "", False,
        15766388736, 13309948416, 14971568128, 13302870528, 14921236480),
    Run("hf:gpt2", 8, 1024, "sgd", "bf16-mixed", "", False,
        14115930112, 12303737344, 13321109504, 12306365440, 13270777856),
    Run("hf:bert-base-uncased", 16, 512, "adamw", "bf16-mixed", "", False,
        8889827328, 7425084416, 8095006720, 7423613952, 8107589632),
    Run("hf:gpt2-medium", 4, 1024, "adamw", "bf16-mixed", "", False,
        17538482176, 16200365056, 16743661568, 16198984704, 16743661568),
    Run("scripts/models/tv_resnet50.py", 64, None, "sgd-momentum", "fp32", "", True,
        7828668416, 5854787072, 7029653504, 5853476352, 6796869632),
    Run("scripts/models/tv_resnet50.py", 64, None, "adamw", "bf16-mixed", "", True,
        4626317312, 3317232128, 3831496704, 3316118016, 3703570432),
    Run("scripts/models/tv_vit_b_16.py", 32, None, "adamw", "bf16-mixed", "", True,
        4687134720, 3561233920, 3892314112, 3498581504, 3695181824),
    Run("hf:gpt2", 8, 1024, "adamw", "fp32", "", False,
        16693329920, 15172606976, 15915286528, 15171570688, 15915286528),
    Run("hf:bert-base-uncased", 32, 512, "adamw", "bf16-mixed", "", False,
        16173236224, 13180787712, 15378415616, 13182884864, 15401484288),
    Run("hf:bert-base-uncased", 16, 512, "adamw", "fp32", "", False,
        11444158464, 9506897408, 10666115072, 9505074688, 10664017920),
    Run("examples/cnn.py", 256, None, "sgd-momentum", "fp32", "cudnn_benchmark=True", True,
        1421869056, 472408064, 624951296, 244276224, 341835776),
    Run("scripts/models/tv_resnet50.py", 64, None, "sgd-momentum", "fp32", "cudnn_benchmark=True", True,
        11985223680, 10918234112, 11186208768, 5853476352, 6796869632),
    Run("scripts/models/tv_resnet50.py", 128, None, "sgd-momentum", "fp32", "", True,
        14478737408, 11395003904, 13679722496, 11393168896, 13241417728),
    Run("scripts/models/tv_resnet50.py", 128, None, "sgd-momentum", "fp32", "cudnn_benchmark=True", True,
        18213765120, 16988112384, 17414750208, 11393168896, 13241417728),
    Run("scripts/models/timm_convnext_tiny.py", 32, None, "adamw", "fp32", "", True,
        5440012288, 3964746752, 4643094528, 3954633728, 4290772992),
    Run("scripts/models/timm_convnext_tiny.py", 64, None, "adamw", "bf16-mixed", "", True,
        5534384128, 4510006272, 4737466368, 4517806080, 4783603712),
    Run("scripts/models/lstm_lm.py", 32, 128, "adam", "fp32", "", True,
        2233466880, 1147958784, 1438646272, 1131181568, 1400897536),
    Run("scripts/models/lstm_lm.py", 64, 128, "adam", "fp32", "", True,
        2982150144, 1866528256, 2187329536, 1832973824, 2199912448),
    Run("hf:tinyllama-1.1b", 4, 1024, "adamw", "bf16-mixed", "", False,
        28886171648, 26695111168, 28091351040, 26695111168, 28076670976),
    Run("hf:tinyllama-1.1b", 8, 1024, "adamw", "bf16-mixed", "", False,
        40760246272, 38054089216, 39965425664, 38054089216, 40219181056),
    Run("hf:llama-3.2-1b", 4, 1024, "adamw", "bf16-mixed", "", False,
        35506880512, 32221629440, 34712059904, 32221629440, 34712059904),
    Run("hf:llama-3.2-1b", 4, 2048, "adamw", "bf16-mixed", "checkpointing=blocks", False,
        38208012288, 29273115648, 37413191680, 29273115648, 37415288832),
)

SLACK_RUNS: tuple[Run, ...] = (
    Run("hf:gpt2-xl", 1, 1024, "adamw", "fp32", "", False,
        41381003264, 31854452224, 40602959872, 31906733568, 40238055424),
    Run("hf:gpt2-xl", 2, 1024, "adamw", "bf16-mixed", "", False,
        43893391360, 37149986816, 43098570752, 37477224448, 44514148352),
)

MEASURED_RUNS: tuple[Run, ...] = VALIDATION_RUNS + SLACK_RUNS  # what the evidence defaults rest on

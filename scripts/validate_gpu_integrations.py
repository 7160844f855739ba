"""GPU check of memest.integrations (issue 25): the three in-loop checks' predicted-vs-measured path on a real GPU.

Each case runs in a fresh process (so the allocator's peaks start clean), trains GPT-2 (its bundled config,
memest/data/models/gpt2.json, random weights) for 3 steps on the GPU, and keeps the record the check itself writes
after step 2 (``Preflight.after_step``: torch.cuda.max_memory_allocated / max_memory_reserved against memest's
prediction, made at train start on fake tensors):

  preflight    a hand-written loop: memest.preflight(model, AdamW, batch) then 3 steps (fp32)
  trainer      transformers' Trainer (bf16, adamw_torch) with memest.integrations.transformers.MemestCallback
  lightning    lightning's Trainer (precision 'bf16-mixed') with memest.integrations.lightning.MemestCallback

    python scripts/validate_gpu_integrations.py --out "$OUT/integrations.json"      # on the device machine
    python scripts/validate_gpu_integrations.py --dry-run-cpu --batch 1 --seq 64     # here: the code paths, no GPU

Writes one JSON file: the GPU name, driver, CUDA/torch/transformers versions and one record per case (or the
error it hit). Needs a CUDA GPU: without one each case says so and records nothing (memest never reads a GPU
figure it did not measure).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CASES = ("preflight", "trainer", "lightning")
DEVICE = "cuda"  # --dry-run-cpu: "cpu", to check this script's code paths where there is no GPU (records nothing)
STEPS = 3  # after_step reads the peaks after step 2 (memest/integrations/check.py MEASURE_AFTER_STEP)


def _gpt2(device):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(ROOT / "memest" / "data" / "models" / "gpt2.json"))
    return AutoModelForCausalLM.from_config(config).to(device)


def _ids(batch: int, seq: int, device: str = "cpu"):
    import torch

    return torch.randint(0, 50257, (batch, seq), generator=torch.Generator().manual_seed(0)).to(device)


def run_preflight(batch: int, seq: int, gpu: str | None) -> dict | None:
    import torch

    import memest

    model = _gpt2(DEVICE)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = _ids(batch, seq, DEVICE)
    sample = {"input_ids": ids, "labels": ids}
    result = memest.preflight(model, opt, sample, gpu=gpu)
    for step in range(1, STEPS + 1):
        loss = model(**sample).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        result.after_step(step)
    return result.measured


def run_trainer(batch: int, seq: int, gpu: str | None) -> dict | None:
    import tempfile

    from transformers import Trainer, TrainingArguments

    from memest.integrations.transformers import MemestCallback

    ids = _ids(batch * STEPS, seq)
    data = [{"input_ids": row, "labels": row} for row in ids]
    callback = MemestCallback(seq=seq, gpu=gpu)
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(out, per_device_train_batch_size=batch, max_steps=STEPS, bf16=True,
                                 optim="adamw_torch", report_to=[], save_strategy="no", logging_strategy="no",
                                 dataloader_num_workers=0, use_cpu=DEVICE == "cpu")
        Trainer(model=_gpt2("cpu"), args=args, train_dataset=data, callbacks=[callback]).train()
    return callback.result.measured if callback.result else None


def run_lightning(batch: int, seq: int, gpu: str | None) -> dict | None:
    import lightning as L
    import torch

    from memest.integrations.lightning import MemestCallback

    class LM(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = _gpt2("cpu")

        def training_step(self, b, i):
            return self.model(input_ids=b, labels=b).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    ids = _ids(batch * STEPS, seq)
    loader = torch.utils.data.DataLoader(ids, batch_size=batch)
    callback = MemestCallback(gpu=gpu)
    trainer = L.Trainer(accelerator="gpu" if DEVICE == "cuda" else "cpu", devices=1, precision="bf16-mixed", max_steps=STEPS, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[callback])
    trainer.fit(LM(), loader)
    return callback.result.measured if callback.result else None


RUNNERS = {"preflight": run_preflight, "trainer": run_trainer, "lightning": run_lightning}


def child(case: str, batch: int, seq: int, gpu: str | None) -> None:
    import torch

    if DEVICE == "cuda" and not torch.cuda.is_available():
        print(json.dumps({"case": case, "error": "no CUDA GPU: nothing measured"}))
        return
    t = time.perf_counter()
    record = RUNNERS[case](batch, seq, gpu)
    print(json.dumps({"case": case, "record": record, "wall_s": round(time.perf_counter() - t, 1)}))


def environment() -> dict:
    import torch

    env = {"torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        pass
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        env["nvidia_smi"] = out.stdout.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        env["nvidia_smi"] = f"unavailable: {exc}"
    return env


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--gpu", default=None, help="the budget the checks judge against (default: the present GPU)")
    p.add_argument("--out", default="/tmp/memest-integrations-gpu.json")
    p.add_argument("--timeout-s", type=int, default=240)
    p.add_argument("--dry-run-cpu", action="store_true", help="run the cases on the CPU (no record): a check of "
                   "this script before it spends device time")
    p.add_argument("--child")
    a = p.parse_args()
    global DEVICE
    DEVICE = "cpu" if a.dry_run_cpu else "cuda"
    if a.child:
        child(a.child, a.batch, a.seq, a.gpu)
        return 0
    results = []
    for case in a.cases.split(","):
        cmd = [sys.executable, __file__, "--child", case, "--batch", str(a.batch), "--seq", str(a.seq)]
        if a.gpu:
            cmd += ["--gpu", a.gpu]
        if a.dry_run_cpu:
            cmd.append("--dry-run-cpu")
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout_s, cwd=ROOT)
            lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
            row = json.loads(lines[-1]) if lines else {"case": case, "error": (out.stderr or "no output")[-2000:]}
        except subprocess.TimeoutExpired:
            row = {"case": case, "error": f"timed out after {a.timeout_s} s"}
        results.append(row)
        print(json.dumps(row), flush=True)
    Path(a.out).write_text(json.dumps({"environment": environment(), "batch": a.batch, "seq": a.seq,
                                       "cases": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

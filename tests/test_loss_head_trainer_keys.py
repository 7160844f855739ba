"""The trainer readers map the loss-head keys: axolotl's liger_fused_linear_cross_entropy and
chunked_cross_entropy (+ _num_chunks), LLaMA-Factory's enable_liger_kernel (fused for pt/sft only, as its
loader's require_logits decides); axolotl's cut_cross_entropy is listed as not understood (not modelled)."""

from __future__ import annotations

from pathlib import Path

import pytest

from memest.errors import MemestError
from memest.spec.trainers.load import read_trainer_config

TINY = Path(__file__).resolve().parent / "configs" / "llama-tiny.json"


def _axolotl(tmp_path, extra: str):
    path = tmp_path / "axolotl.yml"
    path.write_text(f"base_model: {TINY}\nmicro_batch_size: 2\nsequence_len: 64\n{extra}")
    return read_trainer_config(path)


def _llamafactory(tmp_path, extra: str):
    path = tmp_path / "lf.yaml"
    path.write_text(f"model_name_or_path: {TINY}\nfinetuning_type: full\ncutoff_len: 64\n{extra}")
    return read_trainer_config(path)


def test_axolotl_loss_head_keys(tmp_path):
    plugins = "plugins:\n  - axolotl.integrations.liger.LigerPlugin\n"
    fused = _axolotl(tmp_path, plugins + "liger_fused_linear_cross_entropy: true\n")
    assert fused.keys["loss_head"] == "fused" and not fused.unknown
    assert _axolotl(tmp_path, "chunked_cross_entropy: true\n").keys["loss_head"] == "chunked-output:8"
    chunked = _axolotl(tmp_path, "chunked_cross_entropy: true\nchunked_cross_entropy_num_chunks: 4\n")
    assert chunked.keys["loss_head"] == "chunked-output:4" and not chunked.unknown
    assert any("inductor" in n for n in chunked.notes)
    off = _axolotl(tmp_path, "liger_fused_linear_cross_entropy: false\ncut_cross_entropy: false\n")
    assert "loss_head" not in off.keys and not off.unknown
    cce = _axolotl(tmp_path, "cut_cross_entropy: true\n")
    assert "loss_head" not in cce.keys and any(u.startswith("cut_cross_entropy") for u in cce.unknown)
    with pytest.raises(MemestError, match="only one"):
        _axolotl(tmp_path, "chunked_cross_entropy: true\nliger_fused_linear_cross_entropy: true\n")


def test_llamafactory_liger_is_fused_for_sft_and_pt_only(tmp_path):
    sft = _llamafactory(tmp_path, "enable_liger_kernel: true\n")  # stage defaults to sft
    assert sft.keys["loss_head"] == "fused" and "enable_liger_kernel" not in sft.unknown
    assert _llamafactory(tmp_path, "stage: pt\nenable_liger_kernel: true\n").keys["loss_head"] == "fused"
    # other stages need logits (LLaMA-Factory turns Liger's fused head off there) and run other steps: the reader
    # refuses them (issue 22 battery 29: a DPO stage read as plain SFT was a silent wrong answer)
    with pytest.raises(MemestError, match="stage = 'dpo'"):
        _llamafactory(tmp_path, "stage: dpo\nenable_liger_kernel: true\n")

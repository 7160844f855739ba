"""Issue 22 (28, residue): an error in a YAML run config names the key the user wrote (`pp_split:`, `lora:`,
`quant:`), not the CLI flag of the same option; a flag given beside the config keeps its flag."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from memest.errors import MemestError
from memest.spec import options
from memest.spec.config import config_from_dict

ROOT = Path(__file__).resolve().parent.parent
MODEL = "hf:" + str(ROOT / "memest" / "data" / "models" / "llama-3.2-1b.json")


def _check(tmp_path, body, *flags):
    path = tmp_path / "run.yaml"
    path.write_text(f"model: {MODEL}\nbatch: 1\nseq: 64\ngpu: 24GiB\n{body}")
    proc = subprocess.run([sys.executable, "-m", "memest", "check", str(path), *flags], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "run.yaml" in lines[0], lines
    return lines[0]


@pytest.mark.parametrize("body, key, flag", [
    ("world_size: 2\npp: 2\npp_split: a,b\n", "pp_split: a,b:", "--pp-split"),
    ("lora: bad value\n", "lora: 'bad value'", "--lora"),
    ("lora: r=2.7\n", "lora: bad value for r", "--lora"),
    ("quant: nf4\n", "quant: nf4 quantizes the frozen base of a QLoRA run; add lora:", "--"),
])
def test_check_names_the_yaml_key(tmp_path, body, key, flag):
    line = _check(tmp_path, body)
    assert key in line and flag not in line, line


def test_a_flag_beside_the_config_keeps_its_flag(tmp_path):
    line = _check(tmp_path, "", "--lora", "bad value")
    assert "--lora 'bad value'" in line, line


def test_config_from_dict_names_keys():
    with pytest.raises(MemestError) as err:
        config_from_dict({"model": MODEL, "world_size": 2, "pp": 2, "pp_split": "a,b"}, "x.yaml")
    assert str(err.value).startswith("x.yaml: pp_split: a,b: give 2 whole layer counts")


def test_as_yaml_keys():
    assert options.as_yaml_keys("--tp 3: no") == "tp: 3: no"
    assert options.as_yaml_keys("--lora: bad value for r") == "lora: bad value for r"
    assert options.as_yaml_keys("--pp-split 1,2 with --pp 2", keep=["pp_split"]) == "--pp-split 1,2 with pp: 2"
    assert options.as_yaml_keys("--gpu-memory-utilization 1.5") == "gpu_memory_utilization: 1.5"
    assert options.as_yaml_keys("no flag here, --not-an-option") == "no flag here, --not-an-option"

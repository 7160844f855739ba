"""hf:org/name resolves through transformers' own config loading: the local Hugging Face cache first,
the hub when it can be reached, and one line naming the id and the fix when it is neither. No network
here: the cache is laid out in a tmp dir as huggingface_hub lays it out, and the hub is switched off
(HF_HUB_OFFLINE=1) in a memest process of its own, as a user's shell would set it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from memest.errors import ModelLoadError
from memest.sources.hf import _config_path

from .conftest import CONFIGS, ROOT

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _cache_with(tmp_path: Path, repo_id: str, config: Path) -> Path:
    """huggingface_hub's cache layout: models--org--name/{refs/main, snapshots/<commit>/config.json}."""
    repo = tmp_path / "hub" / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(config.read_text())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return tmp_path / "hub"


def _memest(args: list[str], cache: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    env.pop("HF_HOME", None)
    return subprocess.run([sys.executable, "-m", "memest", *args], capture_output=True, text=True, env=env, timeout=300)


def test_hub_id_from_the_local_cache(tmp_path):
    cache = _cache_with(tmp_path, "acme/tiny-llama", CONFIGS / "llama-tiny.json")
    proc = _memest(["estimate", "hf:acme/tiny-llama", "--batch", "1", "--seq", "32", "--target", "cpu", "--json"], cache)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["model"] == "acme/tiny-llama"
    local = _memest(["estimate", f"hf:{CONFIGS / 'llama-tiny.json'}", "--batch", "1", "--seq", "32", "--target", "cpu",
                     "--json"], cache)
    assert json.loads(local.stdout)["peak_allocated_bytes"] == doc["peak_allocated_bytes"]  # the same config


def test_hub_id_missing_offline_is_one_line_with_the_fix(tmp_path):
    cache = _cache_with(tmp_path, "acme/tiny-llama", CONFIGS / "llama-tiny.json")
    proc = _memest(["estimate", "hf:acme/other-model", "--target", "cpu"], cache)
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "hf:acme/other-model" in lines[0] and "offline" in lines[0]
    assert "huggingface-cli download acme/other-model config.json" in lines[0] and "hf:path/to/config.json" in lines[0]
    assert str(cache) in lines[0]


def test_bundled_names_paths_and_hub_ids_are_told_apart(tmp_path):
    assert _config_path("gpt2").name == "gpt2.json"  # no slash: bundled
    assert _config_path("Qwen/Qwen2.5-7B") is None  # org/name: a hub id
    folder = tmp_path / "my" / "model"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    assert _config_path(str(folder)) == folder / "config.json"  # an existing folder is a path, slash or not
    with pytest.raises(ModelLoadError, match="bundled: .*hf:org/name"):
        _config_path("no-such-model")
    with pytest.raises(ModelLoadError, match="neither an existing path nor a Hugging Face Hub id"):
        _config_path("a/b/c")


def test_hub_config_that_needs_remote_code_is_refused_without_asking(tmp_path):
    """transformers would prompt on the terminal to run the repository's code; memest never runs it."""
    custom = tmp_path / "custom.json"
    custom.write_text(json.dumps({"model_type": "acme_custom", "architectures": ["AcmeForCausalLM"],
                                  "auto_map": {"AutoConfig": "configuration_acme.AcmeConfig"}}))
    cache = _cache_with(tmp_path, "acme/custom", custom)
    proc = _memest(["estimate", "hf:acme/custom", "--target", "cpu"], cache)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "memest: error: hf:acme/custom needs code from the hub (trust_remote_code), which memest does not run; "
        "download its modeling code and estimate it from a model file (memest estimate model.py)"
    ]

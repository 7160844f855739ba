"""``--from`` a trl GRPOConfig: its ``generation_batch_size`` / ``steps_per_generation`` (trl 1.16.0
trl/trainer/grpo_config.py ``__post_init__``) read as memest's ``--generation-batch``, one process's generation
batch (per_device_train_batch_size x steps_per_generation), from trl's own dump and from a script alike; trl's
default (steps_per_generation = gradient_accumulation_steps) is memest's default, left unset."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from memest.errors import MemestError
from memest.features import grpo
from memest.spec.config import load_config
from memest.spec.trainers.load import read_trainer_config

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "tests" / "configs" / "llama-tiny.json"
KWARGS = dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, num_generations=4,
              max_completion_length=8, report_to="none")


def _dump(tmp_path: Path, monkeypatch, **kwargs) -> Path:
    """trl's own GRPOConfig, dumped as Trainer saves it (after __post_init__); bf16's check answers as a GPU's."""
    trl = pytest.importorskip("trl")
    import transformers.training_args as ta

    monkeypatch.setattr(ta, "is_torch_bf16_gpu_available", lambda *a, **k: True)
    args = trl.GRPOConfig(**{**KWARGS, **kwargs, "output_dir": str(tmp_path / "out")})
    path = tmp_path / "grpo_args.json"
    path.write_text(args.to_json_string())
    return path


def _script(tmp_path: Path, keyword: str) -> Path:
    path = tmp_path / "train_grpo.py"
    path.write_text(textwrap.dedent(f'''
        from trl import GRPOConfig, GRPOTrainer
        model_name = "{TINY}"
        args = GRPOConfig(output_dir="out", per_device_train_batch_size=4, gradient_accumulation_steps=2,
                          num_generations=4, {keyword})
        trainer = GRPOTrainer(model=model_name, args=args, reward_funcs=[])
    '''))
    return path


@pytest.mark.parametrize("given", [{"steps_per_generation": 4}, {"generation_batch_size": 16}],
                         ids=["steps_per_generation", "generation_batch_size"])
def test_trls_dump_gives_one_process_generation_batch(tmp_path, monkeypatch, given):
    cfg = read_trainer_config(_dump(tmp_path, monkeypatch, **given))
    assert cfg.keys["generation_batch"] == 16 and cfg.keys["batch"] == 4 and cfg.keys["grad_accum"] == 2
    assert any(source.startswith("steps_per_generation = 4") for source, _ in cfg.mapping), cfg.mapping
    assert not [u for u in cfg.unknown if u.startswith(("generation_batch_size", "steps_per_generation"))], cfg.unknown


def test_trls_default_is_memests_default(tmp_path, monkeypatch):
    cfg = read_trainer_config(_dump(tmp_path, monkeypatch))  # steps_per_generation = the accumulation, 2
    assert "generation_batch" not in cfg.keys
    assert any("trl's default" in meaning for _, meaning in cfg.mapping), cfg.mapping


@pytest.mark.parametrize("keyword", ["generation_batch_size=16", "steps_per_generation=4"])
def test_a_script_gives_the_same(tmp_path, keyword):
    cfg = read_trainer_config(_script(tmp_path, keyword))
    assert cfg.keys["generation_batch"] == 16
    assert any("one process's" in n for n in cfg.notes) is keyword.startswith("generation_batch_size"), cfg.notes


def test_a_script_giving_both_is_refused_as_trl_refuses_it(tmp_path):
    with pytest.raises(MemestError, match="both generation_batch_size and steps_per_generation"):
        read_trainer_config(_script(tmp_path, "generation_batch_size=16, steps_per_generation=4"))


def test_the_run_from_the_dump_generates_every_other_optimizer_step(tmp_path, monkeypatch):
    dump = _dump(tmp_path, monkeypatch, steps_per_generation=4)
    config = tmp_path / "run.yaml"
    config.write_text(f"from: {dump.name}\nmodel: hf:{TINY}\npreference: grpo\ngenerations: 4\nseq: 8\n")
    spec = load_config(config).spec()
    assert spec.generation_batch == 16 and grpo.steps_per_generation_of(spec) == 4
    assert spec.iterations == 3  # S / K = 2 optimizer steps per generation, + 1 (spec/run.py)

"""Issue 22, item 28 (the rest): `check` refuses what a config asks of its model before it traces any config
(freeze: patterns, tp: against the heads, ep: against the experts, pp_split: against the layers, seq: against the
positions, a serving config's settings and layout), in one line naming the YAML file and key; `pp_split:` may be a
YAML list. Each test checks two configs, a good one first: a trace of the good one would come first, and a
stand-in for the trace (memest.estimator.trace_step, which every estimate and serve profile run calls) leaves a
file behind in the worker process when it runs."""

import pytest
from typer.testing import CliRunner

from memest.cli import app
from memest.errors import MemestError
from memest.spec.config import UniqueKeyLoader, config_from_dict, load_config

from .conftest import ROOT

runner = CliRunner()
TINY = ROOT / "tests" / "configs" / "llama-tiny.json"  # 4 heads, 2 KV heads, 2 layers, 256 positions
MIXTRAL = ROOT / "tests" / "configs" / "mixtral-tiny.json"  # 8 experts per layer
MLP = ROOT / "examples" / "mlp.py"


@pytest.fixture
def traced(tmp_path, monkeypatch):
    """A file that exists once any config was traced (the stand-in runs in check's worker process too)."""
    import memest.estimator

    marker = tmp_path / "traced"

    def stand_in(source, spec):
        marker.write_text(spec.model)
        raise MemestError("traced (test stand-in)")

    monkeypatch.setattr(memest.estimator, "trace_step", stand_in)
    return marker


def check_pair(tmp_path, bad_body: str, model: str = f"hf:{TINY}"):
    good = tmp_path / "good.yaml"
    good.write_text(f"model: hf:{TINY}\nseq: 32\ngpu: 11GB\ntarget: cpu\n")
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"model: {model}\n{bad_body}")
    result = runner.invoke(app, ["check", str(good), str(bad)])
    assert result.exit_code == 2, (result.exit_code, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("memest: error: "), result.stderr  # no "check 1/2" progress line
    assert "Traceback" not in result.stderr and "internal error" not in result.stderr
    return bad, lines[0]


CASES = {
    "freeze": ("seq: 32\ngpu: 11GB\ntarget: cpu\nfreeze: model.no_such_module\n",
               "freeze: 'model.no_such_module' matches no parameter", ["--freeze"]),
    "freeze-list": ("seq: 32\ngpu: 11GB\ntarget: cpu\nfreeze: [model.embed_tokens, lm_headz]\n",
                    "freeze: 'lm_headz' matches no parameter", ["--freeze"]),
    "tp-heads": ("seq: 32\ngpu: 11GB\ntarget: cpu\nworld_size: 3\ntp: 3\n",
                 "tp: 3: the model has 4 attention heads, not divisible by 3", ["--tp"]),
    "tp-kv-heads": ("seq: 32\ngpu: 11GB\ntarget: cpu\nworld_size: 4\ntp: 4\n",
                    "tp: 4: the model has 2 key/value heads, not divisible by 4", ["--tp"]),
    "seq": ("seq: 300\ngpu: 11GB\ntarget: cpu\n", "seq: 300: ", ["--seq"]),
    "pp-split-list": ("seq: 32\ngpu: 11GB\ntarget: cpu\npp: 2\nworld_size: 2\npp_split: [1, 2]\n",
                      "pp_split: 1,2: give 2 layer counts (one per stage) that add up to the model's 2 layers",
                      ["--pp-split", "["]),
    "pp-split-count": ("seq: 32\ngpu: 11GB\ntarget: cpu\npp: 2\nworld_size: 2\npp_split: [2]\n",
                       "pp_split: 2: give 2 layer counts", ["--pp-split", "["]),
    "pp-split-empty": ("seq: 32\ngpu: 11GB\ntarget: cpu\npp: 2\nworld_size: 2\npp_split: [0, 2]\n",
                       "pp_split: 0,2: stage 0 holds no layer", ["--pp-split", "["]),
    "serve-utilization": ("gpu: h100\nserve: {max_model_len: 8192, gpu_memory_utilization: 1.5}\n",
                          "gpu_memory_utilization: must be in (0, 1], got 1.5", ["--gpu-memory-utilization"]),
    "serve-tp": ("gpu: h100\nserve: {max_model_len: 8192, tp: 3}\n",
                 "tp: 3: the model has 32 attention heads, not divisible by 3; vLLM refuses it", ["--tp"]),
}
MODELS = {"serve-utilization": "hf:llama-3-8b", "serve-tp": "hf:llama-3-8b"}


@pytest.mark.parametrize("case", list(CASES))
def test_check_refuses_before_tracing_any_config_naming_the_yaml_file_and_key(tmp_path, traced, case):
    body, words, absent = CASES[case]
    bad, line = check_pair(tmp_path, body, MODELS.get(case, f"hf:{TINY}"))
    assert line.startswith(f"memest: error: {bad}: "), line
    assert words in line, line
    assert not any(a in line for a in absent), line
    assert not traced.exists(), f"{traced.read_text()} was traced before the error"


def test_a_model_file_freeze_pattern_is_found_before_tracing(tmp_path, traced):
    bad, line = check_pair(tmp_path, "batch: 2\ngpu: 11GB\ntarget: cpu\nfreeze: '9'\n", model=str(MLP))
    assert line.startswith(f"memest: error: {bad}: freeze: '9' matches no parameter of mlp"), line
    assert not traced.exists()


def test_a_compiled_model_files_names_are_the_ones_the_trace_freezes(tmp_path, traced):
    """A model file's torch.compile(model) is unwrapped as the trace unwraps it: its '_orig_mod.' prefix is not
    part of the names a freeze: pattern matches, so '0' (the first layer) passes the early check."""
    model = tmp_path / "compiled.py"
    model.write_text(MLP.read_text().replace("    return nn.Sequential(", "    return torch.compile(nn.Sequential(")
                     .replace("        nn.Linear(4096, 10),\n    )", "        nn.Linear(4096, 10),\n    ))"))
    cfg = tmp_path / "compiled.yaml"
    cfg.write_text(f"model: {model}\nbatch: 2\ngpu: 11GB\ntarget: cpu\nfreeze: '0'\n")
    result = runner.invoke(app, ["check", str(cfg)])
    assert result.exit_code == 2 and "traced (test stand-in)" in result.stderr, result.stderr  # reached the trace
    assert traced.exists()


def test_expert_parallel_against_the_experts_before_tracing(tmp_path, traced):
    bad, line = check_pair(tmp_path, "seq: 32\ngpu: 11GB\ntarget: cpu\nworld_size: 3\nep: 3\nshard: zero3\n",
                           model=f"hf:{MIXTRAL}")
    assert line.startswith(f"memest: error: {bad}: ep: 3: the model has 8 experts per layer"), line
    assert not traced.exists()


def test_the_stand_in_sees_a_trace(tmp_path, traced):
    """The control: a good pair is traced, so the stand-in's file is what the tests above would see."""
    good = tmp_path / "good.yaml"
    good.write_text(f"model: hf:{TINY}\nseq: 32\ngpu: 11GB\ntarget: cpu\nfreeze: model.embed_tokens\n")
    result = runner.invoke(app, ["check", str(good)])
    assert result.exit_code == 2 and "traced (test stand-in)" in result.stderr, result.stderr
    assert traced.exists()


def test_good_configs_pass_the_checks_before_the_trace(tmp_path):
    """Patterns, layouts and splits that the model takes pass the early checks and reach a verdict."""
    good = tmp_path / "good.yaml"
    good.write_text(f"model: hf:{TINY}\nseq: 32\ngpu: 11GB\ntarget: cpu\nfreeze: [model.embed_tokens]\n"
                    "world_size: 2\ntp: 2\n")
    split = tmp_path / "split.yaml"
    split.write_text(f"model: hf:{TINY}\nseq: 32\ngpu: 11GB\ntarget: cpu\npp: 2\nworld_size: 2\npp_split: [1, 1]\n")
    result = runner.invoke(app, ["check", str(good), str(split)])
    assert result.exit_code == 0, result.stderr


def test_pp_split_as_a_yaml_list(tmp_path):
    assert config_from_dict({"model": "hf:gpt2", "pp": 2, "world_size": 2, "pp_split": [6, 6]}).values["pp_split"] \
        == "6,6"
    for bad in (["6", "6"], [6.5, 5.5], [True, 11], []):
        with pytest.raises(MemestError, match=r"pp_split: expected whole layer counts"):
            config_from_dict({"model": "hf:gpt2", "pp": 2, "world_size": 2, "pp_split": bad})


def test_a_pp_split_list_of_words_is_refused_at_load_naming_the_key(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model: hf:gpt2\npp: 2\nworld_size: 2\npp_split: [a, b]\n")
    with pytest.raises(MemestError) as err:
        load_config(path)
    assert str(err.value).startswith(f"{path}: pp_split: expected whole layer counts"), str(err.value)


def test_the_duplicate_key_loader_is_built_once(tmp_path):
    import yaml

    path = tmp_path / "run.yaml"
    path.write_text("model: hf:gpt2\nbatch: 4\nbatch: 8\n")
    with pytest.raises(MemestError, match="'batch' is given twice"):
        load_config(path)
    assert issubclass(UniqueKeyLoader, yaml.SafeLoader)
    assert yaml.load("a: 1\nb: {a: 2}\n", Loader=UniqueKeyLoader) == {"a": 1, "b": {"a": 2}}

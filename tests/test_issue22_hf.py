"""Issue 22, hf: sources and their inputs: items 1, 9, 23, 32, 33 and the non-UTF-8 clause of 26."""

import json
from functools import partial

from memest.estimator import estimate
from memest.sources import load_source
from memest.spec import RunSpec
from memest.validate.cpu_truth import measure_cpu_peak

from .conftest import CONFIGS, run
from .conftest import one_line_error as shared_one_line_error

one_line_error = partial(shared_one_line_error, alone=True)  # its strictness: stderr's only line, no traceback
REL_TOL = 0.02  # as tests/test_accuracy_cpu.py


def tiny_llama(tmp_path, name="tiny", **changes) -> str:
    config = json.loads((CONFIGS / "llama-tiny.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key)
        else:
            config[key] = value
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(config))
    return f"hf:{path}"


# -- 1: a config that names no class transformers has gets the head its model_type implies, said aloud ---------

def test_config_without_architectures_builds_the_lm_head_its_model_type_implies(tmp_path):
    """Was: the base model (no LM head, no loss), 4.2x low on llama-3.2-1b, and check passed it."""
    named = tiny_llama(tmp_path, "named")
    bare = tiny_llama(tmp_path, "bare", architectures=None)
    spec = dict(batch=2, seq=32, target="cpu")
    expected = estimate(RunSpec(model=named, **spec)).report.peak_allocated_bytes
    source = load_source(bare)
    got = estimate(RunSpec(model=bare, **spec), source=source).report.peak_allocated_bytes
    assert got == expected
    real = measure_cpu_peak(source, RunSpec(model=bare, **spec))["peak_bytes"]  # the class memest built, run for real
    assert abs(got - real) / real <= REL_TOL, (got, real)
    assert any("LlamaForCausalLM" in w and '"architectures"' in w for w in source.warnings)


def test_the_head_memest_chose_is_said_on_stderr_and_in_the_report(tmp_path):
    for changes in ({"architectures": None}, {"architectures": ["LlamaForSomethingNew"]}):
        result = run("estimate", tiny_llama(tmp_path, **changes), "--target", "cpu", "--batch", "1", "--seq", "16",
                     "--json")
        assert result.exit_code == 0, result.stderr
        warnings = [line for line in result.stderr.splitlines() if line.startswith("memest: warning: ")]
        assert len(warnings) == 1 and "built LlamaForCausalLM" in warnings[0], result.stderr
        out = json.loads(result.stdout)
        assert out["model_type"] == "LlamaForCausalLM"
        assert any("built LlamaForCausalLM" in note for note in out["notes"])


def test_encoder_and_speech_configs_without_architectures_get_their_training_head(tmp_path):
    for name, expected in (("bert-tiny", "BertForMaskedLM"), ("t5-tiny", "T5ForConditionalGeneration"),
                           ("whisper-tiny", "WhisperForConditionalGeneration"), ("clip-tiny", "CLIPModel")):
        config = json.loads((CONFIGS / f"{name}.json").read_text())
        config.pop("architectures", None)
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(config))
        source = load_source(f"hf:{path}")
        assert source.warnings and f"built {expected}," in source.warnings[0], (name, source.warnings)


def test_auto_map_is_refused_with_the_reason(tmp_path):
    ref = tiny_llama(tmp_path, auto_map={"AutoModelForCausalLM": "modeling_acme.AcmeForCausalLM"})
    line = one_line_error(run("estimate", ref, "--target", "cpu"))
    assert '"auto_map"' in line and "trust_remote_code" in line and "memest does not run" in line


def test_model_type_with_no_head_memest_builds_is_refused_naming_the_key(tmp_path):
    path = tmp_path / "patchtst.json"
    path.write_text(json.dumps({"model_type": "patchtst"}))
    line = one_line_error(run("estimate", f"hf:{path}", "--target", "cpu"))
    assert 'no "architectures"' in line and "PatchTST" in line and "causal LM" in line


def test_base_model_named_in_architectures_is_said_aloud(tmp_path):
    source = load_source(tiny_llama(tmp_path, architectures=["LlamaModel"]))
    assert source.warnings and "without a head" in source.warnings[0]


# -- 26 (clause): a config.json that is not UTF-8 ----------------------------------------------------------------

def test_non_utf8_config_is_a_one_line_error(tmp_path):
    path = tmp_path / "latin1.json"
    path.write_bytes('{"model_type": "llama", "_name": "caf\u00e9"}'.encode("latin-1"))
    line = one_line_error(run("estimate", f"hf:{path}", "--target", "cpu"))
    assert "not UTF-8" in line and str(path) in line


# -- 33: short, pointed messages ----------------------------------------------------------------------------------

def test_unknown_model_type_is_one_short_line_with_close_matches(tmp_path):
    path = tmp_path / "typo.json"
    path.write_text(json.dumps({"model_type": "lama"}))
    line = one_line_error(run("estimate", f"hf:{path}", "--target", "cpu"))
    assert len(line) < 400, len(line)
    assert "'lama'" in line and "llama" in line


# -- 9: an hf: path in a YAML config is relative to the config, as model files are --------------------------------

def test_hf_path_in_a_config_resolves_against_the_config_folder(tmp_path):
    from memest.spec.config import load_config

    folder = tmp_path / "runs"
    folder.mkdir()
    tiny_llama(folder)  # runs/tiny.json
    (folder / "model").mkdir()
    tiny_llama(folder / "model", "config")  # runs/model/config.json
    for model, expected in (("hf:tiny.json", folder / "tiny.json"), ("hf:model", folder / "model")):
        config = folder / "run.yaml"
        config.write_text(f"model: {model}\nbatch: 1\nseq: 16\ntarget: cpu\ngpu: 1GB\n")
        assert load_config(config).values["model"] == f"hf:{expected.resolve()}"
        result = run("check", config)  # the working directory is not the config's folder
        assert result.exit_code == 0, result.stderr
    config.write_text("model: hf:gpt2\n")  # a bundled name stays one
    assert load_config(config).values["model"] == "hf:gpt2"


# -- 23: --freeze leaving nothing trainable in training mode -------------------------------------------------------

def test_freeze_everything_in_training_is_an_error_as_the_real_step_is(tmp_path):
    import torch

    ref = tiny_llama(tmp_path)
    line = one_line_error(run("estimate", ref, "--target", "cpu", "--batch", "1", "--seq", "16", "--freeze", "*"))
    assert "loss.backward()" in line and "--mode inference" in line and "'*'" in line
    # the real step: the same model, every parameter frozen, its own loss, then backward
    source = load_source(ref)
    model = source.build_model()
    model.requires_grad_(False)
    loss = model(**source.example_inputs(1, 16)).loss
    try:
        loss.backward()
        raised = False
    except RuntimeError:
        raised = True
    assert raised and not loss.requires_grad and torch.is_tensor(loss)
    assert run("estimate", ref, "--target", "cpu", "--batch", "1", "--seq", "16", "--mode", "inference").exit_code == 0


# -- 32: freeze: as a YAML list --------------------------------------------------------------------------------------

def test_freeze_as_a_yaml_list_is_the_same_as_the_comma_string(tmp_path):
    from memest.spec.config import load_config

    ref = tiny_llama(tmp_path)
    as_list = tmp_path / "list.yaml"
    as_list.write_text(f"model: {ref}\nbatch: 1\nseq: 16\ntarget: cpu\nfreeze: [model.embed_tokens, 'model.layers.0.*']\n")
    as_text = tmp_path / "text.yaml"
    as_text.write_text(f"model: {ref}\nbatch: 1\nseq: 16\ntarget: cpu\nfreeze: model.embed_tokens,model.layers.0.*\n")
    spec = load_config(as_list).spec()
    assert spec.freeze == "model.embed_tokens,model.layers.0.*" == load_config(as_text).spec().freeze
    report = estimate(spec).report
    model = load_source(ref).build_model()
    frozen = sum(p.numel() for n, p in model.named_parameters() if n.startswith(("model.embed_tokens", "model.layers.0.")))
    assert report.trainable_param_count == report.param_count - frozen
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"model: {ref}\nfreeze: [model.embed_tokens, 3]\n")
    line = one_line_error(run("check", bad))
    assert str(bad) in line and "freeze" in line and "3" in line


# -- 33: hints that match the fault ---------------------------------------------------------------------------------

MODEL = """
import torch
from torch import nn

def build_model():
    return nn.Linear(8, 4)

def example_inputs(batch_size, seq_len=None):
    return (torch.randn(batch_size, 8),)
"""


def _model_file(tmp_path, name, text):
    path = tmp_path / f"{name}.py"
    path.write_text(MODEL + text)
    return path


def test_a_compute_loss_fault_points_at_compute_loss_not_the_inputs(tmp_path):
    path = _model_file(tmp_path, "bad_loss", "\ndef compute_loss(output, inputs):\n    return output.loss_value\n")
    line = one_line_error(run("estimate", path, "--target", "cpu"))
    assert "compute_loss" in line and "example_inputs()" not in line, line


def test_an_output_without_a_loss_points_at_the_output(tmp_path):
    path = tmp_path / "no_float.py"
    path.write_text(MODEL.replace("return nn.Linear(8, 4)", "return Ids()") + """
class Ids(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(1))

    def forward(self, x):
        return x.argmax(-1)
""")
    line = one_line_error(run("estimate", path, "--target", "cpu"))
    assert "floating-point" in line and "compute_loss" in line and "example_inputs()" not in line, line


def test_example_inputs_failing_without_seq_says_pass_seq(tmp_path):
    path = tmp_path / "tokens.py"
    path.write_text(MODEL.replace("(torch.randn(batch_size, 8),)", "(torch.randn(batch_size, seq_len, 8),)"))
    line = one_line_error(run("estimate", path, "--target", "cpu"))
    assert "pass --seq" in line, line
    assert run("estimate", path, "--target", "cpu", "--seq", "4").exit_code == 0


def test_seq_on_a_model_that_takes_none_is_refused():
    ref = f"hf:{CONFIGS / 'vit-tiny.json'}"
    line = one_line_error(run("estimate", ref, "--target", "cpu", "--batch", "2", "--seq", "128"))
    assert "--seq 128" in line and "takes no sequence" in line and "pixel_values" in line
    assert run("estimate", ref, "--target", "cpu", "--batch", "2").exit_code == 0


def test_bundled_names_fold_case_and_suggest_close_ones():
    assert load_source("hf:LLaMA-2-7B").name == "llama-2-7b"
    line = one_line_error(run("estimate", "hf:llama-2-7c", "--target", "cpu"))
    assert "did you mean hf:llama-2-7b" in line and "bundled: " in line

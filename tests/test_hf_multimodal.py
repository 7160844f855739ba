"""hf: heads beyond text: the inputs memest builds by modality (sources/hf_inputs.py), traced on fake
tensors against the same step run for real on CPU, and the messages when a head is not supported.

Tiny configs: Whisper (speech seq2seq), Wav2Vec2ForCTC (raw audio + CTC, with its SpecAugment and
LayerDrop on), CLIPModel (contrastive, return_loss) and LLaVA (a CLIP vision tower + Llama)."""

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from memest.cli import app
from memest.errors import MemestError, ModelLoadError, TraceError
from memest.features.registry import trace_step
from memest.sources import load_source
from memest.sources.hf_inputs import ctc_frames, llava_image_tokens, whisper_frames
from memest.spec import RunSpec
from memest.validate.cpu_truth import measure_cpu_peak

from .conftest import model_ref

REL_TOL = 0.02  # as tests/test_accuracy_cpu.py

# LLaVA takes the image features of the vision tower's second-to-last layer (vision_feature_layer -2), so
# the real step frees the last layer's activations as soon as its forward ends; the trace once kept them
# (+6.5% fp32, +5.7% bf16-mixed) through reference cycles of the tracing hooks around autograd nodes that
# never run (trace/modules.py, trace/step.py; tests/test_dropped_outputs.py).

CASES = [
    # (config, batch, seq: decoder tokens / audio samples / text tokens / image + text tokens)
    ("whisper-tiny", 2, 32),
    ("wav2vec2-ctc-tiny", 2, 8000),
    ("clip-tiny", 4, 32),
    ("llava-tiny", 2, 64),
]


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
@pytest.mark.parametrize("name,batch,seq", CASES)
def test_multimodal_estimate_matches_real_cpu_peak(name, batch, seq, precision):
    ref = model_ref(f"hf:{name}")
    spec = RunSpec(model=ref, batch=batch, seq=seq, optim="adamw", precision=precision, target="cpu")
    source = load_source(ref)
    estimated, _ = trace_step(source, spec).peak()
    real = measure_cpu_peak(source, spec)["peak_bytes"]
    error = (estimated - real) / real
    assert abs(error) <= REL_TOL, f"{name} {precision}: estimated {estimated} B, measured {real} B ({100 * error:+.2f}%)"


def test_whisper_gets_the_encoder_window_and_decoder_labels():
    source = load_source(model_ref("hf:whisper-tiny"))  # max_source_positions 64, max_target_positions 64
    model = source.build_model()
    inputs = source.example_inputs(2, 16)
    assert inputs["input_features"].shape == (2, 16, whisper_frames(model.config)) == (2, 16, 128)
    assert inputs["labels"].shape == (2, 16)
    assert source.max_seq == 64 and "max_target_positions" in source.max_seq_why
    with torch.no_grad():
        assert model(**inputs).loss is not None  # the real model takes them
    with pytest.raises(ValueError, match="128"):  # and takes no other encoder length
        model(input_features=torch.randn(2, 16, 100), labels=inputs["labels"])


def test_ctc_labels_fit_the_frames_and_skip_the_blank():
    source = load_source(model_ref("hf:wav2vec2-ctc-tiny"))
    model = source.build_model()
    inputs = source.example_inputs(2, 8000)
    frames = ctc_frames(model.config, 8000)
    assert model.wav2vec2._get_feat_extract_output_lengths(8000) == frames
    assert inputs["labels"].shape == (2, frames // 2)
    assert (inputs["labels"] != model.config.pad_token_id).all() and (inputs["labels"] < model.config.vocab_size).all()
    assert model.config.layerdrop == 0.0  # traced with every layer (see the note)
    assert any("layerdrop 0.1" in note for note in source.notes)
    out = model(**inputs)
    assert torch.isfinite(out.loss)  # a valid CTC problem: the real loss is finite


def test_llava_image_tokens_match_the_image_features():
    source = load_source(model_ref("hf:llava-tiny"))
    model = source.build_model()
    n = llava_image_tokens(model.config)
    assert n == (32 // 8) ** 2  # 16 patches (+ CLS - CLS with the "default" strategy)
    inputs = source.example_inputs(2, 40)
    assert (inputs["input_ids"] == model.config.image_token_id).sum(-1).tolist() == [n, n]
    assert (inputs["labels"][:, :n] == -100).all()
    with torch.no_grad():
        features = model.model.get_image_features(inputs["pixel_values"]).pooler_output  # one per image
    assert [f.shape[0] for f in features] == [n, n]
    with pytest.raises(MemestError, match=f"--seq {n + 1} or more"):
        source.example_inputs(2, n)


def test_clip_inputs_and_text_limit():
    source = load_source(model_ref("hf:clip-tiny"))
    inputs = source.example_inputs(4, 16)
    assert set(inputs) == {"input_ids", "pixel_values", "return_loss"} and inputs["return_loss"] is True
    assert inputs["pixel_values"].shape == (4, 3, 32, 32)
    assert source.max_seq == 32 and source.default_seq == 32


def test_report_says_what_memest_built():
    result = CliRunner().invoke(
        app, ["estimate", f"hf:{model_ref('hf:whisper-tiny')[3:]}", "--seq", "16", "--target", "cpu", "--json"]
    )
    assert result.exit_code == 0, result.output
    notes = json.loads(result.stdout)["notes"]
    assert any("input_features (batch, 16 mel bins, 128 frames" in note for note in notes)


def test_unsupported_head_names_what_the_model_takes(tmp_path):
    """A forward memest builds no inputs for is refused when the config is loaded, in words about the
    model and its inputs (not about an example_inputs() the user never wrote)."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"architectures": ["Speech2TextForConditionalGeneration"], "model_type": "speech_to_text",
                                "vocab_size": 64, "d_model": 32, "encoder_layers": 1, "decoder_layers": 1,
                                "encoder_attention_heads": 2, "decoder_attention_heads": 2}))
    with pytest.raises(ModelLoadError) as info:
        load_source(f"hf:{path}")
    message = str(info.value)
    assert "Speech2TextForConditionalGeneration" in message and "input_features" in message
    assert "example_inputs()" in message and "model file" in message  # the way out: a model file of one's own


def test_a_failing_hf_step_says_what_memest_built(tmp_path):
    """DeepSeek-V3's attention needs num_key_value_heads == num_attention_heads; this config breaks it.
    The error says which inputs memest built for which head, not 'check example_inputs()'."""
    raw = json.loads(Path(model_ref("hf:deepseek-v3-tiny")[3:]).read_text())
    raw["num_key_value_heads"] = 2
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(TraceError) as info:
        trace_step(load_source(f"hf:{path}"), RunSpec(model=f"hf:{path}", batch=1, seq=16, target="cpu"))
    message = str(info.value)
    assert "memest built the inputs of a causal-lm head for DeepseekV3ForCausalLM" in message
    assert "check that example_inputs() matches" not in message

"""Issue 22's third new-user battery (benchmarks/battery-29.md): new kinds of bad input against the features added
since the second (--from, preflight and the callbacks, --preference, --images, --fp8, --activation-offload,
--optim-in-backward, selective checkpointing, python -m memest). Each test failed on main ffc9fdd."""

import pytest
from typer.testing import CliRunner

import memest
from memest.cli import app
from memest.errors import MemestError

from .conftest import ROOT
from .conftest import one_line_error as error_line

runner = CliRunner()
MLP = str(ROOT / "examples" / "mlp.py")
TINY = "hf:" + str(ROOT / "tests" / "configs" / "llama-tiny.json")


def test_preference_on_a_model_without_an_lm_head_is_a_one_line_error():
    # was: AttributeError 'Sequential' object has no attribute 'config' (trl's add_fused_lm_head), an internal error
    line = error_line(runner.invoke(app, ["estimate", MLP, "--preference", "dpo"]), traceback=True, internal=True)
    assert "--preference dpo" in line and "LM head" in line and "Sequential" in line


def test_preference_on_a_model_without_an_lm_head_through_the_api():
    with pytest.raises(MemestError, match="preference dpo traces a causal LM") as err:
        memest.estimate(MLP, preference="dpo")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("keywords,named", [
    ({"lora": "bad value"}, "lora 'bad value'"),
    ({"lora": {"r": 0}}, "lora: bad value for r"),
    ({"pp": 2, "pp_split": "a,b"}, "pp_split a,b"),
])
def test_api_errors_name_the_keyword_not_the_flag(keywords, named):
    # was: "--lora 'bad value': ..." / "--pp-split a,b: ..." from memest.estimate(lora=..., pp_split=...)
    with pytest.raises(MemestError) as err:
        memest.estimate(TINY, seq=32, **keywords)
    text = str(err.value)
    assert text.startswith("memest.estimate(): " + named), text
    assert "--lora" not in text and "--pp-split" not in text


def test_the_cli_still_names_the_flag():
    line = error_line(runner.invoke(app, ["estimate", TINY, "--seq", "32", "--lora", "bad value"]))
    assert "--lora 'bad value'" in line

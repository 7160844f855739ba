"""Issue 22's closing battery: new kinds of bad input tried after the 47 listed defects were fixed. Each was
wrong on the main that had those fixes (a YAML key given twice gated the last value silently; a non-UTF-8
config was an internal error; serve --tp 0 blamed --block-size, which the user did not pass)."""

from typer.testing import CliRunner

from memest.cli import app

from .conftest import ROOT
from .conftest import one_line_error as error_line  # exit 2, the one error line, no traceback

runner = CliRunner()
MLP = str(ROOT / "examples" / "mlp.py")


def test_a_yaml_key_given_twice_is_refused_not_the_last_kept(tmp_path):
    config = tmp_path / "twice.yaml"
    config.write_text(f"model: {MLP}\ngpu: 11GB\nbatch: 4\nbatch: 100000\n")
    line = error_line(runner.invoke(app, ["check", str(config)]))
    assert "'batch'" in line and "twice" in line and str(config) in line and "line 4" in line


def test_a_key_given_twice_in_a_nested_mapping_is_refused(tmp_path):
    config = tmp_path / "nested.yaml"
    config.write_text(f"model: {MLP}\ngpu: 11GB\nlora: {{r: 8, r: 16}}\n")
    assert "'r'" in error_line(runner.invoke(app, ["check", str(config)]))


def test_the_same_key_in_two_mappings_is_fine(tmp_path):
    config = tmp_path / "ok.yaml"
    config.write_text(f"model: {MLP}\ngpu: 11GB\nname: a\n")
    result = runner.invoke(app, ["check", str(config)])
    assert result.exit_code == 0, result.stderr


def test_a_config_that_is_not_utf8_is_a_one_line_error(tmp_path):
    config = tmp_path / "latin1.yaml"
    config.write_bytes(b"model: caf\xe9.py\n")
    line = error_line(runner.invoke(app, ["check", str(config)]))
    assert "UTF-8" in line and "0xe9" in line


def test_serve_tp_zero_names_tp_only():
    line = error_line(runner.invoke(app, ["serve", "hf:" + str(ROOT / "tests" / "configs" / "llama-tiny.json"),
                                          "--gpu", "24GB", "--tp", "0"]))
    assert "--tp must be at least 1, got 0" in line and "--block-size" not in line

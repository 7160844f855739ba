"""scripts/check_docs.py (issue 25): README.md's and docs/*.md's relative links and anchors resolve, and every
`memest ...` command in their bash blocks names a real subcommand and real flags."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("check_docs", ROOT / "scripts" / "check_docs.py")
check_docs = sys.modules["check_docs"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check_docs)


def test_the_docs_have_no_broken_link_anchor_or_command():
    assert [str(p) for p in check_docs.problems()] == []


def test_the_script_exits_0_on_the_docs():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "check_docs.py")], capture_output=True,
                          text=True, timeout=300)
    assert (proc.returncode, proc.stdout) == (0, "")


def test_the_docs_hold_links_and_commands_to_check():
    """The checks above are not vacuous: the parser finds the README's links and commands."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(list(check_docs._commands(text))) >= 5
    assert len(check_docs.link_problems(ROOT / "README.md")) == 0
    usage = check_docs.anchors(ROOT / "docs" / "usage.md")
    assert {"options", "python-api", "installing-python--m-memest-and-shell-completion"} <= usage


@pytest.mark.parametrize("heading, expected", [
    ("Set up (two commands, fresh machine)", "set-up-two-commands-fresh-machine"),
    ("`memest serve`: vLLM's start-up", "memest-serve-vllms-start-up"),
    ("Planning: check, whatif, max-batch, advise", "planning-check-whatif-max-batch-advise"),
    ("A [linked](x.md) heading", "a-linked-heading"),
    ("snake_case and 2.5 GiB", "snake_case-and-25-gib"),
])
def test_slug_is_githubs(heading, expected):
    assert check_docs.slug(heading) == expected


def test_it_finds_each_kind_of_broken_reference(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text("# Page\n\n## Real part\n\n## Real part\n\ntext\n")
    (tmp_path / "README.md").write_text(
        "# R\n\n"
        "[ok](docs/page.md#real-part) [ok2](docs/page.md#real-part-1) [web](https://example.com/x#y)\n"
        "[gone](docs/missing.md) [bad anchor](docs/page.md#nope) `[in code](nowhere.md)`\n\n"
        "```bash\n"
        "memest estimate examples/mlp.py --batch 2 --json | head -1   # fine\n"
        "memest estimat examples/mlp.py\n"
        "memest estimate hf:gpt2 --batch 2 \\\n"
        "    --no-such-flag 3\n"
        "python -m memest serve hf:gpt2 --gpu h100 --batch 4\n"
        "memest --versio\n"
        "```\n\n"
        "```python\nmemest estimate x --nothing-checked-in-python\n```\n")
    found = [str(p) for p in check_docs.problems(tmp_path)]
    assert found == [
        "README.md:4: link to docs/missing.md: docs/missing.md does not exist",
        "README.md:4: link to docs/page.md#nope: no heading in page.md has the anchor #nope",
        "README.md:8: memest estimat: no such command",
        "README.md:9: memest estimate --no-such-flag: no such flag",
        "README.md:11: memest serve --batch: no such flag",
        "README.md:12: memest --versio: no such option",
    ]

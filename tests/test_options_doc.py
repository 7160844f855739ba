"""docs/usage.md's flag reference is the option table's: regenerated, it is unchanged."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_flag_reference_in_the_docs_is_current():
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "options_doc.py"), "--check"], capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr


def test_every_flag_of_every_command_is_in_the_reference():
    from memest.spec.options import OPTIONS

    text = (ROOT / "docs" / "usage.md").read_text()
    section = text[text.index("<!-- options:begin"):text.index("<!-- options:end -->")]
    missing = [f for opt in OPTIONS if not opt.argument for f in opt.flags if f"`{f}`" not in section]
    assert not missing, missing

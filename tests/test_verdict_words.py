"""A training-fit verdict is a Verdict (spec/choices.py): no code compares one as a string literal."""

from __future__ import annotations

import ast
from pathlib import Path

from memest.device.fit import passes, verdict, worst
from memest.spec.choices import Verdict

PACKAGE = Path(__file__).resolve().parents[1] / "memest"
WORDS = {"fits", "tight", "does-not-fit"}


def _literals(node: ast.expr) -> list[str]:
    """String constants compared by ``node``: itself, or the items of a tuple / list / set it is."""
    items = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
    return [n.value for n in items if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def verdict_comparisons(source: str) -> list[tuple[int, str]]:
    """(line, word) of every comparison of a verdict word as a string literal in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            for operand in [node.left, *node.comparators]:
                found += [(node.lineno, word) for word in _literals(operand) if word in WORDS]
    return found


def test_the_scan_finds_a_verdict_compared_as_a_string():
    code = 'a = r.verdict == "tight"\nb = "fits" != v\nc = v in ("x", "does-not-fit")\nd = v is Verdict.FITS\n'
    assert verdict_comparisons(code) == [(1, "tight"), (2, "fits"), (3, "does-not-fit")]


def test_no_verdict_word_is_compared_as_a_string_outside_choices():
    offenders = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: {word!r}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != PACKAGE / "spec" / "choices.py"
        for line, word in verdict_comparisons(path.read_text())
    ]
    assert offenders == [], "compare with Verdict members instead:\n" + "\n".join(offenders)


def test_verdicts_are_the_enum_and_their_json_strings_are_unchanged():
    import json

    assert verdict(10, 20, 20) is Verdict.FITS
    assert verdict(10, 20, 15) is Verdict.TIGHT
    assert verdict(10, None, 15) is Verdict.TIGHT  # unbounded high end: never fits
    assert verdict(10, 20, 9) is Verdict.DOES_NOT_FIT
    assert json.dumps([verdict(10, 20, 20), verdict(10, 20, 9)]) == '["fits", "does-not-fit"]'
    assert worst([Verdict.FITS, "tight", Verdict.FITS]) is Verdict.TIGHT
    assert worst([]) is None
    assert passes(Verdict.TIGHT) and not passes(Verdict.TIGHT, strict=True) and not passes(Verdict.DOES_NOT_FIT)

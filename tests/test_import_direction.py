"""The trace core never imports a feature: no module of memest/trace imports memest.features, memest.parallel
or memest.targets, at module level or inside a function (features reach the core through StepFeature)."""

import ast
from pathlib import Path

import pytest

TRACE = Path(__file__).resolve().parents[1] / "memest" / "trace"
FORBIDDEN = ("memest.features", "memest.parallel", "memest.targets")


def imported_modules(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, module) of every import in ``tree``, nested ones included; ``from memest import x`` names memest.x."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return found


def forbidden(module: str) -> bool:
    return any(module == name or module.startswith(name + ".") for name in FORBIDDEN)


@pytest.mark.parametrize("path", sorted(TRACE.glob("*.py")), ids=lambda p: p.name)
def test_trace_core_imports_no_feature(path):
    hits = [f"{path.name}:{line} imports {module}" for line, module in imported_modules(ast.parse(path.read_text()))
            if forbidden(module)]
    assert not hits, hits


def test_scan_sees_function_level_imports():
    tree = ast.parse("def f():\n    from memest.parallel import distributed\n\nfrom memest import targets\n")
    assert sorted(m for _, m in imported_modules(tree) if forbidden(m)) == [
        "memest.parallel", "memest.parallel.distributed", "memest.targets"]
    assert TRACE.is_dir() and len(list(TRACE.glob("*.py"))) >= 10

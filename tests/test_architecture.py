"""The house rules of docs/ARCHITECTURE.md, checked over the source: imports point one way, no module imports
itself back through others, and no choice is compared as a string (that the trace core names no feature:
tests/test_import_direction.py). Pure AST reads: nothing is imported."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "memest"

# The direction rule (docs/ARCHITECTURE.md): a module may import its own layer and the layers below it, never
# one above. The most specific prefix wins.
LAYERS = [
    ("memest.cli", 9), ("memest.api", 9), ("memest.integrations", 9), ("memest.__main__", 9), ("memest.exits", 9),
    ("memest.app", 8),
    ("memest.plan", 7), ("memest.serve", 7),
    ("memest.estimator", 6), ("memest.validate", 6),
    ("memest.report", 5), ("memest.result", 5),
    ("memest.device", 4), ("memest.features", 4), ("memest.targets", 4), ("memest.parallel", 4),
    ("memest.trace", 3),
    ("memest.sources", 2),
    ("memest.spec", 1),
    ("memest.units", 0), ("memest.errors", 0), ("memest.imports", 0), ("memest.version", 0), ("memest.worker", 0),
    ("memest", 10),  # the package's __init__: the public names
]


def _layer(module: str) -> int:
    for prefix, rank in LAYERS:
        if module == prefix or module.startswith(prefix + "."):
            return rank
    raise AssertionError(f"{module} is in no layer of LAYERS: add it (and to docs/ARCHITECTURE.md)")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(module: str, name: str) -> str:
    """``from module import name``: the submodule when ``name`` is one, else the module."""
    candidate = ROOT.joinpath(*module.split("."), name)
    return f"{module}.{name}" if candidate.is_dir() or candidate.with_suffix(".py").exists() else module


def _executed(tree: ast.AST):
    """Every node that can run: ``if TYPE_CHECKING:`` blocks (type hints only) are left out."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            yield from (n for stmt in node.orelse for n in [stmt, *_executed(stmt)])
            continue
        yield node
        yield from _executed(node)


def _imports() -> list[tuple[str, str, str]]:
    """(importer, imported, where) for every import of memest's own modules, function-level ones included."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        importer = _module_name(path)
        for node in _executed(ast.parse(path.read_text(), str(path))):
            where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.ImportFrom):
                assert node.level == 0, f"{where}: a relative import; memest imports its own modules absolutely"
                if node.module and node.module.split(".")[0] == "memest":
                    found += [(importer, _resolve(node.module, alias.name), where) for alias in node.names]
            elif isinstance(node, ast.Import):
                found += [(importer, alias.name, where) for alias in node.names if alias.name.split(".")[0] == "memest"]
    return found


def test_every_import_points_down_the_layers():
    upward = [f"{where}: {a} (layer {_layer(a)}) imports {b} (layer {_layer(b)})"
              for a, b, where in _imports() if _layer(b) > _layer(a)]
    assert not upward, "imports against the direction rule:\n" + "\n".join(upward)


def test_no_import_circles():
    graph: dict[str, set[str]] = defaultdict(set)
    for a, b, _ in _imports():
        if a != b and not a.startswith(b + ".") and b != "memest":  # a package's own __init__ is loaded first anyway
            graph[a].add(b)
    cycles = _cycles(graph)
    assert not cycles, "import circles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


# -- choices are enums: never compared as strings -------------------------------------------------------------

# RunSpec / ServeSpec / View fields that hold a choice, and the names code gives them
CHOICE_NAMES = {"optim", "precision", "target", "attention", "zero_grad", "mode", "cache", "shard", "offload",
                "outputs", "pp_schedule", "quant", "data_dependent", "ep_routing", "cp_rotate", "engine", "kv_dtype",
                "cuda_graphs", "verdict", "format", "routing"}


def _choice_values() -> set[str]:
    """Every value of every Choice enum, read from spec/choices.py's source."""
    tree = ast.parse((PACKAGE / "spec" / "choices.py").read_text())
    values = set()
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        for stmt in cls.body:
            if isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str):
                if all(isinstance(t, ast.Name) and t.id.isupper() for t in stmt.targets):
                    values.add(stmt.value.value)
    return values


def _strings(node: ast.AST) -> list[str] | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and node.elts and \
            all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts):
        return [e.value for e in node.elts]
    return None


def _name(node: ast.AST) -> str | None:
    return node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None


def test_no_choice_is_compared_as_a_string():
    values = _choice_values()
    assert {"adam", "cuda", "zero3", "generate"} <= values  # the reader still finds the enums
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "spec" / "choices.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Compare) or len(node.comparators) != 1:
                continue
            left, right = node.left, node.comparators[0]
            for named, literal in ((left, right), (right, left)):
                strings = _strings(literal)
                if strings and _name(named) in CHOICE_NAMES and set(strings) & values:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
                    break
    assert not found, "choices compared as strings (compare with the enum member):\n" + "\n".join(found)


@pytest.mark.parametrize("source, expected", [
    ("spec.mode == 'generate'", 1), ("self.shard not in ('zero2', 'zero3')", 1), ("spec.mode == Mode.GENERATE", 0),
    ("name == 'generate'", 0),
])
def test_the_string_comparison_finder_finds_them(source, expected):
    node = ast.parse(source).body[0].value
    left, right = node.left, node.comparators[0]
    hit = any(_strings(lit) and _name(nm) in CHOICE_NAMES and set(_strings(lit)) & _choice_values()
              for nm, lit in ((left, right), (right, left)))
    assert hit == bool(expected)


# -- function-level imports: only to defer a heavy library ----------------------------------------------------

HEAVY = {"torch", "transformers", "peft", "bitsandbytes", "matplotlib"}  # what `memest --help` must not load


def _runs_at_import(tree: ast.Module):
    """The statements a module runs when imported: its body and the bodies of module-level with / if / try
    blocks (step.py imports torch inside ``with imports_without_gc():``), not ``if TYPE_CHECKING:``."""
    for node in tree.body:
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            continue
        yield node
        if isinstance(node, (ast.With, ast.If, ast.Try)):
            yield from (n for n in ast.walk(node) if n is not node)


def _targets(node: ast.AST) -> list[str]:
    if isinstance(node, ast.ImportFrom) and node.module:
        if node.module.split(".")[0] == "memest":
            return [_resolve(node.module, alias.name) for alias in node.names]
        return [node.module.split(".")[0]]
    if isinstance(node, ast.Import):
        return [a.name if a.name.split(".")[0] == "memest" else a.name.split(".")[0] for a in node.names]
    return []


def test_function_level_imports_only_defer_a_heavy_library():
    """An import of memest's own module inside a function is there to keep torch (or another heavy library)
    out of a light module's import (`memest --help` stays instant); anywhere else it belongs at the top."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    at_import: dict[str, set[str]] = {}
    later: dict[str, list[tuple[int, list[str]]]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        now = list(_runs_at_import(tree))
        parents = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
        at_import[name] = {t for n in now for t in _targets(n)} | (parents & set(modules))
        seen = {id(n) for n in now} | {id(n) for n in ast.walk(tree) if isinstance(n, ast.If) and
                                       ast.unparse(n.test) == "TYPE_CHECKING" for n in ast.walk(n)}
        later[name] = [(n.lineno, _targets(n)) for n in ast.walk(tree)
                       if isinstance(n, (ast.Import, ast.ImportFrom)) and id(n) not in seen]
    def is_heavy(name: str) -> bool:
        """Importing ``name`` loads a heavy library: one is reachable over the imports that run at import."""
        seen, todo = set(), [name]
        while todo:
            current = todo.pop()
            if current in HEAVY:
                return True
            if current in seen or current not in modules:
                continue
            seen.add(current)
            todo += at_import[current]
        return False

    assert is_heavy("memest.trace.step") and not is_heavy("memest.cli")  # the reader still sees torch load
    needless = [f"{modules[name].relative_to(ROOT)}:{line}: {name} imports {targets} inside a function"
                for name in sorted(modules) for line, targets in later[name]
                if any(t.split(".")[0] == "memest" for t in targets) and targets != ["memest"]
                and (is_heavy(name) or not any(is_heavy(t) for t in targets if t.split(".")[0] == "memest"))]
    assert not needless, "function-level imports that defer nothing heavy (move them to the top):\n" + "\n".join(needless)

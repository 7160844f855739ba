"""Issue 25, docs "built by a standard docs tool": mkdocs.yml builds the docs/ pages (README.md as the home page,
the benchmarks/ files they link to joining the site: scripts/mkdocs_hooks.py) with ``mkdocs build --strict``, which
fails on a broken link, a broken anchor or a page left out of the nav. The nav test runs everywhere; the builds
need mkdocs (``pip install 'memest[docs]'``) and are skipped without it."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent


def _nav_pages(nav) -> list[str]:
    out: list[str] = []
    for item in nav:
        value = next(iter(item.values())) if isinstance(item, dict) else item
        out.extend(_nav_pages(value) if isinstance(value, list) else [value])
    return out


def test_the_nav_lists_every_docs_page_once():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    pages = _nav_pages(config["nav"])
    assert len(pages) == len(set(pages)), pages
    assert set(pages) == {"index.md"} | {p.name for p in (ROOT / "docs").glob("*.md")}
    assert config["hooks"] == ["scripts/mkdocs_hooks.py"] and (ROOT / config["hooks"][0]).is_file()
    assert config["validation"]["links"]["not_found"] == config["validation"]["links"]["anchors"] == "warn"


def _build(root: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(root / "mkdocs.yml"),
                           "-d", str(site)], cwd=root, capture_output=True, text=True, timeout=300)


def test_mkdocs_build_strict(tmp_path):
    pytest.importorskip("mkdocs")
    proc = _build(ROOT, tmp_path / "site")
    assert proc.returncode == 0, proc.stderr
    home = (tmp_path / "site" / "index.html").read_text(encoding="utf-8")
    assert 'href="usage/"' in home  # README's docs/usage.md, as the site's page
    usage = (tmp_path / "site" / "usage" / "index.html").read_text(encoding="utf-8")
    assert 'id="installing-python--m-memest-and-shell-completion"' in usage  # GitHub's anchor, as docs link it
    integrations = (tmp_path / "site" / "integrations" / "index.html").read_text(encoding="utf-8")
    assert 'href="../benchmarks/preflight/"' in integrations  # ../benchmarks/preflight.md, now in the site
    assert (tmp_path / "site" / "benchmarks" / "gpu-slack.json").is_file()


BREAKAGES = [  # (page, line appended, what mkdocs says)
    ("json.md", "[gone](../benchmarks/no-such.md)", "'../benchmarks/no-such.md', but the target is not found"),
    ("json.md", "[bad](usage.md#no-such-anchor)", "'usage.md#no-such-anchor', but the doc 'usage.md' does not contain"),
    ("usage.md", "[bad](../README.md#no-such-heading)", "does not contain an anchor '#no-such-heading'"),
    ("new-page.md", "# A page nobody added to the nav", "  - new-page.md"),
]


def test_a_broken_reference_fails_the_build(tmp_path):
    """Each kind of breakage, in one build of a copy of the docs: mkdocs reports all four and exits 1."""
    pytest.importorskip("mkdocs")
    root = tmp_path / "repo"
    for name in ("docs", "benchmarks"):
        shutil.copytree(ROOT / name, root / name)
    (root / "scripts").mkdir()
    for name in ("mkdocs.yml", "README.md", "scripts/mkdocs_hooks.py"):
        shutil.copy(ROOT / name, root / name)
    assert _build(root, tmp_path / "intact").returncode == 0
    for page, line, _ in BREAKAGES:
        path = root / "docs" / page
        path.write_text((path.read_text(encoding="utf-8") if path.exists() else "") + "\n" + line + "\n")
    proc = _build(root, tmp_path / "site")
    assert proc.returncode == 1, proc.stderr
    for _, _, message in BREAKAGES:
        assert message in proc.stderr, (message, proc.stderr)


def _load(name: str, file: str):
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / file)
        sys.modules[name] = importlib.util.module_from_spec(spec)  # before running it: dataclasses look it up
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


def test_github_slug_matches_check_docs():
    """The site's anchors are the ones scripts/check_docs.py checks the Markdown links against."""
    pytest.importorskip("mkdocs")
    hooks, check = _load("mkdocs_hooks", "mkdocs_hooks.py"), _load("check_docs", "check_docs.py")
    for heading in ("Set up (two commands, fresh machine)", "Installing, python -m memest and shell completion",
                    "snake_case and 2.5 GiB", "Planning: check, whatif, max-batch, advise"):
        assert hooks.github_slug(heading) == check.slug(heading), heading

"""mkdocs hook (mkdocs.yml ``hooks:``): the site is built from the same Markdown GitHub shows, unchanged.

docs/*.md link to ``../README.md`` and ``../benchmarks/*``, outside mkdocs' docs_dir, which ``mkdocs build
--strict`` rejects. Here the README becomes the site's home page (``index.md``) and every other repository file a
page links to (transitively, through Markdown pages) is added to the site at its repository path
(``benchmarks/accuracy.md``: a page, not in the nav; ``benchmarks/gpu-slack.json``: copied as is); each relative
link is rewritten to the target's place in the site. A link to a file that does not exist is left alone, so mkdocs
warns and ``--strict`` fails. Headings get GitHub's anchors (the ones the Markdown links use, and the ones
scripts/check_docs.py checks), so ``validation: anchors: warn`` catches a broken ``#anchor`` too; one difference
remains: a repeated heading's second anchor is ``name_1`` here (Python-Markdown's toc), ``name-1`` on GitHub (no
page repeats a heading today).
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File, InclusionLevel

ROOT = Path(__file__).resolve().parent.parent
DOCS = "docs/"
LINK = re.compile(r"(?<!!)(\[(?:[^\]\[]|\[[^\]]*\])*\]\()([^)\s]+)((?:\s+\"[^\"]*\")?\))")
FENCE = re.compile(r"^\s*(```|~~~)")
CODE = re.compile(r"(`+).*?\1")
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:")
_repo_path: dict[str, str] = {}  # site src_uri -> repository path, for the pages this hook added or kept


def github_slug(value: str, separator: str = "-") -> str:
    """GitHub's heading anchor: lower case, punctuation dropped, each space a hyphen (none collapsed)."""
    return re.sub(r"[^\w\- ]", "", value.strip().lower()).replace(" ", separator)


def site_uri(repo_path: str) -> str:
    """Where a repository file lives in the site."""
    if repo_path == "README.md":
        return "index.md"
    return repo_path[len(DOCS):] if repo_path.startswith(DOCS) else repo_path


def _targets(text: str, repo_path: str):
    """(match, target's repository path, anchor) for each relative link outside code."""
    in_fence = False
    for line in text.splitlines():
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        if in_fence:
            continue
        for m in LINK.finditer(CODE.sub(lambda c: " " * len(c.group(0)), line)):
            url = m.group(2)
            if EXTERNAL.match(url) or url.startswith("#"):
                continue
            path, _, anchor = url.partition("#")
            yield m, posixpath.normpath(posixpath.join(posixpath.dirname(repo_path), path)), anchor


def on_config(config, **kwargs):
    config.mdx_configs.setdefault("toc", {})["slugify"] = github_slug
    return config


def on_files(files, config, **kwargs):
    _repo_path.clear()
    for f in files:
        if f.is_documentation_page():
            _repo_path[f.src_uri] = DOCS + f.src_uri
    todo = ["README.md", *_repo_path.values()]
    _repo_path[site_uri("README.md")] = "README.md"
    while todo:
        repo_path = todo.pop()
        uri = site_uri(repo_path)
        if files.get_file_from_path(uri) is None:
            inclusion = InclusionLevel.INCLUDED if repo_path == "README.md" else InclusionLevel.NOT_IN_NAV
            files.append(File.generated(config, uri, abs_src_path=str(ROOT / repo_path), inclusion=inclusion))
            _repo_path[uri] = repo_path
        if not repo_path.endswith(".md"):
            continue
        for _, target, _ in _targets((ROOT / repo_path).read_text(encoding="utf-8"), repo_path):
            if (ROOT / target).is_file() and not target.startswith("..") and site_uri(target) not in _repo_path:
                todo.append(target)
                _repo_path[site_uri(target)] = target  # queued: added when popped
    return files


def on_page_markdown(markdown, page, config, files, **kwargs):
    repo_path = _repo_path.get(page.file.src_uri)
    if repo_path is None:
        return markdown
    here = posixpath.dirname(page.file.src_uri) or "."
    lines = []
    in_fence = False
    for line in markdown.splitlines(keepends=True):
        if FENCE.match(line):
            in_fence = not in_fence
        elif not in_fence:
            line = _rewrite(line, repo_path, here)
        lines.append(line)
    return "".join(lines)


def _rewrite(line: str, repo_path: str, here: str) -> str:
    out, last = [], 0
    for m, target, anchor in _targets(line, repo_path):
        if not (ROOT / target).is_file():
            continue  # left as written: mkdocs reports it (and --strict fails)
        url = posixpath.relpath(site_uri(target), here) + (f"#{anchor}" if anchor else "")
        out.append(line[last:m.start(2)] + url)
        last = m.end(2)
    return "".join(out) + line[last:]

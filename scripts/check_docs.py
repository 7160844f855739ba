"""Check README.md and docs/*.md: every relative link names a file that exists, every `#anchor` a heading of
the target page (GitHub's slug), and every `memest ...` command in a ```bash block a real subcommand with its
real flags (the typer app's, which spec/options.py builds). Prints one line per problem; exit 1 if any.

    python scripts/check_docs.py
"""

from __future__ import annotations

import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"(?<!!)\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
FENCE = re.compile(r"^\s*(```|~~~)\s*([\w+-]*)")
SHELL_END = {"|", "||", "&&", ";", ">", ">>", "2>", "2>&1", "<"}


@dataclass(frozen=True)
class Problem:
    file: str
    line: int
    what: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.what}"


def doc_files(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def _blocks(text: str):
    """(line number, line, fence language or None outside code) for each line."""
    lang = None
    for n, line in enumerate(text.splitlines(), 1):
        fence = FENCE.match(line)
        if fence:
            lang = (fence.group(2) or "text") if lang is None else None
            continue
        yield n, line, lang


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text lower-cased, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for _, line, lang in _blocks(path.read_text(encoding="utf-8")):
        m = HEADING.match(line) if lang is None else None
        if m:
            base = slug(m.group(2))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def _prose(line: str) -> str:
    return re.sub(r"`[^`]*`", "", line)  # links inside inline code are code, not links


def link_problems(path: Path, root: Path = ROOT) -> list[Problem]:
    rel = path.relative_to(root).as_posix()
    problems = []
    for n, line, lang in _blocks(path.read_text(encoding="utf-8")):
        if lang is not None:
            continue
        for target in LINK.findall(_prose(line)):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if not dest.exists():
                problems.append(Problem(rel, n, f"link to {target}: {file} does not exist"))
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                problems.append(Problem(rel, n, f"link to {target}: no heading in {dest.name} has the anchor "
                                                f"#{anchor}"))
    return problems


def _commands(text: str):
    """(line number, argv after `memest`) of each memest command in a bash block (continuations joined)."""
    pending, start = "", 0
    for n, line, lang in _blocks(text):
        if lang not in ("bash", "sh", "shell", "console"):
            pending = ""
            continue
        if not pending:
            start = n
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        command, pending = pending, ""
        try:
            words = shlex.split(command, comments=True)
        except ValueError:
            continue
        for i, word in enumerate(words):
            if word == "memest" and (i == 0 or words[i - 1] in SHELL_END or words[i - 1:i + 1] == ["-m", "memest"]
                                     or (i >= 2 and words[i - 2:i] == ["python", "-m"])):
                argv = []
                for w in words[i + 1:]:
                    if w in SHELL_END:
                        break
                    argv.append(w)
                yield start, argv


def _app_flags() -> tuple[set[str], dict[str, set[str]]]:
    """The root's options and each subcommand's, from the typer app."""
    import typer

    from memest.cli import app

    group = typer.main.get_command(app)

    def flags(cmd) -> set[str]:
        out = {"--help"}
        for p in cmd.params:
            out.update(getattr(p, "opts", ()))
            out.update(getattr(p, "secondary_opts", ()))
        return out

    return flags(group), {name: flags(cmd) for name, cmd in group.commands.items()}


def command_problems(path: Path, root: Path = ROOT) -> list[Problem]:
    rel = path.relative_to(root).as_posix()
    root_flags, commands = _app_flags()
    problems = []
    for n, argv in _commands(path.read_text(encoding="utf-8")):
        if not argv:
            continue
        name = argv[0]
        if name.startswith("-"):
            if name.split("=")[0] not in root_flags:
                problems.append(Problem(rel, n, f"memest {name}: no such option"))
            continue
        if name not in commands:
            problems.append(Problem(rel, n, f"memest {name}: no such command"))
            continue
        for word in argv[1:]:
            if word.startswith("--") and word.split("=")[0] not in commands[name]:
                problems.append(Problem(rel, n, f"memest {name} {word.split('=')[0]}: no such flag"))
    return problems


def problems(root: Path = ROOT) -> list[Problem]:
    out = []
    for path in doc_files(root):
        out += link_problems(path, root) + command_problems(path, root)
    return out


def main() -> int:
    found = problems()
    for p in found:
        print(p)
    return 1 if found else 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())

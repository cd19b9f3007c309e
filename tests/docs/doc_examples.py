"""The ``trainwire`` commands that documentation shows, found in its fenced code blocks.

A command is a line of a shell-like fenced block (no language, bash, sh, shell, zsh, console)
that starts with ``trainwire `` or ``$ trainwire `` (or ``NAME=$(trainwire ``), joined with the
lines a trailing ``\\`` continues; in a console block only a line after a ``$`` prompt is a
command, the rest is output. Each shell pipeline or list part (``|``, ``&&``, ``;``,
``$(...)``, redirections) that starts with ``trainwire`` is one command; the rest of the line
(``| jq``, ``> file``) is not the CLI's. Placeholders (``RUN``, ``$RUN``, ``<run-id>`` read as
``run-id``) are plain words to the parser, so they pass as positional values.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

SHELL_LANGUAGES = frozenset({"", "bash", "sh", "shell", "console", "zsh", "shell-session"})
SESSION_LANGUAGES = frozenset({"console", "shell-session"})
_FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")
_START = re.compile(r"^(?:\$\s+)?(?:[A-Za-z_][A-Za-z0-9_]*=\$\()?trainwire\s")
_PLACEHOLDER = re.compile(r"<[A-Za-z][\w.:/-]*>")
_EMPTY = re.compile(r"(?<=\s)(?:''|\"\")(?=\s|$)")
_EMPTY_WORD = "\x00empty\x00"
_ASSIGN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")
_OPERATORS = frozenset({"|", "||", "&&", ";", "&", "(", ")", "<", ">", ">>", "2>", "&>", "$("})


@dataclass(frozen=True)
class Example:
    """One ``trainwire`` command shown in a document."""

    path: Path
    line: int
    argv: tuple[str, ...]  # without the leading "trainwire"

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: trainwire {shlex.join(self.argv)}"


def _logical_lines(lines: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """Lines with their ``\\`` continuations joined, each with its first line's number."""
    joined: list[tuple[int, str]] = []
    current: tuple[int, str] | None = None
    for number, text in lines:
        if current is None:
            current = (number, text)
        else:
            current = (current[0], current[1] + " " + text.strip())
        if current[1].rstrip().endswith("\\"):
            current = (current[0], current[1].rstrip()[:-1])
            continue
        joined.append(current)
        current = None
    if current is not None:
        joined.append(current)
    return joined


def _shell_blocks(text: str) -> list[tuple[bool, list[tuple[int, str]]]]:
    """The lines (numbered from 1) of each shell-like fenced block, with whether it is a
    session (``console``: commands after a ``$`` prompt, the rest is their output)."""
    blocks: list[tuple[bool, list[tuple[int, str]]]] = []
    language = ""
    fence: str | None = None
    shell = False
    body: list[tuple[int, str]] = []
    for number, line in enumerate(text.splitlines(), 1):
        match = _FENCE.match(line)
        if fence is None:
            if match:
                fence, language, body = match.group(2), match.group(3).lower(), []
                shell = language in SHELL_LANGUAGES
            continue
        if match and match.group(2).startswith(fence) and not match.group(3):
            if shell:
                blocks.append((language in SESSION_LANGUAGES, body))
            fence = None
            continue
        body.append((number, line))
    return blocks


def _commands(line: str) -> list[list[str]]:
    """The parts of a shell line that run ``trainwire``, as argument lists."""
    # A <placeholder> is a word to the parser, not two redirections.
    line = _PLACEHOLDER.sub(lambda m: m.group(0)[1:-1], line).replace("$(", " $( ")
    # shlex drops an empty quoted word ('') when it splits punctuation; keep it.
    line = _EMPTY.sub(_EMPTY_WORD, line)
    lexer = shlex.shlex(line, posix=True, punctuation_chars="|&;<>()")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    try:
        tokens = list(lexer)
    except ValueError:  # an unbalanced quote: the parser would refuse it too
        tokens = line.split()
    parts: list[list[str]] = [[]]
    for token in tokens:
        # An operator ends a command, and so does RUN= of RUN=$(trainwire ...).
        if (
            token in _OPERATORS
            or token == "$"
            or set(token) <= set("|&;<>()")
            or _ASSIGN.fullmatch(token)
        ):
            parts.append([])
        else:
            parts[-1].append("" if token == _EMPTY_WORD else token)
    return [part[1:] for part in parts if part and part[0] == "trainwire"]


def examples_in(path: Path, root: Path | None = None) -> list[Example]:
    """The ``trainwire`` commands in a markdown file's shell blocks."""
    shown = path.relative_to(root) if root is not None else path
    found: list[Example] = []
    for session, block in _shell_blocks(path.read_text(encoding="utf-8")):
        for number, line in _logical_lines(block):
            stripped = line.strip()
            if session and not stripped.startswith("$ "):
                continue  # output, such as "trainwire 0.1.0"
            if not _START.match(stripped):
                continue
            if stripped.startswith("$ "):
                stripped = stripped[2:]
            for argv in _commands(stripped):
                found.append(Example(shown, number, tuple(argv)))
    return found


_SERVICE = re.compile(
    r"^(?:\$\s+)?(?:[A-Za-z_][A-Za-z0-9_]*=\S*\s+)*(?:\S*/)?python3?\s+-m\s+"
    r"(gateway|trainer_service)(?=\s|$)(.*)$"
)


def service_examples_in(path: Path, root: Path | None = None) -> list[Example]:
    """The ``python -m gateway`` and ``python -m trainer_service`` commands in a markdown
    file's shell blocks, as examples whose ``argv`` starts with the service's name."""
    shown = path.relative_to(root) if root is not None else path
    found: list[Example] = []
    for session, block in _shell_blocks(path.read_text(encoding="utf-8")):
        for number, line in _logical_lines(block):
            stripped = line.strip()
            if session and not stripped.startswith("$ "):
                continue
            match = _SERVICE.match(stripped)
            if match is None:
                continue
            for argv in _commands("trainwire " + match.group(2))[:1]:
                found.append(Example(shown, number, (match.group(1), *argv)))
    return found


def documents(root: Path) -> list[Path]:
    """The markdown at the top of the repository (README.md, CONTRIBUTING.md, ...),
    clients/README.md and every markdown file under docs/, sorted."""
    found = sorted(root.glob("*.md"))
    client = root / "clients" / "README.md"
    if client.is_file():
        found.append(client)
    if (root / "docs").is_dir():
        found += sorted((root / "docs").rglob("*.md"))
    return found

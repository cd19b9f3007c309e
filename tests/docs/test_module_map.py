"""CONTRIBUTING.md's module map names every module of the services, the client package, the shared
operations code and the benchmarks once, and nothing that is not there."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: The folders the map covers, each with every folder below it.
MAPPED = ("gateway", "trainer_service", "trainwire_ops", "clients/trainwire", "bench")
#: Files that are code the map names: Python modules and the benchmarks' shell scripts.
SUFFIXES = (".py", ".sh")
#: Generated contract modules: the map names their package (``clients/trainwire/v1``) once.
GENERATED = re.compile(r"^clients/trainwire/v1/\w+_pb2(_grpc)?\.py$")
ENTRY = re.compile(r"^- `([^`]+)`: \S", re.MULTILINE)


def _map_section() -> str:
    text = (ROOT / "CONTRIBUTING.md").read_text(encoding="utf-8")
    start = text.index("\n## Module map\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def _modules() -> set[str]:
    found = set()
    for folder in MAPPED:
        for path in (ROOT / folder).rglob("*"):
            name = path.relative_to(ROOT).as_posix()
            if (
                path.is_file()
                and path.suffix in SUFFIXES
                and "__pycache__" not in path.parts
                and not GENERATED.match(name)
            ):
                found.add(name)
    return found


def test_every_module_has_one_line_and_every_line_a_module() -> None:
    entries = [
        name
        for name in ENTRY.findall(_map_section())
        if name.endswith(SUFFIXES) and name.startswith(MAPPED)
    ]
    doubled = sorted({name for name in entries if entries.count(name) > 1})
    modules = _modules()
    assert len(modules) > 100, "the map's folders were not found"
    assert not doubled, f"named more than once in the module map: {doubled}"
    missing = sorted(modules - set(entries))
    assert not missing, f"missing from CONTRIBUTING.md's module map: {missing}"
    gone = sorted(set(entries) - modules)
    assert not gone, f"the module map names files that do not exist: {gone}"

"""The page's files as shipped: every module the page imports is preloaded by index.html (the
browser asks for them all at once, not import by import), and nothing else is."""

from __future__ import annotations

import re
from html.parser import HTMLParser
from posixpath import dirname, join, normpath

from gateway.http.app import STATIC_DIR

#: ``import … from "x"``, ``export … from "x"`` and ``import "x"``, each starting a line; the page
#: calls no ``import()``.
_IMPORT = re.compile(
    r"""^\s*(?:(?:import|export)\b[^;"'`]*?\bfrom|import)\s*["']([^"']+)["']""", re.M
)


class _Head(HTMLParser):
    """The module scripts and the module preloads of a page, as URLs."""

    def __init__(self) -> None:
        super().__init__()
        self.scripts: list[str] = []
        self.preloads: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        if tag == "script" and found.get("type") == "module" and found.get("src"):
            self.scripts.append(str(found["src"]))
        if tag == "link" and found.get("rel") == "modulepreload" and found.get("href"):
            self.preloads.append(str(found["href"]))


def _file(url: str) -> str:
    assert url.startswith("/static/"), url
    return (STATIC_DIR / url.removeprefix("/static/")).read_text(encoding="utf-8")


def imports(url: str) -> list[str]:
    """The URLs of the modules that the module at ``url`` imports."""
    found = []
    for spec in _IMPORT.findall(_file(url)):
        assert spec.startswith("./") or spec.startswith("../"), f"{url} imports {spec}"
        found.append(normpath(join(dirname(url), spec)))
    return found


def module_graph(entries: list[str]) -> set[str]:
    """Every module that loading ``entries`` loads."""
    seen: set[str] = set()
    todo = list(entries)
    while todo:
        url = todo.pop()
        if url not in seen:
            seen.add(url)
            todo.extend(imports(url))
    return seen


def test_the_import_pattern_reads_the_page_s_import_lines() -> None:
    assert sorted(imports("/static/app.js")) == [
        "/static/compare.js",
        "/static/early.js",
        "/static/run.js",
        "/static/runs.js",
    ]
    assert "/static/vendor/uplot/uPlot.esm.js" in imports("/static/draw.js")
    assert "/static/early.js" in imports("/static/api.js")


def test_every_module_the_page_imports_is_preloaded_and_nothing_else() -> None:
    head = _Head()
    head.feed((STATIC_DIR / "index.html").read_text(encoding="utf-8"))
    assert head.scripts, "no module script"
    assert len(set(head.preloads)) == len(head.preloads), head.preloads
    graph = module_graph(head.scripts)
    assert "/static/vendor/uplot/uPlot.esm.js" in graph, graph
    assert set(head.preloads) == graph, {
        "not preloaded": sorted(graph - set(head.preloads)),
        "preloaded, never imported": sorted(set(head.preloads) - graph),
    }


def test_early_js_imports_nothing_so_it_runs_before_the_rest_has_loaded() -> None:
    assert imports("/static/early.js") == []

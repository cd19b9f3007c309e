"""The page's files as shipped and as served: every module the page imports is preloaded by
index.html (the browser asks for them all at once, not import by import), and nothing else is;
``PageFiles`` serves each file's bytes, gzipped to clients that take gzip, with revalidation."""

from __future__ import annotations

import gzip
import os
import re
from collections.abc import AsyncIterator
from html.parser import HTMLParser
from pathlib import Path
from posixpath import dirname, join, normpath

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from gateway.http.app import STATIC_DIR, STATIC_ROUTE, PageFiles
from tests.http.conftest import Http

pytestmark = pytest.mark.timeout(120)

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
        "/static/trainers.js",
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


# -- served ----------------------------------------------------------------------------------

GZIP = {"Accept-Encoding": "gzip, deflate, br"}
IDENTITY = {"Accept-Encoding": "identity"}


@pytest.fixture
async def raw(http: Http) -> AsyncIterator[aiohttp.ClientSession]:
    """A session to the gateway that leaves bodies as they came (gzip not undone)."""
    async with aiohttp.ClientSession(http.url, auto_decompress=False) as session:
        yield session


async def test_a_module_is_gzipped_for_a_client_that_takes_gzip_and_decodes_to_the_file(
    raw: aiohttp.ClientSession,
) -> None:
    file = (STATIC_DIR / "vendor" / "uplot" / "uPlot.esm.js").read_bytes()
    async with raw.get("/static/vendor/uplot/uPlot.esm.js", headers=GZIP) as response:
        assert response.status == 200
        assert response.headers["Content-Encoding"] == "gzip"
        assert response.headers["Vary"] == "Accept-Encoding"
        assert response.headers["Content-Type"] == "text/javascript; charset=utf-8"
        assert response.headers["Cache-Control"] == "no-cache"
        packed, tag = await response.read(), response.headers["ETag"]
    assert gzip.decompress(packed) == file and len(packed) < len(file) / 2
    async with raw.get("/static/vendor/uplot/uPlot.esm.js", headers=IDENTITY) as response:
        assert response.status == 200 and "Content-Encoding" not in response.headers
        assert response.headers["Vary"] == "Accept-Encoding"
        assert await response.read() == file
        assert response.headers["ETag"] != tag  # another representation, another tag


async def test_every_file_of_the_page_decodes_to_its_bytes(raw: aiohttp.ClientSession) -> None:
    names = ["/", *(f"/static/{p.relative_to(STATIC_DIR)}" for p in STATIC_DIR.rglob("*.*"))]
    for name in names:
        file = STATIC_DIR / ("index.html" if name == "/" else name.removeprefix("/static/"))
        async with raw.get(name, headers=GZIP) as response:
            assert response.status == 200, name
            body = await response.read()
            if response.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
        assert body == file.read_bytes(), name


async def test_a_matching_if_none_match_is_answered_304_for_that_representation_only(
    raw: aiohttp.ClientSession,
) -> None:
    async with raw.get("/", headers=GZIP) as response:
        assert response.headers["Content-Encoding"] == "gzip"
        tag = response.headers["ETag"]
    async with raw.get("/", headers={**GZIP, "If-None-Match": tag}) as response:
        assert response.status == 304 and response.headers["ETag"] == tag
        assert await response.read() == b""
    async with raw.get("/", headers={**GZIP, "If-None-Match": f'W/{tag}, "other"'}) as response:
        assert response.status == 304
    # The gzipped bytes' tag does not stand for the plain ones.
    async with raw.get("/", headers={**IDENTITY, "If-None-Match": tag}) as response:
        assert response.status == 200 and "Content-Encoding" not in response.headers
    async with raw.head("/static/app.js", headers=GZIP) as response:
        assert response.status == 200 and response.headers["Content-Encoding"] == "gzip"


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[tuple[TestClient, Path]]:
    """``PageFiles`` over a directory of the test's own, and a client of it."""
    root = tmp_path / "page"
    root.mkdir()
    files = PageFiles(root)
    app = web.Application()
    app.add_routes([web.get("/", files.index), web.get(STATIC_ROUTE, files.asset)])
    async with TestClient(TestServer(app), auto_decompress=False) as client:
        yield client, root


async def test_a_changed_file_is_read_again(served: tuple[TestClient, Path]) -> None:
    client, root = served
    (root / "a.js").write_text("export const a = 1;\n" * 50)
    first = await client.get("/static/a.js", headers=IDENTITY)
    assert first.status == 200 and await first.text() == "export const a = 1;\n" * 50
    (root / "a.js").write_text("export const a = 2;\n" * 50)
    stat = os.stat(root / "a.js")
    os.utime(root / "a.js", ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    second = await client.get(
        "/static/a.js", headers={**IDENTITY, "If-None-Match": first.headers["ETag"]}
    )
    assert second.status == 200 and await second.text() == "export const a = 2;\n" * 50
    assert second.headers["ETag"] != first.headers["ETag"]


async def test_a_file_gzip_does_not_shrink_goes_out_as_it_is(
    served: tuple[TestClient, Path],
) -> None:
    client, root = served
    (root / "tiny.css").write_text("a{}")
    response = await client.get("/static/tiny.css", headers=GZIP)
    assert response.status == 200 and await response.read() == b"a{}"
    assert "Content-Encoding" not in response.headers and "Vary" not in response.headers


async def test_gzip_refused_with_q_0_is_not_sent(served: tuple[TestClient, Path]) -> None:
    client, root = served
    (root / "index.html").write_text("<p>page</p>" * 100)
    refused = await client.get("/", headers={"Accept-Encoding": "gzip;q=0, identity"})
    assert "Content-Encoding" not in refused.headers
    assert await refused.text() == "<p>page</p>" * 100
    taken = await client.get("/", headers={"Accept-Encoding": "deflate, gzip;q=0.5"})
    assert taken.headers["Content-Encoding"] == "gzip"


async def test_nothing_but_the_directory_s_regular_files_is_served(
    served: tuple[TestClient, Path], tmp_path: Path
) -> None:
    client, root = served
    (tmp_path / "secret.txt").write_text("secret")
    (root / "link.txt").symlink_to(tmp_path / "secret.txt")
    (root / "inner").mkdir()
    (root / "inner" / "inside.txt").symlink_to(root / "tiny.txt")
    (root / "tiny.txt").write_text("tiny")
    for path in ["link.txt", "inner", "inner/inside.txt", "missing.js", "%2E%2E/secret.txt"]:
        response = await client.get(f"/static/{path}")
        assert response.status == 404, path
    assert (await client.get("/static/tiny.txt")).status == 200

"""The lazy image dataset: points 1-7 of its contract (see providers/grpo/lazy_images.py)."""

from __future__ import annotations

import copy
import hashlib
import json
import multiprocessing
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
from PIL import Image

from trainer_service.providers.grpo.lazy_images import (
    DatasetError,
    ImageCache,
    LazyImageDataset,
    RowTransform,
    resolve_cache_dir,
)

REPO = pathlib.Path(__file__).resolve().parents[2]


def _write_image(
    path: pathlib.Path, mode: str = "RGB", size: tuple[int, int] = (9, 7), seed: int = 0
) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    image = Image.new("RGB", size)
    image.putdata(
        [
            ((x * 31 + seed) % 256, (x * 7) % 256, (x * 3 + seed) % 256)
            for x in range(size[0] * size[1])
        ]
    )
    if mode == "P":
        image = image.convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
    elif mode != "RGB":
        image = image.convert(mode)
    image.save(path)


def _rows(n: int = 4, images_per_row: int = 1) -> list[dict]:
    rows = []
    for i in range(n):
        rows.append(
            {
                "prompt": [
                    {
                        "role": "user",
                        "content": [{"type": "image"}, {"type": "text", "text": f"q{i}"}],
                    }
                ],
                "image_paths": [f"img/{i}_{k}.png" for k in range(images_per_row)],
                "solution": f"s{i}",
                "assistant_response": "<answer>x</answer>",
                "extra": {"nested": [i]},
            }
        )
    return rows


@pytest.fixture
def data(tmp_path: pathlib.Path) -> pathlib.Path:
    """A data root with 4 one-image rows in rows.jsonl and a 2-image row set in multi.jsonl."""
    modes = ["RGB", "RGBA", "L", "P"]
    for i in range(4):
        for k in range(2):
            _write_image(tmp_path / "img" / f"{i}_{k}.png", modes[(i + k) % 4], seed=i * 2 + k)
    (tmp_path / "rows.jsonl").write_text("\n".join(json.dumps(r) for r in _rows()) + "\n")
    (tmp_path / "multi.jsonl").write_text("\n".join(json.dumps(r) for r in _rows(2, 2)) + "\n")
    return tmp_path


def _materialize(row: dict, base: pathlib.Path) -> dict:
    """The old, eager path: decode up front, same row transformation."""
    out = copy.deepcopy(row)
    paths = out.pop("image_paths")
    out.pop("assistant_response", None)
    images = [Image.open(base / p).convert("RGB") for p in paths]
    if len(images) == 1:
        out["image"] = images[0]
    else:
        out["images"] = images
    return out


# 1. A plain map-style class whose module imports without torch.


def test_module_imports_without_torch() -> None:
    script = textwrap.dedent(
        """
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name == "torch" or name.startswith("torch."):
                    raise ImportError("torch blocked for this test")
                return None
        sys.meta_path.insert(0, Block())
        import trainer_service.providers.grpo.lazy_images as m
        import trainer_service.providers.grpo as pkg
        assert "torch" not in sys.modules
        assert callable(pkg.validate)
        print("ok", m.LazyImageDataset.__name__)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert "ok LazyImageDataset" in done.stdout


def test_map_style(data: pathlib.Path) -> None:
    dataset = LazyImageDataset.from_jsonl(data / "rows.jsonl", data_root=data)
    assert len(dataset) == 4
    assert [dataset[i]["solution"] for i in range(len(dataset))] == ["s0", "s1", "s2", "s3"]
    with pytest.raises(IndexError):
        dataset[4]


# 2. __getitem__ is pure: deep copies, no mutation, same schema and order as the eager path.


def test_getitem_pure_and_schema_matches_materialized(data: pathlib.Path) -> None:
    rows = _rows()
    original = copy.deepcopy(rows)
    dataset = LazyImageDataset(rows, data, memo_rows=2)
    rows[0]["solution"] = "mutated after construction"  # construction deep-copied the rows
    for i, row in enumerate(original):
        got = dataset[i]
        expected = _materialize(row, data)
        assert list(got) == list(expected)
        assert "image_paths" not in got and "assistant_response" not in got
        assert got["image"].tobytes() == expected["image"].tobytes()
        got["extra"]["nested"].append("x")  # mutating a returned row must not leak back
        got["prompt"][0]["content"].clear()
        again = dataset[i]
        assert again["extra"] == {"nested": [i]}
        assert again["prompt"] == row["prompt"]
        assert again["image"] is not got["image"]
    stored = [dataset._checker.source.load(i) for i in range(len(dataset))]
    assert stored == original  # stored rows never mutated
    assert all(type(r) is dict for r in stored)


def test_several_images_set_images(data: pathlib.Path) -> None:
    dataset = LazyImageDataset.from_jsonl(data / "multi.jsonl", data_root=data)
    row = dataset[1]
    assert "image" not in row
    assert [im.tobytes() for im in row["images"]] == [
        Image.open(data / f"img/1_{k}.png").convert("RGB").tobytes() for k in range(2)
    ]


def test_row_transform_builds_batches_from_indices(data: pathlib.Path) -> None:
    rows = _rows(2) + _rows(2, 2)[1:]
    transform = RowTransform(LazyImageDataset(rows, data))
    out = transform({"_i": [0, 0, 2]})
    assert out["solution"] == ["s0", "s0", "s1"]
    # A batch mixing one- and two-image rows uses "images" throughout (TRL reads the first row).
    assert "image" not in out and [len(x) for x in out["images"]] == [1, 1, 2]


# 3. Opening parses nothing; a row is checked when read (or by check_rows), naming its line and
#    image path.


@pytest.mark.parametrize("paths", [None, [], "img/0_0.png", [""], [3]])
def test_missing_or_empty_image_paths_name_the_row(data: pathlib.Path, paths: object) -> None:
    rows = _rows(3)
    if paths is None:
        del rows[2]["image_paths"]
    else:
        rows[2]["image_paths"] = paths
    dataset = LazyImageDataset(rows, data)
    assert dataset[1]["solution"] == "s1"  # the good rows stay readable
    with pytest.raises(DatasetError, match="row 3") as info:
        dataset[2]
    assert (info.value.row, info.value.line) == (2, 3)
    assert info.value.code == "FAILED_PRECONDITION"
    with pytest.raises(DatasetError, match="row 3"):
        dataset.check_rows()


def test_image_paths_escaping_root_name_the_row(
    data: pathlib.Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    outside = tmp_path_factory.mktemp("outside")
    _write_image(outside / "secret.png")
    (data / "img" / "link.png").symlink_to(outside / "secret.png")
    (data / "img" / "inside_link.png").symlink_to(data / "img" / "0_0.png")
    (data / "dirlink").symlink_to(outside, target_is_directory=True)
    for bad in [
        "../outside.png",
        str(outside / "secret.png"),
        "img/link.png",
        "img/../../x.png",
        "dirlink/secret.png",
    ]:
        rows = _rows(2)
        rows[1]["image_paths"] = [bad]
        dataset = LazyImageDataset(rows, data)
        with pytest.raises(DatasetError, match="row 2: image") as info:
            dataset[1]
        assert repr(bad) in info.value.user_message
    rows = _rows(2)
    rows[1]["image_paths"] = ["img/inside_link.png"]
    assert LazyImageDataset(rows, data)[1]["image"].size == (9, 7)


def test_absolute_image_paths_inside_any_data_root_are_read(
    data: pathlib.Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    shared = tmp_path_factory.mktemp("shared")
    _write_image(shared / "far.png")
    rows = _rows(3)
    rows[1]["image_paths"] = [str(data / "img" / "1_0.png")]  # absolute, in the first root
    rows[2]["image_paths"] = [str(shared / "far.png")]  # absolute, in the second root
    dataset = LazyImageDataset(rows, data, data_root=[data, shared])
    assert [dataset[i]["image"].size for i in (1, 2)] == [(9, 7), (9, 7)]
    assert dataset.check_rows() == 3
    only_first = LazyImageDataset(rows, data, data_root=data)
    with pytest.raises(DatasetError, match="row 3: image") as info:
        only_first[2]
    assert info.value.user_message.endswith("leads outside the data root.")
    assert str(data) in info.value.detail  # the log names the roots; the user, the row's path


def test_unreadable_image_names_the_line_and_the_image(data: pathlib.Path) -> None:
    (data / "img" / "3_0.png").write_bytes(b"not a png")
    dataset = LazyImageDataset.from_jsonl(data / "rows.jsonl", data_root=data)
    with pytest.raises(DatasetError) as info:
        dataset[3]
    assert info.value.user_message == (
        "Dataset line 4 of rows.jsonl: image 'img/3_0.png' could not be read."
    )
    assert (info.value.row, info.value.line) == (3, 4)
    assert str(data) not in str(info.value)  # no server paths in the user message
    assert dataset.check_rows() == 4  # the row itself is well formed: only decoding fails


def test_bad_jsonl_lines_are_named_when_read(data: pathlib.Path) -> None:
    lines = ['{"image_paths": ["img/0_0.png"]}', "", "[1, 2]", "  ", "{not json"]
    (data / "bad.jsonl").write_text("\n".join([*lines, '{"image_paths": ["img/1_0.png"]}']))
    dataset = LazyImageDataset.from_jsonl(data / "bad.jsonl", data_root=data)
    assert len(dataset) == 4  # blank and whitespace-only lines are not rows
    assert dataset[0]["image"].size == (9, 7)
    assert dataset[3]["image"].size == (9, 7)  # the last line needs no newline
    with pytest.raises(DatasetError, match=r"^Dataset line 3 of bad\.jsonl is not a JSON object"):
        dataset[1]
    with pytest.raises(DatasetError, match=r"^Dataset line 5 of bad\.jsonl is not valid JSON"):
        dataset[2]
    with pytest.raises(DatasetError, match=r"line 3 of bad\.jsonl") as info:
        dataset.check_rows()
    assert info.value.line == 3
    with pytest.raises(DatasetError, match="could not be read"):
        LazyImageDataset.from_jsonl(data / "absent.jsonl", data_root=data)
    (data / "empty.jsonl").write_text("\n \r\n")
    with pytest.raises(DatasetError, match="has no rows"):
        LazyImageDataset.from_jsonl(data / "empty.jsonl", data_root=data)


def test_crlf_and_utf8_lines(data: pathlib.Path) -> None:
    rows = _rows(2)
    rows[1]["solution"] = "rouge \u00e9"
    text = "\r\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\r\n\r\n"
    (data / "crlf.jsonl").write_bytes(text.encode("utf-8"))
    dataset = LazyImageDataset.from_jsonl(data / "crlf.jsonl", data_root=data)
    assert len(dataset) == 2
    assert dataset[1]["solution"] == "rouge \u00e9"
    (data / "latin1.jsonl").write_bytes(b'{"image_paths": ["img/0_0.png"], "s": "\xe9"}\n')
    with pytest.raises(DatasetError, match=r"line 1 of latin1\.jsonl is not valid JSON"):
        LazyImageDataset.from_jsonl(data / "latin1.jsonl", data_root=data)[0]


def test_opening_parses_no_row_and_reading_parses_one(
    data: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import trainer_service.providers.grpo.rows as rows_module

    lines = [json.dumps(r) for r in _rows()] * 250  # 1000 rows sharing four images
    (data / "big.jsonl").write_text("\n".join(lines) + "\n")
    parsed: list[bytes] = []
    real_loads = json.loads

    def counting_loads(text: bytes) -> object:
        parsed.append(text)
        return real_loads(text)

    monkeypatch.setattr(rows_module.json, "loads", counting_loads)
    resolved: list[pathlib.Path] = []
    real_resolve = pathlib.Path.resolve

    def counting_resolve(self: pathlib.Path, strict: bool = False) -> pathlib.Path:
        resolved.append(self)
        return real_resolve(self, strict)

    monkeypatch.setattr(pathlib.Path, "resolve", counting_resolve)
    realpaths: list[str] = []
    real_realpath = os.path.realpath

    def counting_realpath(path: str, **kwargs: object) -> str:
        if isinstance(path, str):  # Path.resolve calls it too, with a Path (counted above)
            realpaths.append(path)
        return real_realpath(path, **kwargs)

    monkeypatch.setattr(rows_module.os.path, "realpath", counting_realpath)
    dataset = LazyImageDataset.from_jsonl(data / "big.jsonl", data_root=data)
    assert len(dataset) == 1000
    assert parsed == []  # nothing parsed up front: opening is one read and one scan
    assert len(resolved) <= 2  # the dataset directory and the data root, not one per row
    assert dataset[999]["solution"] == "s3"
    assert parsed == [lines[999].encode()]
    assert dataset.check_rows() == 1000
    assert len(parsed) == 1001
    # The one image directory is resolved once, not once per row.
    assert len(resolved) <= 2 and len(realpaths) == 1, (resolved, realpaths)


def test_check_rows_stops_when_asked(data: pathlib.Path) -> None:
    import threading

    rows = _rows(3)
    del rows[2]["image_paths"]
    stop = threading.Event()
    stop.set()
    assert LazyImageDataset(rows, data).check_rows(stop) == 0


# 4. Without a cache: Image.open(path).convert("RGB"), pixel for pixel.


def test_pixels_identical_to_plain_decode(data: pathlib.Path) -> None:
    dataset = LazyImageDataset.from_jsonl(data / "rows.jsonl", data_root=data)
    for i in range(4):  # RGB, RGBA, L and palette sources
        plain = Image.open(data / f"img/{i}_0.png").convert("RGB")
        got = dataset[i]["image"]
        assert got.mode == "RGB" and got.size == plain.size
        assert got.tobytes() == plain.tobytes()


# 5. The disk cache.


def test_cache_layout_hit_equals_miss(
    data: pathlib.Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    cache_dir = tmp_path_factory.mktemp("cache")
    miss = LazyImageDataset.from_jsonl(data / "rows.jsonl", data_root=data, cache_dir=cache_dir)
    missed = [miss[i]["image"].tobytes() for i in range(4)]
    assert miss.stats.cache_misses == 4 and miss.stats.cache_hits == 0
    for i in range(4):
        key = hashlib.sha256((data / f"img/{i}_0.png").read_bytes()).hexdigest()
        entry = cache_dir / key[:2] / f"{key}.png"
        assert entry.is_file()
        with Image.open(entry) as stored:
            assert stored.format == "PNG"
    assert not [p for p in cache_dir.rglob("*") if p.name.endswith(".tmp")]
    hit = LazyImageDataset.from_jsonl(data / "rows.jsonl", data_root=data, cache_dir=cache_dir)
    assert [hit[i]["image"].tobytes() for i in range(4)] == missed
    assert hit.stats.cache_hits == 4 and hit.stats.cache_misses == 0
    plain = [Image.open(data / f"img/{i}_0.png").convert("RGB").tobytes() for i in range(4)]
    assert missed == plain


def test_cache_key_is_content_not_path(
    data: pathlib.Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    cache_dir = tmp_path_factory.mktemp("cache")
    rows = _rows(2)
    (data / "img" / "copy.png").write_bytes((data / "img" / "0_0.png").read_bytes())
    rows[1]["image_paths"] = ["img/copy.png"]
    dataset = LazyImageDataset(rows, data, cache_dir=cache_dir)
    dataset[0]
    dataset[1]  # same bytes under another name: a hit
    assert (dataset.stats.cache_misses, dataset.stats.cache_hits) == (1, 1)
    os.utime(data / "img" / "0_0.png", (1, 1))  # a new mtime does not invalidate the entry
    dataset[0]
    assert dataset.stats.cache_hits == 2


def test_unreadable_cache_entry_is_rewritten(
    data: pathlib.Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    cache_dir = tmp_path_factory.mktemp("cache")
    source = data / "img" / "1_0.png"
    key = hashlib.sha256(source.read_bytes()).hexdigest()
    entry = cache_dir / key[:2] / f"{key}.png"
    entry.parent.mkdir(parents=True)
    entry.write_bytes(b"\x89PNG\r\n\x1a\n torn")
    dataset = LazyImageDataset.from_jsonl(data / "rows.jsonl", data_root=data, cache_dir=cache_dir)
    assert dataset[1]["image"].tobytes() == Image.open(source).convert("RGB").tobytes()
    assert dataset.stats.cache_rewrites == 1
    with Image.open(entry) as repaired:
        assert repaired.convert("RGB").tobytes() == Image.open(source).convert("RGB").tobytes()


def test_cache_temp_file_is_unique_per_process_and_atomic(
    data: pathlib.Path, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache_dir = tmp_path_factory.mktemp("cache")
    published: list[tuple[str, str]] = []
    real_replace = os.replace

    def spy(src: str, dst: str) -> None:
        assert pathlib.Path(src).is_file() and not pathlib.Path(dst).exists()
        published.append((str(src), str(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", spy)
    LazyImageDataset(_rows(1), data, cache_dir=cache_dir)[0]
    ((src, dst),) = published
    assert pathlib.Path(src).parent == pathlib.Path(dst).parent  # same filesystem: atomic rename
    assert f".{os.getpid()}." in pathlib.Path(src).name


def _hammer(args: tuple[str, str, int]) -> bytes:
    source, cache_dir, rounds = args
    from trainer_service.providers.grpo.lazy_images import DecodeStats

    cache = ImageCache(pathlib.Path(cache_dir))
    out = b""
    for _ in range(rounds):
        entry = cache.entry_path(hashlib.sha256(pathlib.Path(source).read_bytes()).hexdigest())
        if entry.exists():
            entry.unlink(missing_ok=True)  # force every round to write the same key again
        out = cache.load(pathlib.Path(source), DecodeStats()).tobytes()
    return out


def test_concurrent_writers_never_publish_a_torn_entry(
    data: pathlib.Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    cache_dir = tmp_path_factory.mktemp("cache")
    source = data / "img" / "2_0.png"
    # Not "fork": other tests in this process run gRPC servers, and forking them is unsafe.
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        results = pool.map(_hammer, [(str(source), str(cache_dir), 20)] * 4)
    expected = Image.open(source).convert("RGB").tobytes()
    assert results == [expected] * 4
    key = hashlib.sha256(source.read_bytes()).hexdigest()
    entries = [p for p in cache_dir.rglob("*") if p.is_file()]
    assert [p.name for p in entries] in ([f"{key}.png"], [])
    assert not [p for p in entries if p.name.endswith(".tmp")]


def test_cache_dir_from_flag_or_env(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    monkeypatch.delenv("TRAINWIRE_IMAGE_CACHE_DIR", raising=False)
    assert resolve_cache_dir(None) is None
    monkeypatch.setenv("TRAINWIRE_IMAGE_CACHE_DIR", str(tmp_path / "env"))
    assert resolve_cache_dir(None) == tmp_path / "env"
    assert resolve_cache_dir(tmp_path / "flag") == tmp_path / "flag"


# 7. The per-process memo: each row decoded once per process per step.


def _decodes_per_unique_row(memo_rows: int, data: pathlib.Path, generations: int = 4) -> float:
    from trl.trainer.utils import RepeatSampler

    dataset = LazyImageDataset.from_jsonl(data / "rows.jsonl", data_root=data, memo_rows=memo_rows)
    transform = RowTransform(dataset)
    sampler = list(RepeatSampler(range(4), mini_repeat_count=generations, batch_size=2, seed=3))
    step = 2 * generations
    for start in range(0, len(sampler), step):  # one generation batch per step
        transform({"_i": sampler[start : start + step]})
    return dataset.stats.decodes_per_unique_row()


def test_memo_decodes_each_row_once_per_step(data: pathlib.Path) -> None:
    without, with_memo = _decodes_per_unique_row(0, data), _decodes_per_unique_row(2, data)
    assert without == 4.0  # RepeatSampler repeats each index num_generations times
    assert with_memo == 1.0


def test_memo_is_not_shipped_to_worker_processes(data: pathlib.Path) -> None:
    dataset = LazyImageDataset.from_jsonl(
        data / "rows.jsonl", data_root=data, memo_rows=4, provenance_key="_p"
    )
    dataset[0]
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        child = pool.apply(dataset.__getitem__, (0,))
    assert child["_p"]["pid"] != os.getpid()
    assert child["_p"]["decodes"] == 1  # decoded afresh in the child, not served from our memo
    assert dataset.stats.decodes == 1 and len(dataset._memo) == 1


def test_memo_and_counters_reset_after_a_fork(data: pathlib.Path) -> None:
    dataset = LazyImageDataset.from_jsonl(data / "rows.jsonl", data_root=data, memo_rows=4)
    dataset[0]
    assert len(dataset._memo) == 1
    dataset._stats.pid = -1  # what a forked worker sees: counters of another process
    assert dataset.stats.pid == os.getpid() and dataset.stats.decodes == 0
    assert not dataset._memo


@pytest.mark.parametrize("prompt", [3, [], ["hi"], [{"role": "user"}], [{"content": "x"}]])
def test_a_prompt_that_is_not_chat_messages_names_the_row(
    data: pathlib.Path, prompt: object
) -> None:
    rows = _rows(3)
    rows[1]["prompt"] = prompt
    dataset = LazyImageDataset(rows, data)
    with pytest.raises(DatasetError, match="row 2: prompt must be a list of chat messages"):
        dataset[1]
    rows[1]["prompt"] = [{"role": "user", "content": [{"type": "text", "text": "What colour?"}]}]
    assert LazyImageDataset(rows, data)[1]["prompt"] == rows[1]["prompt"]

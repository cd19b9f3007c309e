"""Data in the formats people have: Parquet files and ``save_to_disk`` directories of Hugging Face
``Image()`` values, columns renamed by the task, opened without reading rows and checked per row
with the JSONL path's rules (see providers/grpo/rows.py and table_rows.py)."""

from __future__ import annotations

import hashlib
import io
import multiprocessing
import os
import pathlib
import pickle
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from trainer_service.providers.grpo.lazy_images import (
    Columns,
    DatasetError,
    LazyImageDataset,
    RowTransform,
)
from trainer_service.providers.grpo.table_rows import ParquetRows, SavedRows


def _png(seed: int, size: tuple[int, int] = (6, 5)) -> bytes:
    image = Image.new("RGB", size)
    image.putdata([((x * 37 + seed * 11) % 256, (x * 5) % 256, seed % 256) for x in range(30)])
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def _rgb(data: bytes) -> bytes:
    with Image.open(io.BytesIO(data)) as image:
        return image.convert("RGB").tobytes()


_IMAGE = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
_PART = pa.struct([("type", pa.string()), ("text", pa.string())])
_MESSAGES = pa.list_(pa.struct([("role", pa.string()), ("content", pa.list_(_PART))]))


def _chat(i: int) -> list[dict[str, Any]]:
    # As Arrow stores it: every part has every key, nulls filled in.
    content = [{"type": "image", "text": None}, {"type": "text", "text": f"q{i}"}]
    return [{"role": "user", "content": content}]


def _write(
    path: pathlib.Path, columns: dict[str, tuple[pa.DataType, list[Any]]], group: int
) -> None:
    table = pa.table({name: pa.array(values, type) for name, (type, values) in columns.items()})
    pq.write_table(table, path, row_group_size=group)


@pytest.fixture
def root(tmp_path: pathlib.Path) -> pathlib.Path:
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "a.png").write_bytes(_png(100))
    return tmp_path


def _parquet(root: pathlib.Path, n: int = 10, group: int = 4) -> pathlib.Path:
    """``n`` rows: chat prompts, one Image() value each (row 3 a path-only value), solutions,
    an extra column."""
    images: list[dict[str, Any]] = [{"bytes": _png(i), "path": f"orig/{i}.png"} for i in range(n)]
    images[2] = {"bytes": None, "path": "img/a.png"}
    path = root / "train.parquet"
    _write(
        path,
        {
            "prompt": (_MESSAGES, [_chat(i) for i in range(n)]),
            "image": (_IMAGE, images),
            "solution": (pa.string(), [f"s{i}" for i in range(n)]),
            "extra": (pa.int64(), list(range(n))),
        },
        group,
    )
    return path


# Opening reads metadata only; a row reads its row group, once for the rows of that group.


def test_parquet_opens_without_reading_a_row_group(
    root: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _parquet(root, n=10, group=4)
    reads: list[int] = []
    real = pq.ParquetFile.read_row_group

    def counting(self: pq.ParquetFile, group: int, *args: Any, **kwargs: Any) -> pa.Table:
        reads.append(group)
        return real(self, group, *args, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", counting)
    dataset = LazyImageDataset.open(path, data_root=root)
    assert len(dataset) == 10 and reads == []
    assert [dataset[i]["solution"] for i in (0, 1, 3)] == ["s0", "s1", "s3"]
    assert reads == [0]  # one read for the rows of group 0
    assert dataset[9]["extra"] == 9 and reads == [0, 2]
    assert dataset.check_rows() == 10
    assert reads == [0, 2]  # the full check streams the file on its own reader


def test_parquet_rows_are_what_trl_reads(root: pathlib.Path) -> None:
    dataset = LazyImageDataset.open(_parquet(root), data_root=root)
    row = dataset[1]
    assert list(row) == ["prompt", "solution", "extra", "image"]
    # The nulls Arrow filled in are gone: TRL sees the placeholder it expects.
    assert row["prompt"] == [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "q1"}]}
    ]
    assert row["image"].mode == "RGB" and row["image"].tobytes() == _rgb(_png(1))
    # A value with a path only is a path, relative to the file's directory.
    assert dataset[2]["image"].tobytes() == _rgb(_png(100))


def test_string_prompts_lists_of_images_and_raw_bytes(root: pathlib.Path) -> None:
    path = root / "multi.parquet"
    _write(
        path,
        {
            "prompt": (pa.string(), ["What colour?", "And here?"]),
            "images": (
                pa.list_(_IMAGE),
                [[{"bytes": _png(1), "path": None}, {"bytes": _png(2), "path": None}], []],
            ),
        },
        100,
    )
    dataset = LazyImageDataset.open(path, data_root=root)
    row = dataset[0]
    assert row["prompt"] == [{"role": "user", "content": "What colour?"}]
    assert [im.tobytes() for im in row["images"]] == [_rgb(_png(1)), _rgb(_png(2))]
    with pytest.raises(DatasetError) as info:
        dataset[1]
    assert info.value.user_message == (
        "Dataset row 2 of multi.parquet, column 'images': no images (an empty list)."
    )
    assert (info.value.row, info.value.line) == (1, 2)
    raw = root / "raw.parquet"
    _write(raw, {"prompt": (pa.string(), ["q"]), "image": (pa.binary(), [_png(3)])}, 10)
    assert LazyImageDataset.open(raw, data_root=root)[0]["image"].tobytes() == _rgb(_png(3))


def test_columns_are_renamed_and_a_missing_one_is_named_at_open(root: pathlib.Path) -> None:
    path = root / "own.parquet"
    _write(
        path,
        {
            "question": (pa.string(), ["q0"]),
            "picture": (_IMAGE, [{"bytes": _png(0), "path": None}]),
            "answer": (pa.string(), ["red"]),
            "solution": (pa.string(), ["not the answer column"]),
        },
        10,
    )
    columns = Columns(prompt="question", images="picture", solution="answer")
    row = LazyImageDataset.open(path, data_root=root, columns=columns)[0]
    assert row["prompt"] == [{"role": "user", "content": "q0"}]
    assert row["solution"] == "red" and "answer" not in row and "question" not in row
    assert row["image"].tobytes() == _rgb(_png(0)) and "picture" not in row
    with pytest.raises(DatasetError) as info:
        LazyImageDataset.open(path, data_root=root, columns=Columns(images="pics"))
    message = info.value.user_message
    assert message.startswith("The dataset own.parquet has no column 'pics' (columns.images)")
    assert "'picture'" in message
    with pytest.raises(DatasetError, match="no images column"):
        LazyImageDataset.open(path, data_root=root, columns=Columns(prompt="question"))
    with pytest.raises(DatasetError, match="has no column 'prompt'"):
        LazyImageDataset.open(path, data_root=root, columns=Columns(images="picture"))


def test_columns_renamed_in_jsonl_rows_are_checked_per_row(root: pathlib.Path) -> None:
    rows = [
        {"question": "q0", "pics": ["img/a.png"], "answer": "a"},
        {"question": "q1", "pics": ["img/a.png"]},
    ]
    columns = Columns(prompt="question", images="pics", solution="answer")
    dataset = LazyImageDataset(rows, root, columns=columns)
    assert dataset[0]["solution"] == "a" and dataset[0]["image"].size == (6, 5)
    with pytest.raises(DatasetError) as info:
        dataset[1]
    assert info.value.user_message == "Dataset row 2 has no column 'answer' (columns.solution)."


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ({"bytes": b"not an image", "path": "cat.png"}, "image 'cat.png' could not be read."),
        ({"bytes": b"not an image", "path": None}, "image 1 could not be read."),
        ({"bytes": None, "path": "../secret.png"}, "image '../secret.png' must be relative"),
        ({"bytes": None, "path": "/etc/passwd"}, "image '/etc/passwd' leads outside the data"),
        ({"bytes": None, "path": None}, "image 1 is neither a path nor an image"),
    ],
)
def test_a_bad_row_names_the_row_the_file_and_the_column(
    root: pathlib.Path, value: dict[str, Any], problem: str
) -> None:
    good = {"bytes": _png(0), "path": None}
    path = root / "train.parquet"
    _write(
        path,
        {"prompt": (pa.string(), ["a"] * 8), "image": (_IMAGE, [good] * 6 + [value, good])},
        3,
    )
    dataset = LazyImageDataset.open(path, data_root=root)
    assert dataset[5]["image"].size == (6, 5)
    with pytest.raises(DatasetError) as info:
        dataset[6]
    assert info.value.user_message.startswith(
        f"Dataset row 7 of train.parquet, column 'image': {problem}"
    ), info.value.user_message
    assert str(root) not in info.value.user_message
    if "could not be read" not in problem:  # a decoding failure shows only when decoding
        with pytest.raises(DatasetError, match=r"row 7 of train\.parquet"):
            dataset.check_rows()


def test_unreadable_and_empty_files(root: pathlib.Path) -> None:
    (root / "bad.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(DatasetError, match=r"bad\.parquet could not be read as Parquet"):
        LazyImageDataset.open(root / "bad.parquet", data_root=root)
    _write(root / "empty.parquet", {"prompt": (pa.string(), []), "image": (_IMAGE, [])}, 10)
    with pytest.raises(DatasetError, match="has no rows"):
        LazyImageDataset.open(root / "empty.parquet", data_root=root)
    (root / "not-a-dataset").mkdir()
    with pytest.raises(DatasetError, match="not a dataset written by datasets' save_to_disk"):
        LazyImageDataset.open(root / "not-a-dataset", data_root=root)


def test_bytes_are_cached_by_their_sha256(
    root: pathlib.Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    cache_dir = tmp_path_factory.mktemp("cache")
    path = _parquet(root, n=4)
    miss = LazyImageDataset.open(path, data_root=root, cache_dir=cache_dir)
    pixels = miss[0]["image"].tobytes()
    assert (miss.stats.cache_misses, miss.stats.cache_hits) == (1, 0)
    key = hashlib.sha256(_png(0)).hexdigest()
    assert (cache_dir / key[:2] / f"{key}.png").is_file()
    hit = LazyImageDataset.open(path, data_root=root, cache_dir=cache_dir)
    assert hit[0]["image"].tobytes() == pixels == _rgb(_png(0))
    assert (hit.stats.cache_misses, hit.stats.cache_hits) == (0, 1)


# save_to_disk directories: memory-mapped, images never decoded by datasets.


def _saved(
    root: pathlib.Path, n: int = 5, split: str | None = None, name: str = "saved"
) -> pathlib.Path:
    import datasets

    table = datasets.Dataset.from_dict(
        {
            "prompt": [_chat(i) for i in range(n)],
            "images": [[{"bytes": _png(i), "path": None}] for i in range(n)],
            "solution": [f"s{i}" for i in range(n)],
        },
        features=datasets.Features(
            {
                "prompt": [
                    {
                        "role": datasets.Value("string"),
                        "content": [
                            {"type": datasets.Value("string"), "text": datasets.Value("string")}
                        ],
                    }
                ],
                "images": datasets.Sequence(datasets.Image()),
                "solution": datasets.Value("string"),
            }
        ),
    )
    directory = root / name
    if split is None:
        table.save_to_disk(str(directory))
    else:
        datasets.DatasetDict({split: table, "test": table.select([0])}).save_to_disk(str(directory))
    return directory


def test_save_to_disk_directory(root: pathlib.Path) -> None:
    directory = _saved(root)
    dataset = LazyImageDataset.open(directory, data_root=root)
    assert len(dataset) == 5 and dataset._checker.source.columns == (
        "prompt",
        "images",
        "solution",
    )
    row = dataset[3]
    # One image in an "images" list: TRL reads it as "image", like a one-image JSONL row.
    assert row["image"].tobytes() == _rgb(_png(3)) and row["solution"] == "s3"
    assert row["prompt"][0]["content"][0] == {"type": "image"}
    # The source hands over the stored struct, not a decoded image.
    assert dataset._checker.source.load(3)["images"] == [{"bytes": _png(3), "path": None}]
    assert dataset.check_rows() == 5
    transform = RowTransform(dataset)
    assert transform({"_i": [0, 4]})["solution"] == ["s0", "s4"]


def test_a_dataset_dict_trains_on_its_train_split(root: pathlib.Path) -> None:
    dataset = LazyImageDataset.open(_saved(root, n=3, split="train"), data_root=root)
    assert len(dataset) == 3
    with pytest.raises(DatasetError, match="no 'train' split"):
        SavedRows(_saved(root, n=3, split="validation", name="no-train"))


def _read_in_child(dataset: LazyImageDataset) -> tuple[int, bytes, str]:
    row = dataset[len(dataset) - 1]
    return os.getpid(), row["image"].tobytes(), row["solution"]


def test_both_sources_pickle_small_and_read_in_another_process(root: pathlib.Path) -> None:
    parquet = LazyImageDataset.open(_parquet(root, n=6, group=2), data_root=root)
    saved = LazyImageDataset.open(_saved(root), data_root=root)
    parquet[0]  # a row group cached here must not travel
    assert len(pickle.dumps(parquet._checker.source)) < 2000
    assert len(pickle.dumps(saved._checker.source)) < 20000
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        pid, pixels, solution = pool.apply(_read_in_child, (parquet,))
        assert pid != os.getpid() and (pixels, solution) == (_rgb(_png(5)), "s5")
        _, pixels, solution = pool.apply(_read_in_child, (saved,))
        assert (pixels, solution) == (_rgb(_png(4)), "s4")


def test_parquet_rows_reopen_after_unpickling(root: pathlib.Path) -> None:
    rows = ParquetRows(_parquet(root, n=6, group=2))
    rows.load(0)
    copy = pickle.loads(pickle.dumps(rows))
    assert copy.load(5)["solution"] == "s5" and copy.where(5) == "row 6 of train.parquet"


def test_jsonl_rows_take_the_same_forms(root: pathlib.Path) -> None:
    rows: list[dict[str, Any]] = [
        {"prompt": "What colour?", "image": "img/a.png"},  # a string prompt, one path
        {"prompt": "And this?", "images": [{"path": "img/a.png"}, "img/a.png"]},
        {"prompt": "None?", "images": "img/a.png", "image_paths": ["img/a.png"]},
        {"prompt": "Empty?", "images": []},
    ]
    dataset = LazyImageDataset(rows, root)
    assert dataset[0]["prompt"] == [{"role": "user", "content": "What colour?"}]
    assert dataset[0]["image"].tobytes() == _rgb(_png(100))
    assert len(dataset[1]["images"]) == 2
    # "images" comes first; image_paths is then a column like any other.
    assert dataset[2]["image_paths"] == ["img/a.png"] and dataset[2]["image"].size == (6, 5)
    with pytest.raises(DatasetError) as info:
        dataset[3]
    assert info.value.user_message == "Dataset row 4, column 'images': no images (an empty list)."

"""Columnar GRPO datasets for tests: the demo rows as Hugging Face ``datasets`` would hold them.

:func:`write_parquet` writes a ``.parquet`` file whose images are ``Image()`` values (encoded
bytes inside the file), whose prompt is a plain string and whose columns have names of their own
(``question``, ``picture``, ``answer``: the task renames them with ``GrpoTask.columns``).
:func:`write_saved` writes a ``save_to_disk`` directory with the default names: a conversational
``prompt`` (image placeholders, as Arrow stores them: every part has every key, nulls filled in),
``images`` a list of ``Image()`` values, and ``solution``. Both keep the demo's extra columns
(``colour``, ``shape``), which reach reward functions.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

#: The Parquet dataset's own column names, as ``GrpoTask.columns`` maps them.
PARQUET_COLUMNS = {"prompt": "question", "images": "picture", "solution": "answer"}


def demo_rows(jsonl: pathlib.Path) -> list[dict[str, Any]]:
    """The rows of a demo JSONL dataset (``make_demo_dataset``), each image's bytes read."""
    rows = []
    for line in jsonl.read_text().splitlines():
        row = json.loads(line)
        row["image_bytes"] = [(jsonl.parent / p).read_bytes() for p in row["image_paths"]]
        rows.append(row)
    return rows


def _question(row: dict[str, Any]) -> str:
    (message,) = row["prompt"]
    return "".join(part.get("text", "") for part in message["content"])


def write_parquet(
    jsonl: pathlib.Path, path: pathlib.Path, *, rows_per_group: int = 100, repeat: int = 1
) -> pathlib.Path:
    """Writes the demo dataset as Parquet (see the module docstring); ``repeat`` copies of its
    rows, ``rows_per_group`` rows per row group (``datasets`` writes image datasets 100 a
    group)."""
    import datasets

    rows = demo_rows(jsonl) * repeat
    features = datasets.Features(
        {
            "question": datasets.Value("string"),
            "picture": datasets.Image(),
            "answer": datasets.Value("string"),
            "colour": datasets.Value("string"),
            "shape": datasets.Value("string"),
        }
    )
    table = datasets.Dataset.from_dict(
        {
            "question": [_question(r) for r in rows],
            "picture": [{"bytes": r["image_bytes"][0], "path": None} for r in rows],
            "answer": [r["solution"] for r in rows],
            "colour": [r["colour"] for r in rows],
            "shape": [r["shape"] for r in rows],
        },
        features=features,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    table.to_parquet(str(path), batch_size=rows_per_group)
    return path


def write_saved(jsonl: pathlib.Path, directory: pathlib.Path, *, repeat: int = 1) -> pathlib.Path:
    """Writes the demo dataset with ``save_to_disk`` (see the module docstring)."""
    import datasets

    rows = demo_rows(jsonl) * repeat
    features = datasets.Features(
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
            "colour": datasets.Value("string"),
            "shape": datasets.Value("string"),
        }
    )
    table = datasets.Dataset.from_dict(
        {
            "prompt": [r["prompt"] for r in rows],
            "images": [[{"bytes": b, "path": None} for b in r["image_bytes"]] for r in rows],
            "solution": [r["solution"] for r in rows],
            "colour": [r["colour"] for r in rows],
            "shape": [r["shape"] for r in rows],
        },
        features=features,
    )
    table.save_to_disk(str(directory))
    return directory

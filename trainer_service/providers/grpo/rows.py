"""Dataset rows for the lazy image dataset: indexed without parsing, parsed and checked on access.

A row source (:class:`RowSource`) knows how many rows there are and loads one by index: a JSONL
file (:class:`JsonlRows`: one read of the file and one vectorised scan for its line boundaries,
a few milliseconds even at 46,000 rows), in-memory rows (:class:`ListRows`), or a Parquet file
or a ``datasets`` ``save_to_disk`` directory (:mod:`.table_rows`: metadata only at open). No row
is parsed and no image path is resolved until that row is read.

Reading a row checks it (:class:`RowChecker`), with the columns of :class:`Columns`:

- the prompt (column ``prompt``): chat messages, or a string, which becomes one user message
  (the images are then placed before its text, as TRL does for conversational VLM prompts);
  keys that a columnar file fills with nulls (``{"type": "image", "text": None}``) are dropped;
- the images (column ``images``, else ``image``, else ``image_paths``): an image path, a
  Hugging Face ``Image`` value (``{"bytes": ..., "path": ...}``: the bytes win when present; a
  value with a path only is a path), encoded image bytes, or a non-empty list of them
  (``image_paths`` is always a list of paths). A path is relative to the directory that holds
  the dataset (a file's directory, a ``save_to_disk`` directory's parent) or absolute, contains
  no ``..``, and lies inside one of the trainer's data roots once symlinks are followed;
- the solution (column ``solution``), renamed ``solution`` when the task names another column;
- every other column passes through unchanged (reward functions receive it).

Every problem raises a :class:`DatasetError` naming the row (``line 7 of train.jsonl``,
``row 7 of train.parquet``, 1-based) and the column (``column 'images'``; a message about the
``prompt`` or ``image_paths`` column names it by what it says), and, where an image is at
fault, the image as the row wrote it (its path, else its position in the row), never a server
path of its own. A column the task names explicitly must exist: a file with a schema is checked
when it is opened, a JSONL row when it is read.

Checking at access time means a bad row is reported when training first reads it. Rank 0 of a
job also runs :meth:`RowChecker.check_all` over every row in a background thread when it starts,
so a bad row anywhere in the file fails the job within seconds, without delaying the first
batch.

This module imports neither torch nor PIL.
"""

from __future__ import annotations

import copy
import json
import os
import pathlib
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from trainer_service.core.provider import ProviderError

_WHITESPACE = np.frombuffer(b" \t\r\n\x0b\x0c", dtype=np.uint8)
# Resolved parent directories remembered per process; reset when full.
_MAX_PARENTS = 4096


class DatasetError(ProviderError):
    """A dataset file or row the provider cannot use; the message names the row.

    Attributes:
        row: 0-based row index (``None`` for file-level problems).
        line: 1-based line number of the row in the dataset file (its position in the row list
            for in-memory rows; ``None`` for file-level problems).
    """

    def __init__(
        self, user_message: str, detail: str = "", row: int | None = None, line: int | None = None
    ) -> None:
        super().__init__(user_message, detail, code="FAILED_PRECONDITION", reason="BAD_DATASET")
        self.row = row
        self.line = line

    def __str__(self) -> str:
        # Only the user message: a DataLoader worker re-raises this in the main process with
        # the worker's traceback, whose last line is str(exc); that line must be user-safe.
        return self.user_message


class RowSource(Protocol):
    """Where rows come from: a count, each row's raw value and location by index, and the
    column names when the source has a schema (``None``: each row has its own keys)."""

    columns: tuple[str, ...] | None

    def __len__(self) -> int: ...

    def line(self, index: int) -> int:
        """1-based line (or position) of row ``index``."""
        ...

    def where(self, index: int) -> str:
        """How messages name row ``index`` (``line 7 of train.jsonl``)."""
        ...

    def load(self, index: int) -> Any:
        """Row ``index`` as a fresh Python value (callers may mutate it).

        Raises:
            DatasetError: The row is not valid JSON, or its part of the file cannot be read.
        """
        ...

    def scan(self) -> Iterator[Any]:
        """Every row in order, as :meth:`load` returns them (one pass, for checking them all;
        it leaves whatever :meth:`load` caches alone)."""
        ...


class ListRows:
    """In-memory rows (deep-copied once here, never mutated; each load is a new deep copy)."""

    columns: tuple[str, ...] | None = None

    def __init__(self, rows: Iterable[Mapping[str, Any]]) -> None:
        self._rows = [copy.deepcopy(dict(row)) for row in rows]

    def __len__(self) -> int:
        return len(self._rows)

    def line(self, index: int) -> int:
        return index + 1

    def where(self, index: int) -> str:
        return f"row {index + 1}"

    def load(self, index: int) -> Any:
        return copy.deepcopy(self._rows[index])

    def scan(self) -> Iterator[Any]:
        return (self.load(index) for index in range(len(self)))


class JsonlRows:
    """Rows of a JSONL file: one JSON object per non-blank line, parsed on access.

    The file's bytes are read once (a snapshot: later edits to the file do not change the
    rows) and its line boundaries found with numpy, so opening costs one read and one scan.

    Raises:
        DatasetError: The file cannot be read or has no non-blank line.
    """

    columns: tuple[str, ...] | None = None

    def __init__(self, path: pathlib.Path) -> None:
        self.name = path.name
        try:
            self._data = path.read_bytes()
        except OSError as exc:
            raise DatasetError(
                f"The dataset file {path.name} could not be read.", detail=f"{path}: {exc}"
            ) from exc
        buffer = np.frombuffer(self._data, dtype=np.uint8)
        ends = np.flatnonzero(buffer == ord("\n"))
        if buffer.size and buffer[-1] != ord("\n"):
            ends = np.append(ends, buffer.size)
        starts = np.concatenate(([0], ends[:-1] + 1)) if ends.size else ends
        lines = np.arange(1, ends.size + 1)
        # A line is blank when it holds only whitespace. Only lines that start with whitespace
        # (or are empty) can be; those few are confirmed in Python.
        empty = starts >= ends
        first = buffer[np.minimum(starts, max(buffer.size - 1, 0))] if buffer.size else starts
        maybe_blank = np.flatnonzero(empty | np.isin(first, _WHITESPACE))
        keep = np.ones(ends.size, dtype=bool)
        for i in maybe_blank:
            if not self._data[starts[i] : ends[i]].strip():
                keep[i] = False
        self._starts = starts[keep]
        self._ends = ends[keep]
        self._lines = lines[keep]
        if not self._starts.size:
            raise DatasetError(f"The dataset file {path.name} has no rows.", detail=str(path))

    def __len__(self) -> int:
        return int(self._starts.size)

    def line(self, index: int) -> int:
        return int(self._lines[index])

    def where(self, index: int) -> str:
        return f"line {self.line(index)} of {self.name}"

    def load(self, index: int) -> Any:
        text = self._data[int(self._starts[index]) : int(self._ends[index])]
        try:
            return json.loads(text)
        except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
            raise DatasetError(
                f"Dataset {self.where(index)} is not valid JSON.",
                detail=str(exc),
                row=index,
                line=self.line(index),
            ) from exc

    def scan(self) -> Iterator[Any]:
        return (self.load(index) for index in range(len(self)))


#: The images column when the task names none: the first of these a row (or schema) has.
IMAGE_COLUMNS: tuple[str, ...] = ("images", "image", "image_paths")
#: The historic JSONL column: always a list of paths, named in messages by the paths it holds.
IMAGE_PATHS = "image_paths"
_PROMPT_RULE = (
    "prompt must be a list of chat messages, each an object with a string "
    '"role" and a "content" (a string, or a list of parts), or a string.'
)


@dataclass(frozen=True)
class Columns:
    """Which columns hold a row's prompt, images and solution (``GrpoTask.columns``).

    Attributes:
        prompt: The prompt column; ``""`` = ``prompt``.
        images: The images column; ``""`` = the first of :data:`IMAGE_COLUMNS` present.
        solution: The solution column; ``""`` = ``solution``.

    A column named here must exist; the defaults may be absent (a row without a solution is
    scored ``None`` by ``exact_match``; one without images is an error either way).
    """

    prompt: str = ""
    images: str = ""
    solution: str = ""

    @property
    def named(self) -> tuple[tuple[str, str], ...]:
        """(role, column) of every column named explicitly."""
        roles = (("prompt", self.prompt), ("images", self.images), ("solution", self.solution))
        return tuple((role, name) for role, name in roles if name)


#: Every column under its default name.
DEFAULT_COLUMNS = Columns()


@dataclass(frozen=True, slots=True)
class ImageRef:
    """One image of a row, not yet decoded: a resolved path or encoded bytes.

    Attributes:
        column: The column it came from.
        label: How messages name it: the path as the row wrote it (quoted), else its 1-based
            position in the row.
        path: The resolved file (``None`` when ``data`` is set).
        data: The encoded image (``None`` when ``path`` is set).
    """

    column: str
    label: str
    path: str | None = None
    data: bytes | None = None


def _is_chat(prompt: object) -> bool:
    """Whether a row's prompt is chat messages (``[{"role": ..., "content": ...}, ...]``)."""
    return (
        isinstance(prompt, list)
        and bool(prompt)
        and all(
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str | list)
            for m in prompt
        )
    )


def _without_nulls(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages without the null keys a columnar file fills in (a part ``{"type":
    "image", "text": None}`` read back from Arrow is ``{"type": "image"}``)."""
    cleaned = []
    for message in messages:
        message = {k: v for k, v in message.items() if v is not None}
        content = message["content"]
        if isinstance(content, list):
            message["content"] = [
                {k: v for k, v in part.items() if v is not None} if isinstance(part, dict) else part
                for part in content
            ]
        cleaned.append(message)
    return cleaned


class RowChecker:
    """Parses rows from a source and checks them (see the module docstring).

    Args:
        source: The rows.
        base_dir: Directory relative image paths are relative to (the one that holds the
            dataset).
        data_roots: Image paths must resolve inside one of them (symlinks followed).
        columns: Which columns hold the prompt, images and solution.

    Raises:
        DatasetError: The source has a schema, and it lacks a column that ``columns`` names,
            or any images column when ``columns`` names none, or a prompt column.
    """

    def __init__(
        self,
        source: RowSource,
        base_dir: pathlib.Path,
        data_roots: Sequence[pathlib.Path],
        columns: Columns = DEFAULT_COLUMNS,
    ) -> None:
        self.source = source
        self.columns = columns
        self.base = base_dir.resolve()
        self.roots = tuple(root.resolve() for root in data_roots)
        self._base, self._roots = str(self.base), tuple(str(root) for root in self.roots)
        self._parents: dict[str, tuple[str, bool]] = {}
        self._pid = os.getpid()
        self._images_column = columns.images or None
        if source.columns is not None:
            self._check_schema(source.columns)

    def _check_schema(self, present: Sequence[str]) -> None:
        name = getattr(self.source, "name", "dataset")
        have = ", ".join(repr(c) for c in present) or "none"
        for role, column in self.columns.named:
            if column not in present:
                raise DatasetError(
                    f"The dataset {name} has no column {column!r} (columns.{role}); its "
                    f"columns: {have}."
                )
        if self._images_column is None:
            self._images_column = next((c for c in IMAGE_COLUMNS if c in present), None)
            if self._images_column is None:
                raise DatasetError(
                    f"The dataset {name} has no images column ('images', 'image' or "
                    f"'image_paths'); name yours with columns.images. Its columns: {have}."
                )
        if not self.columns.prompt and "prompt" not in present:
            raise DatasetError(
                f"The dataset {name} has no column 'prompt'; name yours with columns.prompt. "
                f"Its columns: {have}."
            )

    def __len__(self) -> int:
        return len(self.source)

    def row(self, index: int) -> tuple[dict[str, Any], tuple[ImageRef, ...]]:
        """Row ``index`` (a fresh dict: the prompt normalised and named ``prompt``, the solution
        named ``solution``, the images column removed) and its images.

        Raises:
            DatasetError: The row is not an object, or a column is missing or unusable.
        """
        return self._check(index, self.source.load(index))

    def image_error(
        self, index: int, image: ImageRef, problem: str, detail: str = ""
    ) -> DatasetError:
        """A DatasetError for ``image`` of row ``index``."""
        return self._column_error(index, image.column, f"image {image.label} {problem}", detail)

    def check_all(self, stop: threading.Event | None = None) -> int:
        """Checks every row in order (no image is opened); returns how many were checked.

        Args:
            stop: Returns early once set.

        Raises:
            DatasetError: The first bad row.
        """
        for index, value in enumerate(self.source.scan()):
            if stop is not None and stop.is_set():
                return index
            self._check(index, value)
        return len(self.source)

    # -- one row -----------------------------------------------------------------------------

    def _check(self, index: int, value: Any) -> tuple[dict[str, Any], tuple[ImageRef, ...]]:
        if not isinstance(value, dict):
            raise self._error(index, " is not a JSON object.")
        columns = self.columns
        prompt_column = columns.prompt or "prompt"
        if prompt_column in value:
            prompt = value.pop(prompt_column) if columns.prompt else value[prompt_column]
            if isinstance(prompt, str):
                prompt = [{"role": "user", "content": prompt}]
            elif _is_chat(prompt):
                prompt = _without_nulls(prompt)
            else:
                raise self._column_error(index, prompt_column, _PROMPT_RULE)
            value["prompt"] = prompt
        elif columns.prompt:
            raise self._missing(index, prompt_column, "prompt")
        column = self._images_column or next((c for c in IMAGE_COLUMNS if c in value), None)
        if column is None:
            raise self._error(
                index,
                " has no images: a column 'images', 'image' or 'image_paths' holding an image "
                "path, a Hugging Face Image value ({bytes, path}), or a non-empty list of them.",
            )
        if column not in value:
            raise self._missing(index, column, "images")
        images = self._images(index, column, value.pop(column))
        if columns.solution:
            if columns.solution not in value:
                raise self._missing(index, columns.solution, "solution")
            value["solution"] = value.pop(columns.solution)
        return value, images

    def _images(self, index: int, column: str, raw: Any) -> tuple[ImageRef, ...]:
        if column == IMAGE_PATHS and not isinstance(raw, list):
            raise self._error(
                index, " has no image_paths (a non-empty list of image files is needed)."
            )
        items = raw if isinstance(raw, list) else [raw]
        if not items:
            rule = (
                " has no image_paths (a non-empty list of image files is needed)."
                if column == IMAGE_PATHS
                else ""
            )
            if rule:
                raise self._error(index, rule)
            raise self._column_error(index, column, "no images (an empty list).")
        return tuple(
            self._image(index, column, position, item) for position, item in enumerate(items, 1)
        )

    def _image(self, index: int, column: str, position: int, item: Any) -> ImageRef:
        if isinstance(item, dict):
            data, path = item.get("bytes"), item.get("path")
            if isinstance(data, bytes | bytearray) and data:
                label = repr(path) if isinstance(path, str) and path else str(position)
                return ImageRef(column, label, data=bytes(data))
            if data is None and isinstance(path, str) and path and "\x00" not in path:
                return ImageRef(column, repr(path), path=self._resolve(index, column, path))
        elif isinstance(item, bytes | bytearray) and item and column != IMAGE_PATHS:
            return ImageRef(column, str(position), data=bytes(item))
        elif isinstance(item, str) and item and "\x00" not in item:
            return ImageRef(column, repr(item), path=self._resolve(index, column, item))
        if column == IMAGE_PATHS:
            raise self._error(index, " has an image path that is not a file name.")
        raise self._column_error(
            index,
            column,
            f"image {position} is neither a path nor an image ({{bytes, path}} with bytes or "
            "a path).",
        )

    # -- messages ----------------------------------------------------------------------------

    def _error(self, index: int, tail: str, detail: str = "") -> DatasetError:
        return DatasetError(
            f"Dataset {self.source.where(index)}{tail}",
            detail=detail,
            row=index,
            line=self.source.line(index),
        )

    def _column_error(
        self, index: int, column: str | None, problem: str, detail: str = ""
    ) -> DatasetError:
        # The prompt's and image_paths' messages name them by what they say.
        if column in (None, "prompt", IMAGE_PATHS):
            return self._error(index, f": {problem}", detail)
        return self._error(index, f", column {column!r}: {problem}", detail)

    def _missing(self, index: int, column: str, role: str) -> DatasetError:
        return self._error(index, f" has no column {column!r} (columns.{role}).")

    # -- paths -------------------------------------------------------------------------------

    def _resolve(self, index: int, column: str, raw: str) -> str:
        # String operations, not pathlib: the background check runs this for every row.
        if (
            raw.startswith("\\")
            or pathlib.PureWindowsPath(raw).is_absolute()
            or ".." in raw.replace("\\", "/").split("/")
        ):
            raise self._column_error(
                index,
                column,
                f"image {raw!r} must be relative to the dataset file, or absolute inside a data "
                "root, and contain no '..'.",
            )
        head, name = os.path.split(raw)
        parent, parent_inside = self._parent(head)
        target = os.path.join(parent, name)
        if os.path.islink(target):
            target = os.path.realpath(target)
            inside = _inside(target, self._roots)
        else:
            inside = parent_inside
        if not inside:
            raise self._column_error(
                index,
                column,
                f"image {raw!r} leads outside the data root.",
                f"{raw} -> {target} (roots {', '.join(self._roots)})",
            )
        return target

    def _parent(self, head: str) -> tuple[str, bool]:
        """The directory ``head`` (relative to the dataset's, or absolute) resolved, and whether it
        is inside a data root.

        Remembered per process (directories are few; the memo is reset when full).
        """
        if self._pid != os.getpid():  # a worker process: the parent's memo may be stale
            self._parents, self._pid = {}, os.getpid()
        known = self._parents.get(head)
        if known is None:
            if len(self._parents) >= _MAX_PARENTS:
                self._parents.clear()
            resolved = os.path.realpath(os.path.join(self._base, head))
            known = self._parents[head] = (resolved, _inside(resolved, self._roots))
        return known


def _inside(path: str, roots: Sequence[str]) -> bool:
    return any(path == root or path.startswith(root.rstrip(os.sep) + os.sep) for root in roots)

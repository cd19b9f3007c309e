"""Dataset rows for the lazy image dataset: indexed without parsing, parsed and checked on access.

Opening a JSONL dataset costs one read of the file and one vectorised scan for its line
boundaries (:class:`JsonlRows`), a few milliseconds even at 46,000 rows: no row is parsed and
no image path is resolved until that row is read. Reading a row parses its line and checks it
(:class:`RowChecker`): a JSON object, a ``prompt`` (if any) of chat messages, a non-empty
``image_paths`` list of paths, each relative to the dataset file or absolute, without ``..``,
that lie inside one of the trainer's data roots once symlinks are followed. Every problem raises
a :class:`DatasetError` naming the row by its 1-based line number in the file and, where an
image is at fault, the image path as the row wrote it, never a server path of its own.

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
from collections.abc import Iterable, Mapping, Sequence
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
    """Where rows come from: a count, and each row's raw value and location by index."""

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
            DatasetError: The row is not valid JSON.
        """
        ...


class ListRows:
    """In-memory rows (deep-copied once here, never mutated; each load is a new deep copy)."""

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


class JsonlRows:
    """Rows of a JSONL file: one JSON object per non-blank line, parsed on access.

    The file's bytes are read once (a snapshot: later edits to the file do not change the
    rows) and its line boundaries found with numpy, so opening costs one read and one scan.

    Raises:
        DatasetError: The file cannot be read or has no non-blank line.
    """

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


class RowChecker:
    """Parses rows from a source and checks them (see the module docstring).

    Args:
        source: The rows.
        base_dir: Directory relative image paths are relative to (the dataset file's directory).
        data_roots: Image paths must resolve inside one of them (symlinks followed).
    """

    def __init__(
        self, source: RowSource, base_dir: pathlib.Path, data_roots: Sequence[pathlib.Path]
    ) -> None:
        self.source = source
        self.base = base_dir.resolve()
        self.roots = tuple(root.resolve() for root in data_roots)
        self._base, self._roots = str(self.base), tuple(str(root) for root in self.roots)
        self._parents: dict[str, tuple[str, bool]] = {}
        self._pid = os.getpid()

    def __len__(self) -> int:
        return len(self.source)

    def row(self, index: int) -> tuple[dict[str, Any], tuple[str, ...]]:
        """Row ``index`` (a fresh dict) and its resolved image paths.

        Raises:
            DatasetError: The row is not a JSON object or its ``image_paths`` are unusable.
        """
        value = self.source.load(index)
        if not isinstance(value, dict):
            raise self._error(index, " is not a JSON object.")
        if "prompt" in value and not _is_chat(value["prompt"]):
            raise self._error(
                index,
                ": prompt must be a list of chat messages, each an object with a string "
                '"role" and a "content" (a string, or a list of parts).',
            )
        paths = value.get("image_paths")
        if not isinstance(paths, list) or not paths:
            raise self._error(
                index, " has no image_paths (a non-empty list of image files is needed)."
            )
        return value, tuple(self._resolve(index, raw) for raw in paths)

    def image_error(self, index: int, raw: str, problem: str, detail: str = "") -> DatasetError:
        """A DatasetError for image ``raw`` (as the row wrote it) of row ``index``."""
        return self._error(index, f": image {raw!r} {problem}", detail)

    def check_all(self, stop: threading.Event | None = None) -> int:
        """Checks every row in order (no image is opened); returns how many were checked.

        Args:
            stop: Returns early once set.

        Raises:
            DatasetError: The first bad row.
        """
        for index in range(len(self.source)):
            if stop is not None and stop.is_set():
                return index
            self.row(index)
        return len(self.source)

    def _error(self, index: int, tail: str, detail: str = "") -> DatasetError:
        return DatasetError(
            f"Dataset {self.source.where(index)}{tail}",
            detail=detail,
            row=index,
            line=self.source.line(index),
        )

    def _resolve(self, index: int, raw: object) -> str:
        # String operations, not pathlib: the background check runs this for every row.
        if not isinstance(raw, str) or not raw or "\x00" in raw:
            raise self._error(index, " has an image path that is not a file name.")
        if (
            raw.startswith("\\")
            or pathlib.PureWindowsPath(raw).is_absolute()
            or ".." in raw.replace("\\", "/").split("/")
        ):
            raise self.image_error(
                index,
                raw,
                "must be relative to the dataset file, or absolute inside a data root, and "
                "contain no '..'.",
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
            raise self.image_error(
                index,
                raw,
                "leads outside the data root.",
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

"""The lazy image dataset: prepared JSONL rows whose images are decoded per row, on demand.

The slow way to feed a vision-language GRPO run decodes every image up front and re-encodes it
into an Arrow table on every launch (hours for tens of thousands of images). This module keeps
rows as plain dicts and decodes a row's images only when the row is read, in whichever process
reads it: with ``dataloader_num_workers > 0`` that is a DataLoader worker, so workers decode step
X+1 while the trainer computes step X.

What it guarantees (each point is tested):

1. :class:`LazyImageDataset` is a plain map-style class; this module imports no torch.
2. ``dataset[i]`` is a pure function of ``i``: a deep copy of the stored row with ``image_paths``
   popped, ``image`` (one path) or ``images`` (several) set to decoded RGB images and
   ``assistant_response`` dropped. Stored rows are deep-copied once at construction and never
   mutated.
3. A row with missing or empty ``image_paths`` (or a path escaping the data root) is rejected at
   load time with an error naming the row.
4. Without a cache an image is ``Image.open(path).convert("RGB")``.
5. An optional disk cache keyed by the sha256 of the source bytes stores lossless PNGs at
   ``<dir>/<key[:2]>/<key>.png``, published atomically (a temp file unique to the writing process
   and thread, then ``os.replace``); a hit has the pixels of a miss; an unreadable entry is
   rewritten.
6. No randomness: the index stream (TRL's ``RepeatSampler``) lives in the main process.
7. A small per-process memo of recently decoded rows: ``RepeatSampler`` yields each index
   ``num_generations`` times in a row, so without it each image would be decoded that many times
   per step.

:class:`RowTransform` adapts the dataset to ``datasets.Dataset.with_transform`` (TRL accepts only
``datasets`` datasets); it lives here so it pickles to workers without importing the provider.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import hashlib
import io
import json
import logging
import os
import pathlib
import tempfile
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from PIL import Image

from trainer_service.core.provider import ProviderError

_LOGGER = logging.getLogger(__name__)

#: Environment variable naming the image cache directory when the trainer flag is not given.
CACHE_DIR_ENV = "TRAINWIRE_IMAGE_CACHE_DIR"


class DatasetError(ProviderError):
    """A dataset file or row the provider cannot use; the message names the row.

    Attributes:
        row: 0-based row index (``None`` for file-level problems).
    """

    def __init__(self, user_message: str, detail: str = "", row: int | None = None) -> None:
        super().__init__(user_message, detail, code="FAILED_PRECONDITION", reason="BAD_DATASET")
        self.row = row

    def __str__(self) -> str:
        # Only the user message: a DataLoader worker re-raises this in the main process with
        # the worker's traceback, whose last line is str(exc); that line must be user-safe.
        return self.user_message


@dataclass
class DecodeStats:
    """Per-process counters (each DataLoader worker has its own copy).

    Attributes:
        pid: The process the counters belong to.
        rows: ``__getitem__`` calls.
        memo_hits: Rows served from the memo without decoding.
        decodes: Images decoded (from source or from the cache).
        cache_hits: Images read from the disk cache.
        cache_misses: Images decoded from source and written to the cache.
        cache_rewrites: Unreadable cache entries replaced.
        decodes_by_row: Row index -> images decoded for it in this process.
    """

    pid: int = field(default_factory=os.getpid)
    rows: int = 0
    memo_hits: int = 0
    decodes: int = 0
    cache_hits: int = 0
    cache_misses: int = 0
    cache_rewrites: int = 0
    decodes_by_row: collections.Counter[int] = field(default_factory=collections.Counter)

    def decodes_per_unique_row(self) -> float:
        """Mean decodes per distinct row read in this process (1.0 per image is ideal)."""
        return self.decodes / len(self.decodes_by_row) if self.decodes_by_row else 0.0


def open_rgb(path: str | os.PathLike[str]) -> Image.Image:
    """Decodes an image file exactly as the plain path does: ``Image.open(path).convert("RGB")``."""
    with Image.open(path) as image:
        return image.convert("RGB")


class ImageCache:
    """A content-addressed disk cache of decoded images (lossless PNG).

    Safe for concurrent use by many processes: an entry is written to a temp file whose name is
    unique to the writing process and thread, then published with ``os.replace``, so readers see
    either no entry or a complete one.

    Args:
        directory: Cache root; created on first write.
    """

    def __init__(self, directory: pathlib.Path) -> None:
        self.directory = directory

    def entry_path(self, key: str) -> pathlib.Path:
        """Where the entry for sha256 hex ``key`` lives."""
        return self.directory / key[:2] / f"{key}.png"

    def load(self, source: pathlib.Path, stats: DecodeStats) -> Image.Image:
        """Returns ``source`` decoded to RGB, via the cache.

        Raises:
            OSError: The source cannot be read or decoded.
        """
        data = source.read_bytes()
        key = hashlib.sha256(data).hexdigest()
        entry = self.entry_path(key)
        if entry.exists():
            try:
                image = open_rgb(entry)
            except (OSError, SyntaxError, ValueError) as exc:
                # A torn or corrupt entry (disk full, foreign writer): rebuild it from the source.
                _LOGGER.warning("image cache entry %s unreadable (%s); rewriting it", entry, exc)
                stats.cache_rewrites += 1
            else:
                stats.cache_hits += 1
                return image
        with Image.open(io.BytesIO(data)) as decoded:
            image = decoded.convert("RGB")
        stats.cache_misses += 1
        self._publish(entry, image)
        return image

    def _publish(self, entry: pathlib.Path, image: Image.Image) -> None:
        entry.parent.mkdir(parents=True, exist_ok=True)
        # Unique per process and thread: two workers writing the same key never share a temp file.
        prefix = f".{entry.stem}.{os.getpid()}.{threading.get_ident()}."
        fd, tmp_name = tempfile.mkstemp(prefix=prefix, suffix=".tmp", dir=entry.parent)
        try:
            with os.fdopen(fd, "wb") as handle:
                # Level 1: still lossless, several times faster to write than the default 6.
                image.save(handle, format="PNG", compress_level=1)
            os.replace(tmp_name, entry)
        except Exception:
            # A cache that cannot be written must not fail training; the image is already decoded.
            with contextlib.suppress(OSError):
                os.unlink(tmp_name)
            _LOGGER.warning("could not write image cache entry %s", entry, exc_info=True)


def resolve_cache_dir(flag_value: pathlib.Path | None) -> pathlib.Path | None:
    """The cache directory: the trainer flag, else ``$TRAINWIRE_IMAGE_CACHE_DIR``, else none."""
    if flag_value is not None:
        return flag_value
    env = os.environ.get(CACHE_DIR_ENV, "").strip()
    return pathlib.Path(env) if env else None


def _inside(path: pathlib.Path, root: pathlib.Path) -> bool:
    return path == root or root in path.parents


class LazyImageDataset:
    """Prepared image+text rows, decoded one row at a time (map-style: ``len`` and ``[i]``).

    Args:
        rows: Prepared rows; each has ``image_paths`` (a non-empty list of paths relative to
            ``base_dir``). Rows are deep-copied once here and never mutated.
        base_dir: Directory image paths are relative to (the dataset file's directory).
        data_root: Image paths must resolve inside it (symlinks followed); defaults to
            ``base_dir``.
        cache_dir: Disk cache directory, or ``None`` for no cache.
        memo_rows: How many recently decoded rows each process keeps (0 disables the memo).
        provenance_key: When set, every returned row carries this key with
            ``{"pid": <decoding process>, "decodes": <images decoded for the row so far in that
            process>}`` (diagnostics and tests; off by default).

    Raises:
        DatasetError: A row has missing/empty ``image_paths`` or a path escaping ``data_root``.
    """

    def __init__(
        self,
        rows: Iterable[Mapping[str, Any]],
        base_dir: pathlib.Path,
        *,
        data_root: pathlib.Path | None = None,
        cache_dir: pathlib.Path | None = None,
        memo_rows: int = 0,
        provenance_key: str | None = None,
    ) -> None:
        if memo_rows < 0:
            raise ValueError(f"memo_rows must be >= 0, got {memo_rows}")
        root = (data_root or base_dir).resolve()
        base = base_dir.resolve()
        self._rows: list[dict[str, Any]] = []
        self._paths: list[tuple[str, ...]] = []
        for index, row in enumerate(rows):
            stored = copy.deepcopy(dict(row))
            self._paths.append(_resolve_row_paths(index, stored, base, root))
            self._rows.append(stored)
        self._cache = ImageCache(cache_dir) if cache_dir is not None else None
        self._memo_rows = memo_rows
        self._provenance_key = provenance_key
        self._memo: collections.OrderedDict[int, tuple[Image.Image, ...]] = (
            collections.OrderedDict()
        )
        self._stats = DecodeStats()

    @classmethod
    def from_jsonl(
        cls,
        path: pathlib.Path,
        *,
        data_root: pathlib.Path,
        cache_dir: pathlib.Path | None = None,
        memo_rows: int = 0,
        provenance_key: str | None = None,
    ) -> LazyImageDataset:
        """Loads a JSONL dataset file (one JSON object per non-blank line).

        Raises:
            DatasetError: The file is unreadable, a line is not a JSON object, or a row is bad.
        """
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise DatasetError(
                f"The dataset file {path.name} could not be read.", detail=f"{path}: {exc}"
            ) from exc
        rows: list[dict[str, Any]] = []
        for line_no, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DatasetError(
                    f"Dataset row {len(rows)} (line {line_no} of {path.name}) is not valid JSON.",
                    detail=str(exc),
                    row=len(rows),
                ) from exc
            if not isinstance(row, dict):
                raise DatasetError(
                    f"Dataset row {len(rows)} (line {line_no} of {path.name}) is not a JSON "
                    "object.",
                    row=len(rows),
                )
            rows.append(row)
        if not rows:
            raise DatasetError(f"The dataset file {path.name} has no rows.", detail=str(path))
        return cls(
            rows,
            path.parent,
            data_root=data_root,
            cache_dir=cache_dir,
            memo_rows=memo_rows,
            provenance_key=provenance_key,
        )

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, index: int) -> dict[str, Any]:
        if not 0 <= index < len(self._rows):
            raise IndexError(f"row {index} out of range 0..{len(self._rows) - 1}")
        stats = self.stats
        stats.rows += 1
        row = copy.deepcopy(self._rows[index])
        row.pop("image_paths", None)
        row.pop("assistant_response", None)
        images = self._images(index, stats)
        if len(images) == 1:
            row["image"] = images[0]
        else:
            row["images"] = list(images)
        if self._provenance_key is not None:
            row[self._provenance_key] = {
                "pid": stats.pid,
                "decodes": stats.decodes_by_row[index],
            }
        return row

    @property
    def stats(self) -> DecodeStats:
        """This process's counters (reset in a forked worker on first use)."""
        if self._stats.pid != os.getpid():
            # Forked into a DataLoader worker: the parent's counters and memo are not ours.
            self._stats = DecodeStats()
            self._memo.clear()
        return self._stats

    def row_paths(self, index: int) -> tuple[str, ...]:
        """The resolved image paths of row ``index``."""
        return self._paths[index]

    def _images(self, index: int, stats: DecodeStats) -> tuple[Image.Image, ...]:
        memo = self._memo
        if self._memo_rows and index in memo:
            memo.move_to_end(index)
            stats.memo_hits += 1
            # Copies keep rows independent: nothing downstream can alter another row's image.
            return tuple(image.copy() for image in memo[index])
        images = tuple(self._decode(index, path, stats) for path in self._paths[index])
        if self._memo_rows:
            memo[index] = images
            while len(memo) > self._memo_rows:
                memo.popitem(last=False)
            return tuple(image.copy() for image in images)
        return images

    def _decode(self, index: int, path: str, stats: DecodeStats) -> Image.Image:
        try:
            if self._cache is not None:
                image = self._cache.load(pathlib.Path(path), stats)
            else:
                image = open_rgb(path)
        except (OSError, SyntaxError, ValueError) as exc:
            raise DatasetError(
                f"Dataset row {index}: image {pathlib.Path(path).name} could not be read.",
                detail=f"{path}: {exc}",
                row=index,
            ) from exc
        stats.decodes += 1
        stats.decodes_by_row[index] += 1
        return image

    def __getstate__(self) -> dict[str, Any]:
        # Workers start with an empty memo and fresh counters; rows travel as plain dicts.
        state = self.__dict__.copy()
        state["_memo"] = collections.OrderedDict()
        state["_stats"] = DecodeStats(pid=-1)
        return state


def _resolve_row_paths(
    index: int, row: Mapping[str, Any], base: pathlib.Path, root: pathlib.Path
) -> tuple[str, ...]:
    paths = row.get("image_paths")
    if not isinstance(paths, list) or not paths:
        raise DatasetError(
            f"Dataset row {index} has no image_paths (a non-empty list of image files is needed).",
            row=index,
        )
    resolved = []
    for raw in paths:
        if not isinstance(raw, str) or not raw:
            raise DatasetError(
                f"Dataset row {index} has an image path that is not a file name.", row=index
            )
        relative = pathlib.PurePosixPath(raw)
        if (
            relative.is_absolute()
            or pathlib.PureWindowsPath(raw).is_absolute()
            or ".." in relative.parts
        ):
            raise DatasetError(
                f"Dataset row {index}: image path {raw!r} must be relative to the dataset file "
                "and stay inside the data root.",
                row=index,
            )
        target = (base / relative).resolve()
        if not _inside(target, root):
            raise DatasetError(
                f"Dataset row {index}: image path {raw!r} leads outside the data root.",
                detail=f"{raw} -> {target} (root {root})",
                row=index,
            )
        resolved.append(str(target))
    return tuple(resolved)


class RowTransform:
    """``datasets.Dataset.with_transform`` adapter: an index column in, lazily decoded rows out.

    TRL's GRPOTrainer accepts only ``datasets`` datasets, so the trainer gets
    ``Dataset.from_dict({"_i": range(n)}).with_transform(RowTransform(lazy))``: the Arrow table
    holds only indices, and rows (with their images) are built here, in whichever process reads
    the batch. Picklable (a plain instance holding the lazy dataset).

    Args:
        dataset: The lazy dataset.
        index_column: Name of the index column.
    """

    def __init__(self, dataset: LazyImageDataset, index_column: str = "_i") -> None:
        self.dataset = dataset
        self.index_column = index_column

    def __call__(self, batch: Mapping[str, Sequence[Any]]) -> dict[str, list[Any]]:
        rows = [self.dataset[int(i)] for i in batch[self.index_column]]
        if any("images" in row for row in rows) and any("image" in row for row in rows):
            # TRL looks at the first row to choose "image" or "images"; a batch mixing one- and
            # many-image rows must use "images" throughout.
            for row in rows:
                if "image" in row:
                    row["images"] = [row.pop("image")]
        keys: list[str] = []
        for row in rows:
            keys.extend(key for key in row if key not in keys)
        return {key: [row.get(key) for row in rows] for key in keys}

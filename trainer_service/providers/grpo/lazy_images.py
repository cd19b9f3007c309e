"""The lazy image dataset: prepared rows whose images are decoded per row, on demand.

The slow way to feed a vision-language GRPO run decodes every image up front and re-encodes it
into an Arrow table on every launch (hours for tens of thousands of images). This module keeps
rows as they are and decodes a row's images only when the row is read, in whichever process reads
it: with ``dataloader_num_workers > 0`` that is a DataLoader worker, so workers decode step X+1
while the trainer computes step X.

What it guarantees (each point is tested):

1. :class:`LazyImageDataset` is a plain map-style class; this module imports no torch.
2. ``dataset[i]`` is a pure function of ``i``: a fresh copy of row ``i`` with its images
   column popped, ``image`` (one image) or ``images`` (several) set to decoded RGB images, the
   prompt and solution under the names TRL and the rewards read (``prompt``, ``solution``; see
   :class:`.rows.Columns`) and ``assistant_response`` dropped. Stored rows are never mutated.
3. Opening a dataset (a JSONL file, a Parquet file, a ``save_to_disk`` directory:
   :meth:`LazyImageDataset.open`) does not parse or check its rows (see :mod:`.rows` and
   :mod:`.table_rows`): time to the first batch does not grow with the row count. A row is
   parsed and checked when it is read; a bad row (not an object, no images, a path outside
   every data root, an unreadable image) raises :class:`DatasetError` naming the row, the
   column and the image as the row wrote it. :meth:`LazyImageDataset.check_rows` checks every
   row without decoding images (rank 0 of a job runs it in the background as it starts).
4. Without a cache an image is ``Image.open(path).convert("RGB")`` (or the same of the bytes a
   row holds).
5. An optional disk cache (:mod:`.image_cache`) keyed by the sha256 of the source bytes (the
   file's, or those the row holds); a hit has the pixels of a miss.
6. No randomness: the index stream (TRL's ``RepeatSampler``) lives in the main process. (That
   alone does not make 0 and N workers give the same training stream: the DataLoader also
   draws worker seeds; see ``build.LazyGRPOTrainer``.)
7. A small per-process memo of recently decoded rows: ``RepeatSampler`` yields each index
   ``num_generations`` times in a row, so without it each image would be decoded that many times
   per step.

:class:`RowTransform` adapts the dataset to ``datasets.Dataset.with_transform`` (TRL accepts only
``datasets`` datasets); it lives here so it pickles to workers without importing the provider.
"""

from __future__ import annotations

import collections
import os
import pathlib
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from PIL import Image

from trainer_service.providers.grpo.image_cache import (
    CACHE_DIR_ENV,
    DecodeStats,
    ImageCache,
    decode_rgb,
    open_rgb,
    resolve_cache_dir,
)
from trainer_service.providers.grpo.rows import (
    DEFAULT_COLUMNS,
    Columns,
    DatasetError,
    ImageRef,
    JsonlRows,
    ListRows,
    RowChecker,
    RowSource,
)
from trainer_service.providers.grpo.table_rows import ParquetRows, SavedRows

__all__ = [
    "CACHE_DIR_ENV",
    "Columns",
    "DatasetError",
    "DecodeStats",
    "ImageCache",
    "LazyImageDataset",
    "RowTransform",
    "open_rgb",
    "resolve_cache_dir",
]


class LazyImageDataset:
    """Prepared image+text rows, decoded one row at a time (map-style: ``len`` and ``[i]``).

    Args:
        rows: A row source, or prepared rows (each with its images, e.g. ``image_paths``: a
            non-empty list of paths relative to ``base_dir``), deep-copied once here and never
            mutated. Rows are checked when read (or by :meth:`check_rows`).
        base_dir: Directory image paths are relative to (the one that holds the dataset).
        data_root: The data root, or every data root: image paths must resolve inside one of
            them (symlinks followed); defaults to ``base_dir``.
        cache_dir: Disk cache directory, or ``None`` for no cache.
        memo_rows: How many recently decoded rows each process keeps (0 disables the memo).
        provenance_key: When set, every returned row carries this key with
            ``{"pid": <decoding process>, "decodes": <images decoded for the row so far in that
            process>}`` (diagnostics and tests; off by default).
        columns: Which columns hold the prompt, images and solution.

    Raises:
        DatasetError: The source's schema lacks a column ``columns`` names (or any images or
            prompt column).
    """

    def __init__(
        self,
        rows: Iterable[Mapping[str, Any]] | RowSource,
        base_dir: pathlib.Path,
        *,
        data_root: pathlib.Path | Sequence[pathlib.Path] | None = None,
        cache_dir: pathlib.Path | None = None,
        memo_rows: int = 0,
        provenance_key: str | None = None,
        columns: Columns = DEFAULT_COLUMNS,
    ) -> None:
        if memo_rows < 0:
            raise ValueError(f"memo_rows must be >= 0, got {memo_rows}")
        source: RowSource
        if isinstance(rows, JsonlRows | ListRows | ParquetRows | SavedRows):
            source = rows
        else:
            source = ListRows(rows)  # type: ignore[arg-type]
        roots = [data_root] if isinstance(data_root, pathlib.Path) else list(data_root or [])
        self._checker = RowChecker(source, base_dir, roots or [base_dir], columns)
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
        data_root: pathlib.Path | Sequence[pathlib.Path],
        cache_dir: pathlib.Path | None = None,
        memo_rows: int = 0,
        provenance_key: str | None = None,
        columns: Columns = DEFAULT_COLUMNS,
    ) -> LazyImageDataset:
        """Opens a JSONL dataset file (one JSON object per non-blank line) without parsing it.

        Raises:
            DatasetError: The file is unreadable or has no rows. Bad rows are reported when
                read (see the module docstring).
        """
        return cls(
            JsonlRows(path),
            path.parent,
            data_root=data_root,
            cache_dir=cache_dir,
            memo_rows=memo_rows,
            provenance_key=provenance_key,
            columns=columns,
        )

    @classmethod
    def open(
        cls,
        path: pathlib.Path,
        *,
        data_root: pathlib.Path | Sequence[pathlib.Path],
        cache_dir: pathlib.Path | None = None,
        memo_rows: int = 0,
        provenance_key: str | None = None,
        columns: Columns = DEFAULT_COLUMNS,
    ) -> LazyImageDataset:
        """Opens a dataset without reading its rows: a directory written by ``datasets``'
        ``save_to_disk``, a ``.parquet`` file, or else a JSONL file. Relative image paths are
        relative to the directory that holds it.

        Raises:
            DatasetError: It cannot be read, has no rows, or its schema lacks a column
                ``columns`` names. Bad rows are reported when read.
        """
        source: RowSource
        if path.is_dir():
            source = SavedRows(path)
        elif path.suffix.lower() == ".parquet":
            source = ParquetRows(path)
        else:
            source = JsonlRows(path)
        return cls(
            source,
            path.parent,
            data_root=data_root,
            cache_dir=cache_dir,
            memo_rows=memo_rows,
            provenance_key=provenance_key,
            columns=columns,
        )

    def __len__(self) -> int:
        return len(self._checker)

    def __getitem__(self, index: int) -> dict[str, Any]:
        if not 0 <= index < len(self):
            raise IndexError(f"row {index} out of range 0..{len(self) - 1}")
        stats = self.stats
        stats.rows += 1
        row, refs = self._checker.row(index)
        row.pop("assistant_response", None)
        images = self._images(index, refs, stats)
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

    def set_memo_rows(self, memo_rows: int) -> None:
        """Sets how many recently decoded rows each process keeps (0 disables the memo)."""
        if memo_rows < 0:
            raise ValueError(f"memo_rows must be >= 0, got {memo_rows}")
        self._memo_rows = memo_rows
        while len(self._memo) > memo_rows:
            self._memo.popitem(last=False)

    @property
    def stats(self) -> DecodeStats:
        """This process's counters (reset in a forked worker on first use)."""
        if self._stats.pid != os.getpid():
            # Forked into a DataLoader worker: the parent's counters and memo are not ours.
            self._stats = DecodeStats()
            self._memo.clear()
        return self._stats

    def check_rows(self, stop: threading.Event | None = None) -> int:
        """Parses and checks every row (no image is decoded); returns how many were checked.

        Args:
            stop: Returns early once set.

        Raises:
            DatasetError: The first bad row.
        """
        return self._checker.check_all(stop)

    def _images(
        self, index: int, refs: Sequence[ImageRef], stats: DecodeStats
    ) -> tuple[Image.Image, ...]:
        memo = self._memo
        if self._memo_rows and index in memo:
            memo.move_to_end(index)
            stats.memo_hits += 1
            # Copies keep rows independent: nothing downstream can alter another row's image.
            return tuple(image.copy() for image in memo[index])
        images = tuple(self._decode(index, ref, stats) for ref in refs)
        if self._memo_rows:
            memo[index] = images
            while len(memo) > self._memo_rows:
                memo.popitem(last=False)
            return tuple(image.copy() for image in images)
        return images

    def _decode(self, index: int, ref: ImageRef, stats: DecodeStats) -> Image.Image:
        cache = self._cache
        try:
            if ref.data is not None:
                image = cache.load_bytes(ref.data, stats) if cache else decode_rgb(ref.data)
            else:
                assert ref.path is not None
                image = cache.load(pathlib.Path(ref.path), stats) if cache else open_rgb(ref.path)
        except (OSError, SyntaxError, ValueError) as exc:
            where = ref.path if ref.path is not None else f"{len(ref.data or b'')} bytes"
            raise self._checker.image_error(
                index, ref, "could not be read.", detail=f"{where}: {exc}"
            ) from exc
        stats.decodes += 1
        stats.decodes_by_row[index] += 1
        return image

    def __getstate__(self) -> dict[str, Any]:
        # Workers start with an empty memo and fresh counters; rows travel as they are stored.
        state = self.__dict__.copy()
        state["_memo"] = collections.OrderedDict()
        state["_stats"] = DecodeStats(pid=-1)
        return state


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

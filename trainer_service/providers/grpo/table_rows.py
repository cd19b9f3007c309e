"""Row sources over columnar datasets: a Parquet file and a ``datasets`` ``save_to_disk`` directory.

Both open in time that does not grow with the dataset's size, and neither decodes an image:

- :class:`ParquetRows` reads the file's footer (schema and row-group sizes) at open. A row read
  reads its row group (only that one) and keeps it as the process's current row group, so the
  rows of one group cost one read; reading every row (:meth:`ParquetRows.scan`) streams the
  groups through a reader of its own, leaving that cache alone. A file written as one big row
  group is read whole on its first row: ``datasets`` writes image datasets 100 rows a group.
- :class:`SavedRows` opens a ``save_to_disk`` directory with ``datasets.load_from_disk``, which
  memory-maps its Arrow files, and reads rows in the Arrow format: image columns come back as
  the stored ``{"bytes", "path"}`` structs whatever the dataset's features say. A directory
  holding a ``DatasetDict`` uses its ``train`` split (or its only one).

Rows come back as plain Python values (Arrow ``to_pylist``); :class:`.rows.RowChecker` checks
them. Both sources pickle small (a path, not the data) and reopen in the process that unpickles
them (a DataLoader worker).

This module imports neither torch nor PIL; ``datasets`` only when a directory is opened.
"""

from __future__ import annotations

import bisect
import os
import pathlib
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from trainer_service.providers.grpo.rows import DatasetError

#: Rows per batch when every row is read in order.
_SCAN_BATCH = 256


class ParquetRows:
    """Rows of a Parquet file, read one row group at a time (see the module docstring).

    Raises:
        DatasetError: The file cannot be read, is not Parquet, or has no rows.
    """

    def __init__(self, path: pathlib.Path) -> None:
        self.name = path.name
        self._path = path
        file = self._open()
        metadata = file.metadata
        sizes = [metadata.row_group(g).num_rows for g in range(metadata.num_row_groups)]
        self._starts = [0]
        for size in sizes:
            self._starts.append(self._starts[-1] + size)
        self.columns: tuple[str, ...] | None = tuple(file.schema_arrow.names)
        if not self._starts[-1]:
            raise DatasetError(f"The dataset file {path.name} has no rows.", detail=str(path))
        self._file: pq.ParquetFile | None = file
        self._pid = os.getpid()
        self._group: tuple[int, pa.Table | None] = (-1, None)

    def _open(self) -> pq.ParquetFile:
        try:
            return pq.ParquetFile(self._path)
        except (OSError, pa.ArrowException) as exc:
            raise DatasetError(
                f"The dataset file {self.name} could not be read as Parquet.",
                detail=f"{self._path}: {exc}",
            ) from exc

    def __len__(self) -> int:
        return self._starts[-1]

    def line(self, index: int) -> int:
        return index + 1

    def where(self, index: int) -> str:
        return f"row {index + 1} of {self.name}"

    def load(self, index: int) -> Any:
        group = bisect.bisect_right(self._starts, index) - 1
        table = self._row_group(group, index)
        return table.slice(index - self._starts[group], 1).to_pylist()[0]

    def scan(self) -> Iterator[Any]:
        index = 0
        try:
            for batch in self._open().iter_batches(batch_size=_SCAN_BATCH):
                for row in batch.to_pylist():
                    yield row
                    index += 1
        except (OSError, pa.ArrowException) as exc:
            raise self._unreadable(index, exc) from exc

    def _row_group(self, group: int, index: int) -> pa.Table:
        """Row group ``group`` (the process's current one, or read now)."""
        if self._pid != os.getpid() or self._file is None:
            # Unpickled or forked into another process: its own handle and cache.
            self._file, self._pid, self._group = None, os.getpid(), (-1, None)
            self._file = self._open()
        current, table = self._group  # one read: another thread may swap it meanwhile
        if current == group and table is not None:
            return table
        try:
            table = self._file.read_row_group(group)
        except (OSError, pa.ArrowException) as exc:
            raise self._unreadable(index, exc) from exc
        self._group = (group, table)
        return table

    def _unreadable(self, index: int, exc: BaseException) -> DatasetError:
        return DatasetError(
            f"Dataset {self.where(index)} could not be read.",
            detail=f"{self._path}: {type(exc).__name__}: {exc}",
            row=index,
            line=index + 1,
        )

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_file"], state["_group"], state["_pid"] = None, (-1, None), -1
        return state


class SavedRows:
    """Rows of a ``datasets`` ``save_to_disk`` directory, memory-mapped (see the module
    docstring).

    Raises:
        DatasetError: The directory holds no dataset ``datasets`` can load, a ``DatasetDict``
            without a ``train`` split among several, or no rows.
    """

    def __init__(self, directory: pathlib.Path) -> None:
        import datasets

        self.name = directory.name
        self._directory = directory
        try:
            loaded = datasets.load_from_disk(str(directory), keep_in_memory=False)
        except (OSError, ValueError, KeyError, TypeError, pa.ArrowException) as exc:
            raise DatasetError(
                f"The dataset directory {directory.name} is not a dataset written by "
                "datasets' save_to_disk.",
                detail=f"{directory}: {type(exc).__name__}: {exc}",
            ) from exc
        if isinstance(loaded, datasets.DatasetDict):
            splits = list(loaded)
            if "train" in loaded:
                loaded = loaded["train"]
            elif len(splits) == 1:
                loaded = loaded[splits[0]]
            else:
                raise DatasetError(
                    f"The dataset directory {directory.name} holds the splits "
                    f"{', '.join(splits)} and no 'train' split; save the one to train on.",
                    detail=str(directory),
                )
        self.columns: tuple[str, ...] | None = tuple(loaded.column_names)
        self._rows = loaded.with_format("arrow")
        if not len(self._rows):
            raise DatasetError(
                f"The dataset directory {directory.name} has no rows.", detail=str(directory)
            )

    def __len__(self) -> int:
        return len(self._rows)

    def line(self, index: int) -> int:
        return index + 1

    def where(self, index: int) -> str:
        return f"row {index + 1} of {self.name}"

    def load(self, index: int) -> Any:
        return self._rows[index].to_pylist()[0]

    def scan(self) -> Iterator[Any]:
        for batch in self._rows.iter(batch_size=_SCAN_BATCH):
            yield from batch.to_pylist()

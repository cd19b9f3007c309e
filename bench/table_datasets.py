"""Benchmark: time to the first batch of Parquet and ``save_to_disk`` datasets, at two sizes.

Prints (``python bench/table_datasets.py``), for a small and a large dataset of the same rows
(the demo's colour rows, each with its PNG inside the dataset as a Hugging Face ``Image()``
value, the way ``datasets`` writes image datasets: 100 rows a Parquet row group):

1. time to first batch (batch of 8 through a DataLoader, no workers; median of 5): opening the
   dataset and building the index table, then the first batch, for Parquet, ``save_to_disk``
   and, for reference, the JSONL path at the same sizes; the promise is that it stays flat in
   the dataset's size (large / small within 2x);
2. the background check of every row of the large dataset (no image decoded), per format.

Everything runs on CPU with one torch thread, in a temporary directory. ``--small`` and
``--large`` set the row counts (default 500 and 20,000; the large Parquet file is about 300 MiB).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import _offline  # noqa: F401  (first: offline libraries, the repository importable)
import datasets
import torch
from torch.utils.data import DataLoader

from tests.grpo_tables import PARQUET_COLUMNS, write_parquet, write_saved
from trainer_service.providers.grpo.lazy_images import Columns, LazyImageDataset, RowTransform
from trainer_service.tools import make_demo_dataset

BATCH = 8
REPEATS = 5


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def _identity(batch: list[Any]) -> list[Any]:
    return batch


def first_batch(path: pathlib.Path, root: pathlib.Path, columns: Columns) -> tuple[float, float]:
    """(open + index table, first batch) seconds, the median run of :data:`REPEATS`."""

    def once() -> tuple[float, float]:
        def open_lazy() -> Any:
            lazy = LazyImageDataset.open(path, data_root=root, columns=columns)
            return datasets.Dataset.from_dict({"_i": list(range(len(lazy)))}).with_transform(
                RowTransform(lazy)
            )

        setup, table = _timed(open_lazy)
        batch, rows = _timed(
            lambda: next(iter(DataLoader(table, batch_size=BATCH, collate_fn=_identity)))
        )
        assert len(rows) == BATCH and rows[0]["image"].mode == "RGB"
        return setup, batch

    runs = sorted((once() for _ in range(REPEATS)), key=sum)
    return runs[len(runs) // 2]


def check_seconds(path: pathlib.Path, root: pathlib.Path, columns: Columns) -> float:
    """Seconds for the background check of every row."""
    lazy = LazyImageDataset.open(path, data_root=root, columns=columns)
    elapsed, checked = _timed(lazy.check_rows)
    assert checked == len(lazy)
    return elapsed


def _repeated_jsonl(jsonl: pathlib.Path, rows: int) -> pathlib.Path:
    lines = [line for line in jsonl.read_text().splitlines() if line.strip()]
    out = jsonl.with_name(f"repeated-{rows}.jsonl")
    out.write_text("\n".join(lines[i % len(lines)] for i in range(rows)) + "\n")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description="Parquet / save_to_disk first-batch benchmark")
    parser.add_argument("--small", type=int, default=500, help="rows of the small dataset")
    parser.add_argument("--large", type=int, default=20_000, help="rows of the large dataset")
    parser.add_argument("--distinct", type=int, default=500, help="distinct images")
    args = parser.parse_args()
    if args.small % args.distinct or args.large % args.distinct:
        parser.error("--small and --large must be multiples of --distinct")
    torch.set_num_threads(1)
    datasets.disable_progress_bars()
    with tempfile.TemporaryDirectory(prefix="bench-tables-") as tmp:
        root = pathlib.Path(tmp)
        jsonl = make_demo_dataset.build(root / "demo", rows=args.distinct, size=(96, 72))
        formats: dict[str, dict[int, tuple[pathlib.Path, Columns]]] = {
            "parquet": {},
            "save_to_disk": {},
            "jsonl": {},
        }
        sizes = (args.small, args.large)
        built_s = {}
        for rows in sizes:
            repeat = -(-rows // args.distinct)
            t0 = time.perf_counter()
            parquet = write_parquet(jsonl, root / f"p{rows}" / "train.parquet", repeat=repeat)
            saved = write_saved(jsonl, root / f"s{rows}", repeat=repeat)
            built_s[rows] = time.perf_counter() - t0
            formats["parquet"][rows] = (parquet, Columns(**PARQUET_COLUMNS))
            formats["save_to_disk"][rows] = (saved, Columns())
            formats["jsonl"][rows] = (_repeated_jsonl(jsonl, repeat * args.distinct), Columns())
        large_mb = formats["parquet"][args.large][0].stat().st_size / 2**20
        print(
            f"rows: {args.small} and {args.large} ({args.distinct} distinct 96x72 PNGs in the "
            f"rows; the large Parquet file {large_mb:.0f} MiB; written in "
            f"{built_s[args.large]:.0f} s)"
        )
        print(f"cpu: {os.cpu_count()} cores, torch threads {torch.get_num_threads()}")
        print(f"\n1. time to first batch (batch of {BATCH}, no workers; median of {REPEATS})")
        print(f"   {'':34}{args.small:>9} rows{args.large:>9} rows{'large/small':>13}")
        for name, by_size in formats.items():
            results = {
                rows: first_batch(path, root, cols) for rows, (path, cols) in by_size.items()
            }
            small, large = sum(results[args.small]), sum(results[args.large])
            for label, index in (("open + index table", 0), ("first batch", 1)):
                print(
                    f"   {name + ': ' + label:34}{results[args.small][index]:>12.3f} s"
                    f"{results[args.large][index]:>12.3f} s"
                )
            print(
                f"   {name + ': total':34}{small:>12.3f} s{large:>12.3f} s{large / small:>12.2f}x"
            )
        print(f"\n2. background check of all {args.large} rows (no image decoded)")
        for name, by_size in formats.items():
            path, cols = by_size[args.large]
            print(f"   {name:34}{check_seconds(path, root, cols):>12.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

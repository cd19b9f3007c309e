"""Benchmark: what a GRPO job's DataLoader workers cost to start, with the loader's own collate and
seed functions (``loader_parts``, as shipped) against TRL's and transformers' (``identity`` and
``seed_worker``, what the trainer would use unchanged).

A worker unpickles those functions by module, so TRL's would make each worker import TRL,
transformers, ``torch.distributed`` and dynamo. For each variant, side by side and alternating
(``python bench/grpo_workers.py``), it builds the tiny VLM's trainer, starts its training
DataLoader (2 workers, forkserver, as a job does) and reads two batches, then prints the time to
the first batch and each worker's CPU time and memory (RSS and USS, read while the workers live).
Target: the shipped workers start in well under a second of CPU each.
"""

from __future__ import annotations

import argparse
import functools
import os
import pathlib
import statistics
import tempfile
import time
from typing import Any

import _offline  # noqa: F401  (first: offline libraries, the repository importable)

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import psutil
import torch

from trainer_service.providers.grpo.library_output import WorkerLogging
from trainer_service.tools import make_demo_dataset, make_tiny_vlm

# The workers import this script as their main module (forkserver children do): TRL,
# transformers and the test fixtures (pytest) are imported in the functions below, so that a
# worker does not import them here.

MIB = 1024 * 1024


def _measure(root: pathlib.Path, workers: int, libraries: bool) -> dict[str, float]:
    """Starts the loader's workers, reads two batches; the first batch's wait and the workers'
    mean CPU seconds, RSS and USS (MiB)."""
    from transformers.trainer_utils import seed_worker
    from trl.trainer.utils import identity

    from tests.grpo_fixtures import make_job, tiny_grpo_task
    from trainer_service.providers.grpo.build import build_trainer

    job = make_job(root, tiny_grpo_task(workers=workers), seed=3, run_id="bench-workers")
    trainer = build_trainer(job, output_dir=str(root / "out"), provenance_key="_p")
    loader = trainer.get_train_dataloader()
    base = getattr(loader, "base_dataloader", loader)
    if libraries:  # what the Trainer and TRL install, before this project's replacements
        base.collate_fn = identity
        seed = functools.partial(seed_worker, num_workers=workers, rank=0)
        base.worker_init_fn = WorkerLogging.like_this_process(seed)
    start = time.perf_counter()
    batches = iter(loader)
    rows = list(next(batches))
    first = time.perf_counter() - start
    rows += next(batches)
    try:
        pids = {row["_p"]["pid"] for row in rows}
        processes = [psutil.Process(pid) for pid in pids]
        cpu = [sum(p.cpu_times()[:2]) for p in processes]
        memory = [p.memory_full_info() for p in processes]
    finally:
        del batches  # stops the persistent workers
    return {
        "first": first,
        "cpu": statistics.mean(cpu),
        "rss": statistics.mean(m.rss for m in memory) / MIB,
        "uss": statistics.mean(m.uss for m in memory) / MIB,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="measurements per variant")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    with tempfile.TemporaryDirectory(prefix="grpo-workers-bench-") as tmp:
        root = pathlib.Path(tmp)
        from tests.grpo_fixtures import DATASET_FILE, MODEL_DIR

        make_tiny_vlm.build(root / MODEL_DIR)
        make_demo_dataset.build((root / DATASET_FILE).parent, rows=16)
        _measure(root, args.workers, libraries=False)  # warms the fork server and page cache
        for _ in range(args.rounds):
            for libraries in (True, False):
                results[libraries].append(_measure(root, args.workers, libraries))
    print(
        f"GRPO DataLoader workers ({args.workers}, forkserver), median of {args.rounds} rounds, "
        "per worker:"
    )
    print(f"{'':34}{'first batch':>12}{'CPU':>10}{'RSS':>11}{'USS':>11}")
    variants = ((True, "TRL's identity + seed_worker"), (False, "loader_parts (shipped)"))
    for libraries, name in variants:
        rows = results[libraries]

        def median(key: str, rows: list[dict[str, Any]] = rows) -> float:
            return statistics.median(row[key] for row in rows)

        print(
            f"{name:34}{median('first'):>10.2f} s{median('cpu'):>8.2f} s"
            f"{median('rss'):>7.0f} MiB{median('uss'):>7.0f} MiB"
        )
    ours, theirs = results[False], results[True]
    ratio = statistics.median(r["cpu"] for r in theirs) / max(
        1e-3, statistics.median(r["cpu"] for r in ours)
    )
    print(f"worker start CPU, TRL's / shipped: {ratio:.1f}x")
    shipped = statistics.median(r["cpu"] for r in ours)
    verdict = "ok " if shipped < 1.0 else "MISS"
    print(f"  {verdict} shipped worker start CPU < 1 s: {shipped:.2f} s")


if __name__ == "__main__":
    main()

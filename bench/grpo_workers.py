"""Benchmark: what a GRPO job's DataLoader workers cost to start, three ways side by side: forked
from the rank (as a job's ranks start them, shipped), from a fork server with the loader's own
collate and seed functions (``loader_parts``, as a process that has gRPC starts them), and from a
fork server with TRL's and transformers' (``identity`` and ``seed_worker``, what the trainer would
use unchanged).

A worker started from a fork server unpickles those functions by module, so TRL's would make each
worker import TRL, transformers, ``torch.distributed`` and dynamo; and each job's rank would start
a fork server of its own (torch, datasets and PIL imported). For each variant, alternating
(``python bench/grpo_workers.py``), it builds the tiny VLM's trainer, starts its training
DataLoader (2 workers) with a fresh fork server where it uses one, and reads two batches, then
prints the time to the first batch, the CPU it took to get the workers up (the fork server's
included) and each worker's memory (RSS and USS, read while the workers live).
Targets: the shipped workers start in well under a second of CPU all told, faster than from a
fork server.
"""

from __future__ import annotations

import argparse
import functools
import os
import pathlib
import statistics
import tempfile
import time

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


def _measure(root: pathlib.Path, workers: int, variant: str) -> dict[str, float]:
    """Starts the loader's workers the ``variant``'s way, reads two batches; the first batch's
    wait, the CPU seconds to get the workers up (theirs and a fork server's) and the workers'
    mean RSS and USS (MiB)."""
    import multiprocessing.forkserver

    from transformers.trainer_utils import seed_worker
    from trl.trainer.utils import identity

    from tests.grpo_fixtures import make_job, tiny_grpo_task
    from trainer_service.providers.grpo import settings
    from trainer_service.providers.grpo.build import build_trainer

    server = multiprocessing.forkserver._forkserver  # type: ignore[attr-defined]
    server._stop()  # a fresh fork server per measurement, as each rank of a job would start one
    shipped = settings.worker_start_method
    if variant == FORK:
        settings.worker_start_method = lambda: "fork"  # type: ignore[assignment]
    else:
        multiprocessing.get_context("forkserver").set_forkserver_preload(settings.WORKER_PRELOAD)
        settings.worker_start_method = lambda: "forkserver"  # type: ignore[assignment]
    try:
        job = make_job(root, tiny_grpo_task(workers=workers), seed=3, run_id="bench-workers")
        trainer = build_trainer(job, output_dir=str(root / "out"), provenance_key="_p")
    finally:
        settings.worker_start_method = shipped  # type: ignore[assignment]
    loader = trainer.get_train_dataloader()
    base = getattr(loader, "base_dataloader", loader)
    if variant == LIBRARIES:  # what the Trainer and TRL install, before this project's own
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
        cpu = sum(sum(p.cpu_times()[:2]) for p in processes)
        if variant != FORK:
            cpu += sum(psutil.Process(server._forkserver_pid).cpu_times()[:2])
        memory = [p.memory_full_info() for p in processes]
    finally:
        del batches  # stops the persistent workers
    return {
        "first": first,
        "cpu": cpu,
        "rss": statistics.mean(m.rss for m in memory) / MIB,
        "uss": statistics.mean(m.uss for m in memory) / MIB,
    }


FORK = "forked from the rank (shipped)"
OURS = "fork server, loader_parts"
LIBRARIES = "fork server, TRL's functions"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="measurements per variant")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers")
    args = parser.parse_args()
    torch.set_num_threads(1)
    variants = (FORK, OURS, LIBRARIES)
    results: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory(prefix="grpo-workers-bench-") as tmp:
        root = pathlib.Path(tmp)
        from tests.grpo_fixtures import DATASET_FILE, MODEL_DIR

        make_tiny_vlm.build(root / MODEL_DIR)
        make_demo_dataset.build((root / DATASET_FILE).parent, rows=16)
        _measure(root, args.workers, OURS)  # warms the page cache
        for _ in range(args.rounds):
            for variant in variants:
                results[variant].append(_measure(root, args.workers, variant))

    def median(variant: str, key: str) -> float:
        return statistics.median(row[key] for row in results[variant])

    print(f"GRPO DataLoader workers ({args.workers}), median of {args.rounds} rounds:")
    print(f"{'':34}{'first batch':>12}{'CPU, all':>10}{'RSS each':>11}{'USS each':>11}")
    for variant in variants:
        print(
            f"{variant:34}{median(variant, 'first'):>10.2f} s{median(variant, 'cpu'):>8.2f} s"
            f"{median(variant, 'rss'):>7.0f} MiB{median(variant, 'uss'):>7.0f} MiB"
        )
    for other in (OURS, LIBRARIES):
        print(
            f"{other} / shipped: CPU x{median(other, 'cpu') / max(1e-3, median(FORK, 'cpu')):.1f}"
            f", first batch x{median(other, 'first') / max(1e-3, median(FORK, 'first')):.1f}"
        )
    shipped = median(FORK, "cpu")
    verdict = "ok " if shipped < 1.0 and shipped < median(OURS, "cpu") else "MISS"
    print(
        f"  {verdict} shipped workers start in < 1 s of CPU, less than from a fork server: "
        f"{shipped:.2f} s"
    )


if __name__ == "__main__":
    main()

"""The training DataLoader's functions that travel to its workers: how a batch is collated and
how a worker seeds itself.

A worker started from a fork server (in a process with gRPC; a rank's workers fork from it and
unpickle nothing) unpickles these by module. TRL's and transformers' own versions
(``trl.trainer.utils.identity`` and ``transformers.trainer_utils.seed_worker``) would make every
such worker import TRL, transformers, ``torch.distributed`` and dynamo, paying their import time
and memory in every worker, every time a job starts its workers. Defined here, they cost
nothing: this module imports only what the workers' fork server already holds
(``settings.WORKER_PRELOAD``).
"""

from __future__ import annotations

import random
from typing import Any

import numpy
import torch

__all__ = ["WorkerSeed", "collate_rows"]


def collate_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A GRPO batch is its list of rows, as they are (TRL collates nothing either)."""
    return rows


class WorkerSeed:
    """A ``worker_init_fn`` that seeds ``random``, numpy and torch in a worker, as the Hugging Face
    Trainer's own ``seed_worker`` does: ``num_workers x rank + torch.initial_seed() mod 2**32``.

    The DataLoader has already seeded torch per worker (from its generator and the worker's
    index); this spreads that seed to the other generators, offset by the rank, so that ranks'
    workers draw different streams.

    Args:
        num_workers: The DataLoader's worker count.
        rank: The process's index in the job (``args.process_index``).
    """

    def __init__(self, num_workers: int, rank: int) -> None:
        self.num_workers = num_workers
        self.rank = rank

    def __call__(self, worker_id: int) -> None:
        seed = self.num_workers * self.rank + torch.initial_seed() % 2**32
        random.seed(seed)
        numpy.random.seed(seed % 2**32)
        torch.manual_seed(seed)

"""The DataLoader functions that travel to GRPO workers (``loader_parts``): they seed a worker
as the Hugging Face Trainer's ``seed_worker`` does, and pickle by a module of ours."""

from __future__ import annotations

import pickle
import random

import numpy
import torch

from trainer_service.providers.grpo.loader_parts import WorkerSeed, collate_rows


def _draws() -> tuple[float, float, float]:
    return random.random(), float(numpy.random.random()), float(torch.rand(()))


def test_a_worker_seed_is_its_torch_seed_offset_by_the_rank() -> None:
    torch.manual_seed(1234)
    WorkerSeed(num_workers=2, rank=0)(worker_id=1)
    rank0 = _draws()
    torch.manual_seed(1234)
    WorkerSeed(num_workers=2, rank=0)(worker_id=1)
    assert _draws() == rank0  # a pure function of the worker's torch seed and its rank

    torch.manual_seed(1234)
    WorkerSeed(num_workers=2, rank=1)(worker_id=1)
    rank1 = _draws()
    assert all(a != b for a, b in zip(rank0, rank1, strict=True))
    # The formula of transformers' seed_worker: num_workers x rank + torch.initial_seed().
    random.seed(2 * 1 + 1234)
    assert rank1[0] == random.random()


def test_they_pickle_by_reference_to_this_light_module() -> None:
    seed = pickle.loads(pickle.dumps(WorkerSeed(3, 2)))
    assert (seed.num_workers, seed.rank) == (3, 2)
    assert pickle.loads(pickle.dumps(collate_rows)) is collate_rows
    rows = [{"prompt": "a"}, {"prompt": "b"}]
    assert collate_rows(rows) is rows

"""The ``grpo`` provider: TRL's GRPOTrainer on prepared image+text rows, one episode per step.

The trainer runs every GRPO job in processes of its own (:mod:`.process`: ``num_processes`` of
them, one per device, under torch.distributed when there are several); :mod:`.build` makes the
GRPOTrainer each of those processes trains (:mod:`.worker`), with the settings of
:mod:`.settings`, and :mod:`.callback` turns its steps into episodes.

Importing this package is cheap (no torch, trl or transformers): the registry imports it to list
providers, and :func:`validate` runs before a slot is taken. Neither does :func:`run` import the
training stack into the trainer: its processes do.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from trainer_service.providers.grpo.validation import validate

if TYPE_CHECKING:
    from trainer_service.core.provider import TrainJob
    from trainwire.v1 import episode_pb2

__all__ = ["run", "slots_needed", "validate"]


def run(job: TrainJob) -> Iterator[episode_pb2.Episode]:
    """Trains ``job`` in its own processes; yields one episode per optimizer step."""
    from trainer_service.providers.grpo import process

    return process.run(job)


def slots_needed(task: episode_pb2.TrainTask) -> int:
    """Trainer slots (devices) a task takes: one per process."""
    return max(1, task.grpo.num_processes)

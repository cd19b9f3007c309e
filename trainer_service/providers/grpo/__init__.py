"""The ``grpo`` provider: TRL's GRPOTrainer on prepared image+text rows, one episode per step.

The trainer runs every GRPO job in processes of its own (:mod:`.process`: ``num_processes`` of
them, one per device, under torch.distributed when there are several; a job placed across
trainers runs its ranks on each of them, meeting in rank 0's store, :mod:`.rendezvous`);
:mod:`.build` makes the GRPOTrainer each of those processes trains (:mod:`.worker`), with the
settings of :mod:`.settings`, and :mod:`.callback` turns its steps into episodes.

Importing this package is cheap (no torch, trl or transformers): the registry imports it to list
providers, :func:`validate` runs before a slot is taken, :func:`reward_functions` lists the reward
names a task may use (those of the trainer's reward modules included), and :func:`hyperparameters` /
:func:`check_hyperparameters` answer for live changes (:mod:`.hyperparameters`). Neither does
:func:`run` import the training stack into the trainer: its processes do.
"""

from __future__ import annotations

import pathlib
import threading
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from trainer_service.providers.defaults import GRPO, grpo_proto
from trainer_service.providers.grpo.hyperparameters import check_hyperparameters, hyperparameters
from trainer_service.providers.grpo.validation import reward_functions, validate

if TYPE_CHECKING:
    from trainer_service.core.provider import TrainJob
    from trainwire.v1 import episode_pb2, trainer_service_pb2

__all__ = [
    "DEFAULT_CHECKPOINT_EVERY",
    "check_hyperparameters",
    "defaults",
    "hyperparameters",
    "merge_checkpoint",
    "reward_functions",
    "run",
    "slots_needed",
    "validate",
]

#: Optimizer steps between checkpoints when the config leaves ``checkpoint_every`` at 0 (see
#: :class:`trainer_service.providers.defaults.GrpoDefaults`).
DEFAULT_CHECKPOINT_EVERY = GRPO.checkpoint_every


def run(job: TrainJob) -> Iterator[episode_pb2.Episode]:
    """Trains ``job`` in its own processes; yields one episode per optimizer step."""
    from trainer_service.providers.grpo import process

    return process.run(job)


def slots_needed(task: episode_pb2.TrainTask) -> int:
    """Trainer slots (devices) a task takes: one per process (a share of a job placed across
    trainers takes its own processes' slots instead; the runner's admission sees to that)."""
    return max(1, task.grpo.num_processes or GRPO.num_processes)


def defaults() -> trainer_service_pb2.ProviderDefaults:
    """What a job trains with where its task or config leaves a field at 0 (``GetCapabilities``
    advertises it; see :mod:`trainer_service.providers.defaults`)."""
    return grpo_proto()


def merge_checkpoint(
    checkpoint_dir: pathlib.Path,
    out_dir: pathlib.Path,
    data_roots: Sequence[pathlib.Path],
    stop: threading.Event,
) -> None:
    """Writes a LoRA checkpoint merged into its base model into ``out_dir``, in a process of its
    own (the trainer loads no training stack; see :func:`.merge.merge_checkpoint`)."""
    from trainer_service.providers.grpo import merge

    merge.merge_checkpoint(checkpoint_dir, out_dir, data_roots, stop)

"""The ``grpo`` provider: TRL's GRPOTrainer on prepared image+text rows, one episode per step.

Importing this package is cheap (no torch, trl or transformers): the registry imports it to list
providers, and :func:`validate` runs before a slot is taken. :func:`run` imports the training
stack on first use.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from trainer_service.providers.grpo.validation import validate

if TYPE_CHECKING:
    from trainer_service.core.provider import TrainJob
    from trainwire.v1 import episode_pb2

__all__ = ["run", "validate"]


def run(job: TrainJob) -> Iterator[episode_pb2.Episode]:
    """Trains ``job`` and yields one episode per optimizer step (see :mod:`.provider`)."""
    from trainer_service.providers.grpo import provider

    return provider.run(job)

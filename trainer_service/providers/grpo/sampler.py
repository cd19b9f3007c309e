"""The training sampler: TRL's ``RepeatSampler`` whose order in each epoch depends on the epoch
alone, so a resumed job continues with the rows an uninterrupted one would have used.

TRL's ``RepeatSampler`` draws one permutation per pass from a generator it seeds once, so epoch
``e`` gets the ``e+1``-th draw. A trainer resumed in epoch ``e`` builds a fresh sampler, and
``Trainer`` skips the epochs before ``e`` without iterating them: without help the resumed epoch
would get the first draw, the order of epoch 0. :class:`EpochSampler` reseeds the generator
and replays the ``e`` earlier draws on ``set_epoch(e)`` (``Trainer`` calls it at the start of
every epoch, through accelerate's loader), so epoch ``e`` has the same order however the job
got there. Replaying costs one ``randperm`` of the dataset per earlier epoch, once per epoch.

Skipping the batches already trained in the resumed epoch is accelerate's
``skip_first_batches``: a ``SkipBatchSampler`` drops their indices before any row is read, so
no skipped row is decoded.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import Sampler
from trl.trainer.utils import RepeatSampler


class EpochSampler(Sampler[int]):
    """Yields what ``sampler`` yields in its ``epoch``-th pass (see the module docstring).

    Args:
        sampler: TRL's sampler, as ``GRPOTrainer._get_train_sampler`` makes it.
    """

    def __init__(self, sampler: RepeatSampler) -> None:
        self.sampler = sampler
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Chooses the pass the next iteration yields."""
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[int]:
        inner = self.sampler
        if inner.shuffle and inner.seed is not None:
            inner.generator.manual_seed(inner.seed)
            for _ in range(self.epoch):  # the draws of the earlier epochs
                torch.randperm(inner.num_samples, generator=inner.generator)
        return iter(inner)

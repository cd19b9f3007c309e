"""``Checkpoints`` for provider tests: committed checkpoints are directories under a local root.

A provider writes into :meth:`LocalCheckpoints.scratch` and commits (or reports a failed
write); the commit moves the directory to ``<root>/episode-<n>`` and records it, so a test can
read what was committed, in which order, and resume from any of it
(:meth:`LocalCheckpoints.restored`).
"""

from __future__ import annotations

import os
import pathlib
import shutil
import threading
from dataclasses import dataclass

from trainer_service.core.provider import RestoredCheckpoint


@dataclass(frozen=True)
class Committed:
    """One committed checkpoint."""

    episode: int
    best_reward: float
    directory: pathlib.Path


class LocalCheckpoints:
    """Checkpoints every ``every`` episodes and at ``last``, committed under ``root``.

    Args:
        root: Where scratch and committed directories go.
        every: The interval (0: only the last, and a final one when wanted).
        last: The job's last episode (always due).
    """

    def __init__(self, root: pathlib.Path, every: int, last: int) -> None:
        self.root = root
        self.every = every
        self.last = last
        self.committed: list[Committed] = []
        self.failed: list[tuple[int, str]] = []  #: (episode, message) of each ``fail``
        self.final = threading.Event()  #: set: the job wants a final checkpoint
        self.asked_final = 0  #: how often final_wanted() was asked

    def due(self, episode: int) -> bool:
        return episode == self.last or (self.every > 0 and episode % self.every == 0)

    def final_wanted(self) -> bool:
        self.asked_final += 1
        return self.final.is_set()

    def scratch(self, episode: int) -> pathlib.Path:
        directory = self.root / f"scratch-{episode}"
        directory.mkdir(parents=True)
        return directory

    def commit(self, episode: int, best_reward: float, directory: pathlib.Path) -> None:
        target = self.root / f"episode-{episode}"
        os.replace(directory, target)
        self.committed.append(Committed(episode, best_reward, target))

    def fail(self, episode: int, message: str, directory: pathlib.Path | None = None) -> None:
        self.failed.append((episode, message))
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)

    def restored(self, episode: int) -> RestoredCheckpoint:
        """The committed checkpoint of ``episode``, as a job resumes from it."""
        (found,) = [c for c in self.committed if c.episode == episode]
        return RestoredCheckpoint(found.directory, found.episode, found.best_reward)

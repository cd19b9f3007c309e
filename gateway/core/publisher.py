"""A run's publisher: episodes from the inbox to the store at the run's pace (none while
paused), visible to watchers only once committed, in order.

``episode`` (the run's published episode) is the last one the store has committed; an episode
enters the run's ``EpisodeLog`` only after its commit, so nothing a watcher saw can be lost by a
crash. The publisher knows nothing of the trainer: after each commit it calls ``on_commit``
(where the driver grants credit).

Each episode is encoded once (``gateway.core.framing.encode_episode``): the store's record and
the live log take their bytes, frames and JSON from that one ``EncodedEpisode``.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable

from gateway.core.curve import CurveBuilder
from gateway.core.details import DetailRetention
from gateway.core.feed import Inbox
from gateway.core.framing import EncodedEpisode, encode_episode
from gateway.core.live_log import EpisodeLog
from gateway.core.observer import Observer
from gateway.core.pacing import Pacer
from gateway.core.runs import RunState, TrainingRun
from gateway.core.store import EpisodeRecord, NotOwner, Store
from trainwire.v1 import episode_pb2

_LOGGER = logging.getLogger(__name__)

#: Episodes a run may have handed to the store but not yet seen committed; the publisher waits
#: beyond this.
MAX_UNCOMMITTED = 256


class Publisher:
    """Publishes one run's episodes (see the module docstring).

    Args:
        run: The run (``record_episode`` on each commit).
        log: Its published history.
        pacer: Its pace.
        store: Where episodes are committed.
        observer: Metrics hooks.
        on_commit: Called after each committed episode.
    """

    def __init__(
        self,
        run: TrainingRun,
        log: EpisodeLog,
        pacer: Pacer,
        store: Store,
        observer: Observer,
        on_commit: Callable[[], None],
        details: DetailRetention | None = None,
    ) -> None:
        self._run = run
        self._log = log
        self._pacer = pacer
        self._store = store
        self._observer = observer
        self._on_commit_hook = on_commit
        # Set by every control (pause, resume, speed, stop) to wake a waiting publisher.
        self._control = asyncio.Event()
        # Set by every commit of this run's episodes.
        self._committed = asyncio.Event()
        # Handed to the store, awaiting commit.
        self._pending: deque[EncodedEpisode] = deque()
        #: The run's curve blocks (``restore_curve`` after a restart or a takeover).
        self.curve = CurveBuilder(run.episode)
        #: Which details the store keeps (told of every commit); None: all of them.
        self.details = details
        self._error: BaseException | None = None

    def restore_curve(self, curve: CurveBuilder) -> None:
        """Goes on with the curve blocks a gateway restart or a takeover restored."""
        self.curve = curve

    def controlled(self) -> None:
        """A control changed the run's state or speed: re-evaluates a pending wait now."""
        self._control.set()

    async def run(self, inbox: Inbox, reader: asyncio.Task[None]) -> None:
        """Publishes from ``inbox`` until the done episode is handed to the store; raises what
        ``reader`` (the producer) raised: at once while the run is paused (its trainer is
        re-attached while it holds), otherwise once the inbox is published."""
        reader.add_done_callback(lambda _: self._control.set())
        while True:
            while not len(inbox):
                if reader.done():
                    reader.result()  # raises the reader's failure
                    if len(inbox):
                        break
                    return  # ended without done: the reader's checker already raised
                await inbox.changed()
            await self._until_publishable(reader)
            episode = inbox.take()
            self._publish(episode)
            if episode.done:
                return

    async def _until_publishable(self, reader: asyncio.Task[None]) -> None:
        """Waits while the run is paused, then for its pace."""
        while True:
            if self._error is not None:
                raise self._error
            if self._run.state is RunState.PAUSED:
                if reader.done() and not reader.cancelled() and reader.exception() is not None:
                    reader.result()  # its stream broke: re-attached (or failed) now
                self._control.clear()
                await self._control.wait()
                continue
            if len(self._pending) >= MAX_UNCOMMITTED:
                self._committed.clear()
                await self._committed.wait()
                continue
            delay = self._pacer.delay()
            if delay <= 0:
                return
            self._control.clear()
            try:
                async with asyncio.timeout(delay):
                    await self._control.wait()
            except TimeoutError:
                pass

    def _publish(self, episode: episode_pb2.Episode) -> None:
        """Hands an episode to the store; it becomes visible when committed."""
        n = episode.episode
        keep = self.details is None or self.details.keeps(n, episode.done)
        # The store keeps the JSON of the numbers, and of the detail only when it keeps the
        # detail for good: a recent detail is mostly dropped, and the few settled later (a
        # stretch's best) have theirs written when read. So the detail's JSON is written here
        # only then; the live log writes the others' if an HTTP watcher asks for them.
        encoded = encode_episode(episode, keep_detail=keep)
        self._pending.append(encoded)
        self._pacer.published()
        blocks = self.curve.add(n, episode.reward, episode.best_reward, episode.metrics)
        record = EpisodeRecord(
            self._run.id,
            n,
            encoded.reward,
            encoded.best_reward,
            encoded.data,
            encoded.detail_at,
            blocks,
            keep,
            encoded.scalar_json,
            encoded.detail_json if keep else None,
        )
        self._store.append_episode(record, self._committed_one)

    def _committed_one(self, error: BaseException | None) -> None:
        self._committed.set()
        if error is not None:
            if self._error is None and not isinstance(error, NotOwner):
                _LOGGER.error(
                    "run %s: storing episode %d failed: %s",
                    self._run.id,
                    self._pending[0].episode if self._pending else 0,
                    error,
                    extra={"run_id": self._run.id},
                )
            self._error = error
            self._control.set()
            return
        encoded = self._pending.popleft()
        n, reward = encoded.episode, encoded.reward
        self._run.record_episode(n, reward, encoded.best_reward)
        self._log.publish_encoded((encoded,))
        if self.details is not None:
            self.details.committed(n, reward, encoded.has_detail)
        self._observer.episodes_published(self._run.id, 1)
        self._on_commit_hook()

    async def flush(self) -> None:
        """Waits until every episode handed to the store is committed (and visible).

        Raises:
            What the store raised for a commit (``StoreWriteFailed``, ``NotOwner``).
        """
        while self._pending:
            if self._error is not None:
                raise self._error
            self._committed.clear()
            await self._committed.wait()

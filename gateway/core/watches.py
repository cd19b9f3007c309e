"""Watches of runs: a run's history after a given episode, then its live episodes, from the
log of its driver, of a follower (a run another replica drives) or from the store (a finished
run), through ``Replay`` (``gateway.core.replay``), counted for the metrics."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

from gateway.core.catalog import require_run_id
from gateway.core.errors import InvalidRequest, ShuttingDown
from gateway.core.follower import Follower
from gateway.core.framing import view_of
from gateway.core.observer import Observer
from gateway.core.replay import EpisodeFrames, Replay, WatchEvent
from gateway.core.router import ReplicaRouter
from gateway.core.runs import TrainingRun
from gateway.core.table import RunTable
from trainwire.contract import FieldViolation


class Watches:
    """Serves watch streams (see the module docstring).

    Args:
        table: The active runs (and whether the gateway is closing).
        replay: Walks a log or a finished run's history.
        router: With replicas, what the watchers of a run driven elsewhere follow (None:
            every active run is driven here).
        get_run: A run by id (raises ``RunNotFound``).
        observer: Metrics hooks.
    """

    def __init__(
        self,
        table: RunTable,
        replay: Replay,
        router: ReplicaRouter | None,
        get_run: Callable[[str], Awaitable[TrainingRun]],
        observer: Observer,
    ) -> None:
        self._table = table
        self._replay = replay
        self._router = router
        self._get_run = get_run
        self._observer = observer

    async def watch(
        self, run_id: str, after_episode: int, scalars: bool = False, json: bool = False
    ) -> AsyncIterator[WatchEvent]:
        """Streams a run's history after ``after_episode``, then its live episodes (without
        their detail: ``scalars``), as frames or as their JSON (``json``: the HTTP side's event
        stream).

        Raises:
            InvalidRequest: empty run id or negative after_episode.
            RunNotFound: no such run (or deleted while replayed).
            ShuttingDown: the gateway is stopping.
        """
        require_run_id(run_id)
        if after_episode < 0:
            raise InvalidRequest(
                f"after_episode of run {run_id!r} must be >= 0, got {after_episode}",
                [FieldViolation("after_episode", f"{after_episode}; need >= 0")],
                run_id,
            )
        if self._table.closing:
            raise ShuttingDown(f"the gateway is shutting down; resume watching run {run_id!r}")
        view = view_of(scalars, json)
        observer = self._observer
        observer.watcher_attached(run_id)
        follower: Follower | None = None
        try:
            driver = self._table.get(run_id)
            if driver is not None:
                snapshot = driver.snapshot if self._router is None else self._router.view(driver)
                events = self._replay.active(
                    driver.log, lambda: snapshot().state, snapshot, after_episode, view
                )
            else:
                run = await self._get_run(run_id)
                follower = None if self._router is None else self._router.follow(run)
                if follower is None:
                    events = self._replay.finished(run, after_episode, view)
                else:  # another replica drives it: follow it in the store
                    await follower.ready()
                    f = follower
                    events = self._replay.active(
                        f.log, lambda: f.run.state, f.snapshot, after_episode, view
                    )
            async for event in events:
                if type(event) is EpisodeFrames:  # one call per message, not per episode
                    observer.episodes_sent(run_id, len(event.frames))
                yield event
        finally:
            if follower is not None and self._router is not None:
                self._router.unfollow(follower)
            observer.watcher_detached(run_id)

"""Which episodes of a long run keep their detail (motions, completions) in the store.

Every episode keeps its numbers (reward, best reward, metrics, time) for ever. Details are what
make a long run large (an imitation motion is 2.6-31 KiB, a GRPO step's completions and
samples with their thumbnails about 20 KiB, at most about 250 KiB), so a run keeps the detail
of:

- every episode whose number is a multiple of its *detail stride*, ``ceil(max_episodes /
  details_per_run)`` (``CoreSettings.details_per_run``, 10,000): a run of up to 10,000
  episodes keeps every detail its trainer sent, a 1M-episode run one in every 100 episodes
  (about 10,000 details whatever its length);
- its last episode;
- every checkpoint's episode (the recorded ones, and every multiple of the run's checkpoint
  interval, so a downloaded model has the motion it made: its ``checkpoint_every``, or where
  that is 0 the default its trainer advertises, see ``DetailRetention.checkpoint_every``);
- the best: the episode with the highest reward among those with detail, in each stretch of
  episodes thinned at once, so the run's best motion stays whatever comes after it.

The first three are known when an episode is committed, and its detail is stored for good
(``EpisodeRecord.keep_detail``). The others are stored as *recent* and settled once they are two
live tails (``CoreSettings.live_episodes``, 2048) behind the last committed episode (after the
live tail, which watchers read from memory with every detail), a chunk of at least that many at
a time, and all at once when the run ends: the best and the recorded checkpoints (a park or a
stop writes one at any episode) are kept, the others dropped. Recent details are stored apart,
so dropping a range of them frees whole pages for the next ones, and the store stays about as
large as what is kept. Live watchers
see every detail a trainer sent; a replay of older history sees the kept ones, and an episode
whose detail was dropped comes without one (never made up). After a gateway restart the thinning
settles what the previous gateway left recent at its first chunk, without knowing that stretch's
best.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable

from gateway.core.runs import TrainingRun
from gateway.core.store import NotOwner, Store, StoreWriteFailed
from trainwire.v1 import trainer_service_pb2

_LOGGER = logging.getLogger(__name__)

#: What a provider trains with by default, as a trainer advertised it: ``(kind, address)`` -> its
#: ``ProviderDefaults``, or None where none was advertised (``Scheduler.provider_defaults``).
DefaultsLookup = Callable[[str, str], trainer_service_pb2.ProviderDefaults | None]


def detail_stride(max_episodes: int, details_per_run: int) -> int:
    """Every this many episodes keep their detail (see the module docstring)."""
    return max(1, math.ceil(max_episodes / details_per_run))


class DetailRetention:
    """Drops the details a run does not keep, as it goes (see the module docstring).

    Args:
        run: The run.
        kind: Its task's kind (whose provider's checkpoint interval counts).
        store: Where its episodes are.
        spawn: Runs a background task.
        forget_pages: Drops cached history pages of ``(run_id, first, last)``.
        live_episodes: The live tail's length: details are dropped twice that far behind, a
            chunk of twice that many at a time.
        details_per_run: Sets the stride.
        provider_defaults: Where the providers' defaults are looked up (for the checkpoint
            interval of a run whose config says 0); None: nowhere, so such a run keeps only
            its recorded checkpoints' details.
    """

    def __init__(
        self,
        run: TrainingRun,
        kind: str,
        store: Store,
        spawn: Callable[..., None],
        forget_pages: Callable[[str, int, int], None],
        live_episodes: int,
        details_per_run: int,
        provider_defaults: DefaultsLookup | None = None,
    ) -> None:
        self._run = run
        self._kind = kind
        self.provider_defaults = provider_defaults
        self._store = store
        self._spawn = spawn
        self._forget_pages = forget_pages
        # A fork keeps as many details as a run of its own length (from its fork episode).
        self.stride = detail_stride(run.config.max_episodes - run.fork_episode, details_per_run)
        self._window = self._chunk = 2 * live_episodes
        #: Episodes through this one are settled (0 after a restart: the first chunk settles
        #: what a previous gateway left recent, a quick delete of few rows; a fork has nothing
        #: before its fork episode).
        self.thinned = run.fork_episode
        self._best: tuple[float, int] | None = None  # of the stretch not thinned yet
        self._idle = asyncio.Event()  # set while no chunk is being settled
        self._idle.set()

    @property
    def active(self) -> bool:
        """Whether this run drops anything (a run of up to ``DETAILS_PER_RUN`` episodes keeps
        every detail)."""
        return self.stride > 1

    @property
    def checkpoint_every(self) -> int:
        """The run's checkpoint interval: its config's ``checkpoint_every``; where that is 0, the
        provider's default as the trainer the run is placed on (rank 0's, ``run.trainer``)
        advertises it, or, before the run is placed and where that trainer advertises none (one
        older than ``provider_defaults``), as another trainer of this gateway does. 0 while no
        trainer has advertised one: then only the checkpoints recorded when a stretch is
        settled keep their details."""
        every = self._run.config.checkpoint_every
        if every or self.provider_defaults is None:
            return every
        defaults = self.provider_defaults(self._kind, self._run.trainer)
        return defaults.checkpoint_every if defaults is not None else 0

    def keeps(self, episode: int, done: bool) -> bool:
        """Whether an episode's detail is kept for good when it is committed (the others are
        recent until settled)."""
        if not self.active or done or episode % self.stride == 0:
            return True
        every = self.checkpoint_every
        return bool(every and episode % every == 0)

    def committed(self, episode: int, reward: float, has_detail: bool) -> None:
        """An episode was committed; settles a chunk once one is far enough behind."""
        if not self.active:
            return
        if has_detail and episode > self.thinned and (self._best is None or reward > self._best[0]):
            self._best = (reward, episode)
        if self._idle.is_set() and episode - self._window - self.thinned >= self._chunk:
            self._idle.clear()
            self._spawn(
                self._thin(episode - self._window, keep_last=False),
                f"gateway-details-{self._run.id}",
            )

    async def finish(self) -> None:
        """Thins what is left of a run that ended (its last episode keeps its detail), after
        the chunk being settled, if one is."""
        if not self.active:
            return
        while not self._idle.is_set():
            await self._idle.wait()
        if self._run.episode > self.thinned:
            self._idle.clear()
            await self._thin(self._run.episode, keep_last=True)

    async def _thin(self, last: int, keep_last: bool) -> None:
        first = self.thinned + 1
        try:
            keep = set()
            if self._best is not None and first <= self._best[1] <= last:
                keep.add(self._best[1])
            if keep_last:
                keep.add(last)
            for record in await self._store.list_checkpoints(self._run.id):
                if first <= record.episode <= last:
                    keep.add(record.episode)
            dropped = await self._store.settle_details(self._run.id, first, last, sorted(keep))
            self._forget_pages(self._run.id, first, last)
            self.thinned = last
            if self._best is not None and self._best[1] <= last:
                self._best = None
            _LOGGER.debug(
                "run %s: dropped the details of %d of episodes %d..%d",
                self._run.id,
                dropped,
                first,
                last,
                extra={"run_id": self._run.id},
            )
        except (NotOwner, StoreWriteFailed) as exc:
            # Kept for now: a later chunk (or the run's end) covers them again.
            _LOGGER.warning(
                "run %s: could not drop old details (%s)",
                self._run.id,
                exc,
                extra={"run_id": self._run.id},
            )
        finally:
            self._idle.set()

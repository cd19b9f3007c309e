"""What the gateway core needs of a store, whatever the database: the ``Store`` interface, the
record it appends, and the errors every backend raises.

Two backends implement it: SQLite (``gateway.core.store.sqlite``, the embedded default) and
PostgreSQL (``gateway.core.store.postgres``, shared by gateway replicas). One behavioural test
suite runs against both.

Contract every backend keeps:

- ``append_episode`` is the hot path: it queues the record and calls ``callback(error)`` on the
  event loop once the episode is durable (``None``) or could not be stored. Episodes that arrive
  together are committed together (group commit). An episode is never visible to a reader
  before its commit.
- ``update_run`` never rewinds the episode counters (``append_episode`` owns them), nor
  ``checkpoint_episode`` (the checkpoint records own it: it is the largest recorded episode).
- ``add_checkpoint`` records a complete checkpoint and applies retention in one transaction,
  and returns the episodes whose records it deleted: their files are the caller's to delete.
- Writes of a run are fenced by its owner where several gateways share the database
  (PostgreSQL): a replica whose lease on a run was taken over gets ``NotOwner`` (from
  ``update_run``, ``add_checkpoint`` and ``delete_checkpoints``, or as the error of
  ``append_episode``'s callback) and nothing is written.
- A write that fails because the database cannot be written (disk full, read-only, gone)
  raises ``StoreWriteFailed`` and turns ``writable`` off until a later write succeeds (the
  backend probes by itself); reads go on working.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from gateway.core.curve import CurveBlock
from gateway.core.episode_json import join_json, json_parts
from gateway.core.runs import RunState, TrainingRun
from gateway.core.search import RunPage, RunQuery
from trainwire.v1.episode_pb2 import Episode

_LOGGER = logging.getLogger(__name__)

#: What a run fails with, for users, when its history cannot be saved.
STORE_MESSAGE = "The gateway could not save this run's history (disk full or not writable)."


@dataclass(frozen=True, slots=True)
class EpisodeRecord:
    """One published episode: its number, the run's counters after it, its bytes, and the
    curve blocks it completed (``gateway.core.curve``).

    The store keeps the episode's numbers (``data[:detail_at]``) apart from its detail
    (``data[detail_at:]``, the ``Episode.detail`` field, which serializes last), so that a
    watch of the numbers only reads no detail and a long run can drop the detail of most of its
    episodes. ``detail_at`` -1 means the episode has no detail. A detail is kept for good when
    ``keep_detail`` says so, otherwise it is *recent* until ``settle_details`` keeps or drops
    it (``gateway.core.details``): recent details live apart, so dropping a range of them
    frees whole pages for what comes next.

    ``numbers_json`` and ``detail_json`` are the episode's JSON in the same two parts
    (``gateway.core.episode_json.json_parts``), kept beside the bytes so that the HTTP side's
    event stream replays without encoding; ``numbers_json`` empty or ``detail_json`` None: that
    part not written (the store then writes it when it is read).
    """

    run_id: str
    episode: int
    reward: float
    best_reward: float
    data: bytes
    detail_at: int = -1
    blocks: tuple[CurveBlock, ...] = ()
    keep_detail: bool = True
    numbers_json: bytes = b""
    detail_json: bytes | None = None

    @property
    def scalars(self) -> bytes:
        """The episode without its detail."""
        return self.data if self.detail_at < 0 else self.data[: self.detail_at]

    @property
    def detail(self) -> bytes | None:
        """The serialized detail field, or None."""
        return None if self.detail_at < 0 else self.data[self.detail_at :]


#: A row of an episode's numbers as ``stored_episodes`` and ``stored_json`` take it: (episode,
#: data) or (episode, numbers_json, data); PostgreSQL gives ``bytea`` as bytes or memoryview.
EpisodeRow = Sequence[Any]


def stored_episodes(rows: Sequence[EpisodeRow], details: Mapping[int, Any]) -> list[bytes]:
    """Episodes as ``read_episodes`` returns them, from their numbers' rows ``(episode, data)``
    in order and the stored details among them (``episode -> detail``)."""
    out = [row[1] for row in rows]
    if out and type(out[0]) is not bytes:
        out = [bytes(data) for data in out]
    if details:
        # The rows are consecutive episodes unless some were deleted meanwhile.
        first = rows[0][0] if rows else 0
        for number, detail in details.items():
            i = number - first
            if 0 <= i < len(out) and rows[i][0] == number:
                out[i] += bytes(detail)
            else:
                return _matched(rows, details)
    return out


def _matched(rows: Sequence[EpisodeRow], details: Mapping[int, Any]) -> list[bytes]:
    get = details.get
    out = []
    for row in rows:
        data = bytes(row[1])
        detail = get(row[0])
        out.append(data if detail is None else data + bytes(detail))
    return out


def stored_json(rows: Sequence[EpisodeRow], details: Mapping[int, Any] | None) -> list[bytes]:
    """Episodes' JSON as ``read_episodes(json=True)`` returns it, from their numbers' rows
    ``(episode, numbers_json, data)`` in order and the stored details among them, ``episode ->
    (detail_json, detail)`` (None: the view without detail). The bytes (``data``, ``detail``)
    are read only where the JSON is missing (stored before the store kept JSON, or a detail
    kept after its episode was stored): that part is written here from them."""
    get = details.get if details else None
    out = []
    for number, numbers, data in rows:
        if numbers is None:
            numbers = json_parts(Episode.FromString(bytes(data)))[0]
        kept = None if get is None else get(number)
        if kept is None:
            out.append(bytes(numbers))
            continue
        detail_json, detail = kept
        if detail_json is None:
            # The detail field alone parses as an episode holding only it.
            detail_json = json_parts(Episode.FromString(bytes(detail)))[1]
        out.append(join_json(bytes(numbers), bytes(detail_json)))
    return out


@dataclass(frozen=True, slots=True)
class CheckpointRecord:
    """A complete checkpoint of a run, as the gateway records it.

    Attributes:
        run_id: The run it belongs to.
        episode: The episode it was taken after (its key within the run).
        create_time: When it was written (Unix nanoseconds).
        size_bytes: Its size in the checkpoint store.
        sha256: The hex digest that a download or a resume verifies.
    """

    run_id: str
    episode: int
    create_time: int
    size_bytes: int
    sha256: str


def check_keep(keep: int) -> None:
    """Refuses a retention that would delete the checkpoint just recorded.

    Raises:
        ValueError: ``keep`` is below 1.
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")


class DatabaseProblem(Exception):
    """The database at ``--db`` cannot be used: a directory, unreadable, corrupt, read-only,
    another program's, or written by a newer gateway. ``str()`` is one line naming the place and
    the problem."""

    def __init__(self, where: str, problem: str) -> None:
        super().__init__(f"cannot use the database {where}: {problem}")
        self.where = where
        self.problem = problem


class SchemaOutdated(DatabaseProblem):
    """The database has an older schema; the gateway migrates it only when told to."""

    def __init__(self, where: str, version: int, latest: int) -> None:
        super().__init__(
            where,
            f"its schema is version {version}, this gateway's is {latest}; migrate it with "
            f"`python -m gateway migrate --db {where}` (or start with --migrate)",
        )
        self.version = version
        self.latest = latest


class StoreWriteFailed(Exception):
    """A write to the store failed (disk full, not writable); ``str()`` says what happened."""


class NotOwner(Exception):
    """A write of a run this gateway replica no longer owns: another replica took its lease
    over (PostgreSQL only; a SQLite store has one gateway and never raises it). The write did
    not happen; the replica stops driving the run and leaves its trainer job alone."""

    def __init__(self, run_id: str) -> None:
        super().__init__(f"run {run_id!r} is driven by another gateway replica now")
        self.run_id = run_id


class DuplicateRequest(Exception):
    """``insert_run`` of a run whose ``request_id`` another run already has (a retry that
    raced with the first request, possibly on another replica)."""

    def __init__(self, request_id: str) -> None:
        super().__init__(f"request_id {request_id!r} is taken")
        self.request_id = request_id


class Writability:
    """Whether a store can be written, the same for every database: on until a write fails,
    then off, with a probe write every ``interval_s`` seconds until one succeeds. Every change
    is logged once and told to the listeners (``Store.on_writable``).

    Args:
        where: The database, as logs name it.
        probe_write: A small write; returns whether it succeeded.
        interval_s: Seconds between two probes.
    """

    def __init__(
        self, where: str, probe_write: Callable[[], Awaitable[bool]], interval_s: float
    ) -> None:
        self.where = where
        self.writable = True
        self._probe_write = probe_write
        self._interval_s = interval_s
        self._listeners: list[Callable[[bool], None]] = []
        self._probe: asyncio.Task[None] | None = None
        self._closed = False

    def on_change(self, callback: Callable[[bool], None]) -> None:
        """Registers ``callback(writable)`` for every change."""
        self._listeners.append(callback)

    def set(self, writable: bool, why: str = "") -> None:
        """Records a write's outcome (``why``: the failure); off starts the probes."""
        if writable == self.writable:
            return
        self.writable = writable
        if writable:
            _LOGGER.info("the database %s can be written again", self.where)
        else:
            _LOGGER.error("the database %s cannot be written: %s", self.where, why)
            if (self._probe is None or self._probe.done()) and not self._closed:
                self._probe = asyncio.get_running_loop().create_task(
                    self._probe_loop(), name="gateway-store-probe"
                )
        for listener in self._listeners:
            listener(writable)

    async def _probe_loop(self) -> None:
        while not self.writable:
            await asyncio.sleep(self._interval_s)
            if await self._probe_write():
                self.set(True)

    async def close(self) -> None:
        """Stops the probes (for good)."""
        self._closed = True
        if self._probe is not None:
            self._probe.cancel()
            await asyncio.gather(self._probe, return_exceptions=True)
            self._probe = None


class WritableStore:
    """``Store.writable`` and ``Store.on_writable`` of a store that keeps a ``Writability`` in
    ``_writability`` (both stores do)."""

    _writability: Writability

    @property
    def writable(self) -> bool:
        """False after a write failed, until a probe write succeeds."""
        return self._writability.writable

    def on_writable(self, callback: Callable[[bool], None]) -> None:
        """Registers ``callback(writable)`` for every change."""
        self._writability.on_change(callback)


class Store(Protocol):
    """Durable runs, episode histories and checkpoint records (see the module docstring)."""

    @property
    def writable(self) -> bool:
        """False after a write failed, until a write succeeds again."""
        ...

    async def start(self) -> None:
        """Opens connections and starts background work."""
        ...

    async def close(self) -> None:
        """Commits what is queued and closes."""
        ...

    async def insert_run(self, run: TrainingRun) -> int:
        """Inserts a new run; returns its creation sequence number.

        Raises:
            DuplicateRequest: another run has its ``request_id``.
        """
        ...

    async def update_run(self, run: TrainingRun) -> None:
        """Writes a run's state, speed, times, trainer, trainer episode, restarts and parked
        (never its episode counters nor ``checkpoint_episode``).

        Raises:
            NotOwner: another gateway replica owns the run (PostgreSQL).
        """
        ...

    async def update_metadata(
        self, run_id: str, display_name: str, labels: Mapping[str, str]
    ) -> bool:
        """Sets a run's display name and labels (any replica may: they are the user's, not the
        owner's, and ``update_run`` never writes them); False when there is no such run.

        Raises:
            StoreWriteFailed: the database cannot be written.
        """
        ...

    def append_episode(
        self, record: EpisodeRecord, callback: Callable[[BaseException | None], None]
    ) -> None:
        """Queues an episode; ``callback(error)`` runs on the loop once it is committed."""
        ...

    async def get_run(self, run_id: str) -> TrainingRun | None:
        """The run with this id, or None."""
        ...

    async def find_request(self, request_id: str) -> TrainingRun | None:
        """The run created with this request id, or None."""
        ...

    async def list_runs(self, query: RunQuery) -> RunPage:
        """A page of the runs a search finds, in its order, after ``query.after`` (reading
        the committed values: ``gateway.core.search``)."""
        ...

    async def read_episodes(
        self, run_id: str, first: int, last: int, scalars: bool = False, json: bool = False
    ) -> list[bytes]:
        """The stored bytes of episodes ``first..last`` (inclusive), in order: with the detail
        the store kept, or without any (``scalars``); or their JSON (``json``, see
        ``stored_json``)."""
        ...

    async def read_curve_blocks(
        self, run_id: str, spans: Sequence[tuple[int, int, int]]
    ) -> list[CurveBlock]:
        """The stored curve blocks of ``(level, first_index, last_index)`` spans."""
        ...

    async def settle_details(self, run_id: str, first: int, last: int, keep: Sequence[int]) -> int:
        """Settles the recent details of episodes ``first..last``: those of ``keep`` are kept
        for good, the others dropped; returns how many it dropped.

        Raises:
            NotOwner: another gateway replica owns the run (PostgreSQL); nothing is written.
            StoreWriteFailed: the database cannot be written.
        """
        ...

    async def delete_run(self, run_id: str) -> None:
        """Deletes a run, its history and its checkpoint records."""
        ...

    async def add_checkpoint(self, record: CheckpointRecord, keep: int) -> list[int]:
        """Records a complete checkpoint and keeps the run's latest ``keep``, in one
        transaction; the run's ``checkpoint_episode`` becomes its largest recorded episode.

        A record of an episode already recorded with the same digest is a no-op; with another
        digest it replaces the old one (a job restarted from an earlier checkpoint wrote that
        episode's files again, and the files are what a download or a resume reads).
        Retention keeps the ``keep`` largest episodes, so a record older than those is deleted
        at once; retention also keeps the newest record at or before the run's stored
        (published) episode among those recorded before this one: a trainer may checkpoint
        well ahead of what the gateway published, and a gateway that takes the run over
        continues from its published episode, so from that checkpoint (the record being
        recorded is never kept that way: an old checkpoint reported again, e.g. to a replica
        that took the run over, may have had its files deleted with its record). A record of a
        run that does not exist is not kept.

        Returns:
            The episodes whose records were not kept, in order (their files are the caller's
            to delete).

        Raises:
            ValueError: ``keep`` is below 1.
            NotOwner: another gateway replica owns the run (PostgreSQL); nothing is written.
            StoreWriteFailed: the database cannot be written.
        """
        ...

    async def list_checkpoints(self, run_id: str) -> list[CheckpointRecord]:
        """The run's checkpoint records, oldest (smallest episode) first."""
        ...

    async def delete_checkpoints(self, run_id: str, episodes: Sequence[int]) -> None:
        """Deletes checkpoint records (one the gateway found corrupt) and sets the run's
        ``checkpoint_episode`` to its largest remaining episode (0 when none is left).

        Raises:
            NotOwner: another gateway replica owns the run (PostgreSQL); nothing is written.
            StoreWriteFailed: the database cannot be written.
        """
        ...

    async def count_by_state(self) -> dict[RunState, int]:
        """How many runs are in each state (states without runs are left out)."""
        ...

    async def active_runs(self) -> list[TrainingRun]:
        """Every PENDING, RUNNING or PAUSED run, oldest first."""
        ...

    def on_writable(self, callback: Callable[[bool], None]) -> None:
        """Registers ``callback(writable)``, called on the loop whenever writability changes."""
        ...

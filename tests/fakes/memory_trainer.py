"""An in-memory ``TrainerConnector`` for tests of the gateway core: trainers without a gRPC
transport, sockets or threads, on the test's event loop (so virtual time drives them too).

``MemoryConnector`` reaches ``MemoryTrainer`` s by address. A trainer offers providers in a
number of slots; each ``train`` call starts a ``MemoryJob`` (one slot, until its provider stops)
or re-attaches a stream to one. Like the real trainer (``trainer_service.core.jobs``), a job:

- produces episodes only up to its grant (``n <= grant``): it is not pulled past it, and its
  stream sends ``None`` heartbeats every ``heartbeat_s`` while it waits;
- produces a valid stream (``tests.fakes.episodes.make_episode``: episodes 1..N, best_reward the
  running maximum, done on the last);
- outlives a broken or cancelled stream (detached) and holds its episodes for a re-attach
  after ``attach_after_episode`` (it holds all of them: the real one only its last
  ``retain``); a re-attach to a job that is gone is ``TrainerJobGone``, a new ``train`` of a
  run whose job is still live ``TrainerJobExists``;
- releases its slot once its provider stopped (the done episode produced, a failure, or
  ``cancel_job``).

The trainer's rules are the real trainer core's own functions, never copies: the fields of the
request the gateway's own connector builds (``gateway.trainer_client.train_request``, checked
by ``admission.check_request``), the slots a job takes and the refusal of one too big for the
trainer (``admission``), a new job that replaces a live one (``jobs.replaceable``), a
re-attach's start point and task (``job_reader``, ``hyperparameters``), when a checkpoint is
due (``checkpointing``), the choice of a resume candidate with its skip reasons
(``job_resume``; a share's, ``job_share``), the final checkpoint of
``cancel_job(checkpoint=True)`` (``job.final_checkpoint_of``) and a refused hyperparameter
change (``hyperparameters.check_change``), with the real providers' torch-free rules
(``PROVIDER_RULES``). What the fake simulates is time, streams, stores and failures.

Checkpoints: a job writes one after every ``config.checkpoint_every`` episodes (0: its trainer's
advertised default, ``MemoryTrainer.provider_defaults``) and after its done episode into the
connector's shared store (``MemoryConnector.checkpoints``, reachable by every trainer like a
shared filesystem), and its stream reports each after the episode it was taken after.
``cancel_job(checkpoint=True)`` writes one at the job's last episode unless it has one there.
A ``train`` with ``resume_from`` starts from the candidate the real core chooses, fetched from
that store (one marked ``corrupt`` no longer matches its digest), and says so first
(``Resumed``), numbering on from it; a candidate may be another run's (a fork starts from its
parent's checkpoint, if it fits).

Defaults: a trainer advertises each provider's (``Capabilities.provider_defaults``), and by
default the real providers' own, from their torch-free source
(``trainer_service.providers.defaults``), never a copy; a test may give one other values.

Live hyperparameters: a job starts with its task's (the providers' defaults applied: the real
providers' own rules) and ``set_hyperparameters`` changes them for the episodes it
produces after the call (it refuses as the real trainer does: a job that produced its last
episode, beta above 0 for a grpo job without a reference model, i.e. full fine-tuning started
with beta 0). With ``MemoryTrainer.hyperparameter_metrics`` every episode carries the values it
was produced with as metrics (``learning_rate``; grpo also ``temperature``, ``beta``), as the
real providers' do.

``tests/conformance`` runs the same scenarios against this fake and the real trainer core
(``tests.fakes.core_connector``): where they differ, the real one is right.

Jobs across trainers: a job takes ``grpo.num_processes`` slots (1 for other kinds), or its
placement's ``processes``. Rank 0's share of a job that spans trainers (``placement`` with
``first_rank`` 0) announces a rendezvous (``Rendezvous``, after ``Resumed``) and produces
nothing until every rank joined it: each other share is a ``train`` with that rendezvous, on any
trainer of the connector. Those shares produce nothing; their streams send heartbeats and end OK
once rank 0's job produced its done episode. When rank 0's job stops short of it (killed,
failed, cancelled), its shares fail as their peers are gone (``TrainerProcessDied``), as does a
share whose rendezvous is gone when it starts.

Every ``train``, ``grant``, ``cancel_job`` and ``set_hyperparameters`` call is recorded with its
arguments and the loop time it came at (``MemoryConnector.calls``), so tests assert on values,
never on log text.

What a job does wrong is scripted per trainer: ``MemoryTrainer.script(JobScript(...))`` queues a
script that the next new job takes (fail with a provider error, crash, break a contract rule, go
silent, lose its stream once). The trainer itself can answer busy (``answer_busy``), be killed
(``kill``: its streams break with ``TrainerLost``, and every later call finds its address
refusing connections, ``TrainerUnreachable``, as after a kill -9; its jobs are gone), come back
empty on the same address (``revive``), or go silent with its jobs (``freeze``, as a stopped
process or a black-holed network: streams send nothing, calls get no answer before their
deadline) until ``thaw``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import math
import pathlib
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from gateway.core.trainers import (
    Cancelled,
    Capabilities,
    CheckpointFailed,
    CheckpointSaved,
    JobPlacement,
    Rendezvous,
    Resumed,
    ResumePoint,
    StreamEvent,
    TrainerBusy,
    TrainerCrashed,
    TrainerError,
    TrainerFailed,
    TrainerJobExists,
    TrainerJobFinished,
    TrainerJobGone,
    TrainerLost,
    TrainerProcessDied,
    TrainerRefused,
    TrainerUnreachable,
)
from gateway.trainer_client import train_request
from tests.fakes.episodes import broken, make_episode, reward_of
from trainer_service.core.admission import check_request, slots_needed, too_many_slots
from trainer_service.core.checkpointing import CheckpointEvent, checkpoint_due, job_meta
from trainer_service.core.errors import InvalidRequest
from trainer_service.core.hyperparameters import check_change, same_but_hyperparameters
from trainer_service.core.job import final_checkpoint_of, writes_final_checkpoint
from trainer_service.core.job_reader import attach_range
from trainer_service.core.job_resume import Candidates, fetch_resume_candidate
from trainer_service.core.job_share import is_share, share_candidate
from trainer_service.core.jobs import replaceable
from trainer_service.core.placement import DEFAULT_RENDEZVOUS_HOST, Placement, placement_of
from trainer_service.core.provider import ProviderError, RestoredCheckpoint
from trainer_service.core.slots import SlotPool
from trainer_service.providers import grpo
from trainer_service.providers.defaults import BY_PROVIDER, IMITATION
from trainwire.contract import REWARD_FUNCTIONS, FieldViolation, task_kind
from trainwire.hyperparameters import Hyperparameters
from trainwire.v1 import episode_pb2, trainer_service_pb2
from trainwire_ops.checkpoints import CheckpointCorrupt, CheckpointInfo, CheckpointMissing

#: Seconds between two heartbeats of a stream whose job waits (the real trainer's default).
HEARTBEAT_S = 5.0
#: Seconds a unary call takes (a round trip on a local network).
CALL_S = 0.001


# -- what the connector records ---------------------------------------------------------------


@dataclass(frozen=True)
class TrainCall:
    """One ``train`` call: a new job (``attach_after`` None) or a re-attach."""

    address: str
    run_id: str
    grant: int
    attach_after: int | None
    at: float
    resume_from: tuple[int, ...] = ()
    #: The run of each of ``resume_from`` (a fork's last one is its parent's).
    resume_runs: tuple[str, ...] = ()
    #: The share of a job that spans trainers (None: the whole job).
    placement: JobPlacement | None = None


@dataclass(frozen=True)
class GrantCall:
    """One ``grant`` call."""

    address: str
    run_id: str
    through_episode: int
    at: float


@dataclass(frozen=True)
class CancelCall:
    """One ``cancel_job`` call."""

    address: str
    run_id: str
    at: float
    checkpoint: bool = False


@dataclass(frozen=True)
class HyperparametersCall:
    """One ``set_hyperparameters`` call."""

    address: str
    run_id: str
    change: Hyperparameters
    at: float


Call = TrainCall | GrantCall | CancelCall | HyperparametersCall


#: The real providers' torch-free rules, by task kind, as the real trainer core asks them of
#: a provider (``slots_needed``, ``hyperparameters``, ``check_hyperparameters``): the grpo
#: package's own; the imitation provider (it imports torch) has none of the first and last, so
#: ``None`` gives the core's defaults for them.
PROVIDER_RULES: dict[str, object | None] = {"grpo": grpo, "imitation": None}


def initial_hyperparameters(task: episode_pb2.TrainTask) -> Hyperparameters:
    """The live hyperparameters a job of ``task`` starts with, defaults applied: for grpo the
    real provider's own rules (``trainer_service.providers.grpo.hyperparameters``: LoRA's
    learning rate and beta differ)."""
    if task_kind(task) == "imitation":
        return Hyperparameters(
            learning_rate=task.imitation.learning_rate or IMITATION.learning_rate
        )
    return grpo.hyperparameters(task)


def job_slots(task: episode_pb2.TrainTask, placement: JobPlacement | None) -> tuple[int, str]:
    """Slots a job takes and the request field that says so: the real trainer core's rule
    (``trainer_service.core.admission.slots_needed``)."""
    kind = task_kind(task)
    share = None if placement is None else Placement(**dataclasses.asdict(placement))
    return slots_needed(PROVIDER_RULES.get(kind), kind, task, share)


def saved_event(info: CheckpointInfo) -> CheckpointSaved:
    """A store record as the connector reports it."""
    return CheckpointSaved(info.episode, info.create_time_ns, info.size_bytes, info.sha256)


# -- what a job does ----------------------------------------------------------------------------


@dataclass(frozen=True)
class JobScript:
    """How one job misbehaves (the default: not at all).

    Attributes:
        fail_after: Fail with a provider error (``TrainerFailed``) once this many episodes
            were sent, with ``user_message`` for users.
        user_message: The provider's message (a ``google.rpc.LocalizedMessage``).
        crash_after: Fail without a message (``TrainerCrashed``) once this many were sent.
        error_after: Fail with ``error`` once this many were sent.
        error: The failure of ``error_after`` (any ``TrainerError``).
        violate: A rule of ``tests.fakes.scripts.VIOLATIONS`` that episode ``violate_at``
            breaks (``tests.fakes.episodes.broken`` builds it); ``done_missing``: the last
            episode comes without done (``end_without_done`` is ``end_after``).
        violate_at: The episode that breaks it.
        silent_after: Send nothing more, not even heartbeats, once this many were sent.
        end_after: End the stream without a done episode once this many were sent.
        lose_stream_after: Break the stream (``TrainerLost``) once, after this many were sent;
            the job lives on for a re-attach.
        episode_s: Seconds the provider takes per episode (0: as fast as its grant allows).
        checkpoints_fail: Every checkpoint write fails (a full disk): the stream reports
            ``CheckpointFailed`` instead.
        detail_every: Episodes whose number is a multiple of this (and the last) carry a
            motion of ``detail_shape`` (frames, joints); 0: no episode does.
    """

    fail_after: int | None = None
    user_message: str = "The provider failed."
    crash_after: int | None = None
    error_after: int | None = None
    error: TrainerError | None = None
    violate: str | None = None
    violate_at: int = 3
    silent_after: int | None = None
    end_after: int | None = None
    lose_stream_after: int | None = None
    episode_s: float = 0.0
    checkpoints_fail: bool = False
    detail_every: int = 0
    detail_shape: tuple[int, int] = (4, 3)


class MemoryJob:
    """One training job on a ``MemoryTrainer`` (see the module docstring).

    Attributes:
        run_id: Its run.
        kind: Its task kind.
        max_episodes: How many episodes it trains.
        grant: The last episode it may produce.
        produced: Its episodes so far (index ``n - 1`` is episode ``n``).
        sent: The last episode a stream handed to the gateway.
        stopped: Its provider stopped (done, failed or cancelled); its slot is free.
        cancelled: ``cancel_job`` ended it.
        streams: How many streams were opened on it (one per ``train`` call).
    """

    def __init__(
        self,
        trainer: MemoryTrainer,
        run_id: str,
        task: episode_pb2.TrainTask,
        config: episode_pb2.TrainConfig,
        grant: int,
        script: JobScript,
        resumed: Resumed | None = None,
        placement: JobPlacement | None = None,
        restored: CheckpointInfo | None = None,
    ) -> None:
        self.trainer = trainer
        self.run_id = run_id
        #: Episodes between its checkpoints: its config's, else its trainer's default.
        defaults = trainer.provider_defaults.get(task_kind(task))
        self.checkpoint_every = config.checkpoint_every or (
            defaults.checkpoint_every if defaults is not None else 0
        )
        #: Its share of a job that spans trainers (None: the whole job).
        self.placement = placement
        #: Slots it holds.
        self.slots = job_slots(task, placement)[0]
        #: Rank 0's job: the ranks that joined it (its own first) and the other shares.
        self.joined = placement.processes if placement is not None else 0
        self.shares: list[MemoryJob] = []
        #: Where the other ranks join (rank 0's job of a job that spans trainers).
        self.rendezvous = ""
        #: Another share: rank 0's job ended short of its done episode.
        self.peer_lost = False
        #: Another share: rank 0's job produced its done episode.
        self.completed = False
        self.task = task
        self.config = config
        self.kind = task_kind(task)
        self.max_episodes = config.max_episodes
        self.grant = grant
        self.script = script
        self.produced: list[episode_pb2.Episode] = []
        self.sent = 0
        self.stopped = False
        self.cancelled = False
        self.streams = 0
        self.lost_once = False
        self._best = -math.inf
        #: Where it started (None: a plain new job); its stream says so first.
        self.resumed = resumed
        #: The store's record of the checkpoint of its own run it restored (None: none).
        self.restored = restored
        self.first = 1
        if resumed is not None and resumed.episode:
            self.first = resumed.episode + 1
            self._best = resumed.best_reward
        #: Checkpoint events, in order, each with the episode after which it is sent.
        self.checkpoint_events: list[CheckpointSaved | CheckpointFailed] = []
        #: The live hyperparameters of the next episode it produces.
        self.hyperparameters = initial_hyperparameters(task)
        #: Each change it took: the last episode produced before it, and the values set.
        self.hyperparameter_changes: list[tuple[int, dict[str, float]]] = []
        self._changed = asyncio.Event()
        self._stream: MemoryStream | None = None
        self._producer: asyncio.Task[None] | None = None
        self._produce()

    @property
    def last_produced(self) -> int:
        """The last episode produced (0 before the first; a resumed job's checkpoint)."""
        return self.first - 1 + len(self.produced)

    def episode(self, n: int) -> episode_pb2.Episode:
        """Produced episode ``n``."""
        return self.produced[n - self.first]

    def checkpoint(self, episode: int) -> CheckpointSaved | CheckpointFailed:
        """Writes the checkpoint after ``episode`` into the shared store (or fails to)."""
        if self.script.checkpoints_fail:
            event: CheckpointSaved | CheckpointFailed = CheckpointFailed(
                episode, "No space left on device"
            )
        else:
            meta = job_meta(self.task, self.config)
            event = self.trainer.store.write(self.run_id, episode, self._best, meta)
        self.checkpoint_events.append(event)
        return event

    @property
    def is_share(self) -> bool:
        """Whether it is the share of a job that spans trainers on another trainer than rank
        0's (it produces nothing)."""
        return self.placement is not None and self.placement.first_rank > 0

    def join(self, share: MemoryJob) -> None:
        """Another trainer's share joins this rank 0's job."""
        assert share.placement is not None
        self.joined += share.placement.processes
        self.shares.append(share)
        self._produce()

    @property
    def done(self) -> bool:
        """Whether the done episode was produced (a share: rank 0's job's)."""
        return self.completed or self.last_produced >= self.max_episodes

    def move_grant(self, through_episode: int) -> None:
        """Moves the grant forward (never back) and produces what it allows."""
        if through_episode > self.grant:
            self.grant = through_episode
            self._produce()

    def _produce(self) -> None:
        if self.script.episode_s > 0:
            if self._producer is None or self._producer.done():
                self._producer = asyncio.get_running_loop().create_task(self._produce_slowly())
            return
        while self._may_produce():
            self._produce_one()
        self.changed()

    async def _produce_slowly(self) -> None:
        while self._may_produce():
            await asyncio.sleep(self.script.episode_s)
            if self._may_produce():
                self._produce_one()
                self.changed()

    def _may_produce(self) -> bool:
        if self.is_share:
            return False
        if self.placement is not None and self.joined < self.placement.world_size:
            return False  # rank 0 waits for every rank
        return not self.stopped and self.last_produced < min(self.grant, self.max_episodes)

    def _produce_one(self) -> None:
        n = self.last_produced + 1
        self._best = max(self._best, reward_of(n))
        last = n == self.max_episodes
        every = self.script.detail_every
        detail = bool(every) and (last or n % every == 0)
        frames, joints = self.script.detail_shape
        episode = make_episode(n, self._best, last, detail, frames, joints)
        if self.trainer.hyperparameter_metrics:
            episode.metrics.update(self.hyperparameters.as_dict())
        self.produced.append(episode)
        if checkpoint_due(n, self.checkpoint_every, self.max_episodes):
            self.checkpoint(n)
        if episode.done:
            self.stop()

    def stop(self, cancelled: bool = False) -> None:
        """The provider stops: the slot is free (the episodes stay held for a re-attach)."""
        self.cancelled = self.cancelled or cancelled
        self.stopped = True
        if self._producer is not None:
            self._producer.cancel()
        for share in self.shares:
            if self.done:
                share.completed = True
            else:
                share.peer_lost = True
            share.stop()
        self.changed()

    def changed(self) -> None:
        """Wakes the stream."""
        self._changed.set()

    async def wait_changed(self, timeout: float | None) -> bool:
        """Waits for a change (episodes, grant, cancel, kill); False after ``timeout``."""
        self._changed.clear()
        try:
            async with asyncio.timeout(timeout):
                await self._changed.wait()
        except TimeoutError:
            return False
        return True

    def attach(self, stream: MemoryStream) -> None:
        """A new stream replaces the current one."""
        old, self._stream = self._stream, stream
        self.streams += 1
        if old is not None:
            old.superseded = True
        self.changed()

    def detach(self, stream: MemoryStream) -> None:
        """A stream ended (broken or cancelled); the job waits for a re-attach."""
        if self._stream is stream:
            self._stream = None

    def blip(self) -> None:
        """Breaks the attached stream (``TrainerLost``); the job lives on."""
        if self._stream is not None:
            self._stream.broken = True
        self.changed()

    @property
    def attached(self) -> bool:
        """Whether a stream reads the job now."""
        return self._stream is not None


class MemoryStream:
    """One ``Train`` call on a job: a ``TrainerStream`` (``None`` = heartbeat). A refused call
    raises its error at the first read, as a gRPC call does."""

    def __init__(
        self,
        trainer: MemoryTrainer,
        job: MemoryJob | None,
        after: int,
        error: TrainerError | None = None,
    ) -> None:
        self._trainer = trainer
        self._job = job
        self._cursor = after
        self._error = error
        self.cancelled = False
        self.superseded = False
        self.broken = False
        self._pending: deque[StreamEvent] = deque()
        self._checkpoints_sent = 0
        if job is not None:
            job.attach(self)
            # Like the real trainer: ``resumed`` first on any stream that starts at or before
            # the restored episode (a re-attach there too).
            if job.resumed is not None and after <= job.first - 1:
                if not job.is_share:  # a share streams heartbeats only
                    self._pending.append(job.resumed)
                self._cursor = job.first - 1
            if job.rendezvous and after == 0:
                self._pending.append(Rendezvous(job.rendezvous))

    def __aiter__(self) -> AsyncIterator[StreamEvent]:
        return self

    def cancel(self) -> None:
        """The gateway cancels the call: the job is detached (it stays for a re-attach)."""
        self.cancelled = True
        if self._job is not None:
            self._job.detach(self)
            self._job.changed()

    def _fail(self, error: TrainerError) -> TrainerError:
        if self._job is not None:
            self._job.detach(self)
        return error

    def _due_checkpoint(self, job: MemoryJob) -> CheckpointSaved | CheckpointFailed | None:
        """The next checkpoint event whose episode this stream has sent."""
        events = job.checkpoint_events
        if self._checkpoints_sent < len(events):
            event = events[self._checkpoints_sent]
            if event.episode <= self._cursor:
                self._checkpoints_sent += 1
                return event
        return None

    async def __anext__(self) -> StreamEvent:
        trainer = self._trainer
        await trainer.thawed()  # a silent trainer answers nothing
        if self._error is not None:
            raise self._error
        job = self._job
        assert job is not None
        while True:
            if trainer.frozen:
                await trainer.thawed()
                continue
            if trainer.killed:
                raise self._fail(TrainerLost(f"trainer {trainer.address}: UNAVAILABLE: killed"))
            if self.cancelled:
                raise self._fail(TrainerLost(f"trainer {trainer.address}: CANCELLED"))
            # A job cancelled by ``cancel_job`` still sends what it produced (and its
            # checkpoints) to an attached stream, then ends it CANCELLED (below).
            if self.superseded:
                raise TrainerCrashed(f"trainer {trainer.address}: ABORTED: re-attached")
            if self.broken:
                raise self._fail(TrainerLost(f"trainer {trainer.address}: UNAVAILABLE: blip"))
            if job.peer_lost:
                raise self._fail(
                    TrainerProcessDied(
                        f"trainer {trainer.address}: ABORTED: a rank on another trainer is gone",
                        "A process of the training job stopped.",
                    )
                )
            if self._pending:
                return self._pending.popleft()
            due = self._due_checkpoint(job)
            if due is not None:
                return due
            script = job.script
            sent = self._cursor
            if script.lose_stream_after == sent and not job.lost_once:
                job.lost_once = True
                raise self._fail(TrainerLost(f"trainer {trainer.address}: UNAVAILABLE: blip"))
            if script.fail_after == sent:
                job.stop()
                raise self._fail(
                    TrainerFailed(f"trainer {trainer.address}: INTERNAL", script.user_message)
                )
            if script.error_after == sent and script.error is not None:
                job.stop()
                raise self._fail(script.error)
            if script.crash_after == sent:
                job.stop()
                raise self._fail(TrainerCrashed(f"trainer {trainer.address}: INTERNAL: crash"))
            if script.end_after == sent:
                job.stop()
                job.detach(self)
                raise StopAsyncIteration
            if script.silent_after is not None and sent >= script.silent_after:
                await job.wait_changed(None)
                continue
            if sent < job.last_produced:
                self._cursor = sent + 1
                job.sent = max(job.sent, self._cursor)
                trainer.episodes_sent += 1
                episode = job.episode(sent + 1)
                if script.violate == "done_missing" and episode.done:
                    bad = episode_pb2.Episode()
                    bad.CopyFrom(episode)
                    bad.done = False
                    return bad
                if (
                    script.violate not in (None, "done_missing")
                    and self._cursor == script.violate_at
                ):
                    bad = episode_pb2.Episode()
                    bad.CopyFrom(episode)
                    self._pending.extend(broken(bad, script.violate))
                    return self._pending.popleft()
                return episode
            if job.stopped and sent >= job.last_produced:
                job.detach(self)
                if job.done:
                    raise StopAsyncIteration
                raise TrainerLost(f"trainer {trainer.address}: CANCELLED: job cancelled")
            if not await job.wait_changed(trainer.heartbeat_s):
                trainer.heartbeats_sent += 1
                return None


# -- trainers and the connector ---------------------------------------------------------------


class MemoryCheckpoints:
    """The checkpoint store the memory trainers share: what each checkpoint restores (the best
    reward through its episode) and what its marker records (its job's task and config), and the
    ones a test marked corrupt (their files no longer hash to their record). A job's trainer
    fetches its resume candidates from it as the real trainer fetches them from a
    ``trainwire_ops.checkpoints.CheckpointStore``: ``fetch``, ``meta`` and ``info`` raise that
    store's errors, for the real trainer core's choice of a candidate
    (``trainer_service.core.job_resume``) to skip them with its reasons."""

    def __init__(self) -> None:
        self.saved: dict[tuple[str, int], float] = {}
        self.corrupt: set[tuple[str, int]] = set()
        self.deleted: list[tuple[str, int]] = []
        self.markers: dict[tuple[str, int], dict[str, object]] = {}

    @staticmethod
    def digest(run_id: str, episode: int) -> str:
        """The sha256 of the checkpoint of ``run_id`` after ``episode``."""
        return hashlib.sha256(f"{run_id}/{episode}".encode()).hexdigest()

    @staticmethod
    def corrupt_digest(run_id: str, episode: int) -> str:
        """The sha256 the files of that checkpoint hash to once a test marked it corrupt."""
        return hashlib.sha256(f"{run_id}/{episode}/corrupt".encode()).hexdigest()

    def write(
        self,
        run_id: str,
        episode: int,
        best_reward: float,
        meta: dict[str, object] | None = None,
    ) -> CheckpointSaved:
        self.saved[(run_id, episode)] = best_reward
        self.markers[(run_id, episode)] = dict(meta or {})
        info = self.info(run_id, episode)
        assert info is not None
        return saved_event(info)

    def info(self, run_id: str, episode: int) -> CheckpointInfo | None:
        """The record of the checkpoint of ``run_id`` after ``episode``, if it is there."""
        best = self.saved.get((run_id, episode))
        if best is None:
            return None
        return CheckpointInfo(
            episode,
            1_700_000_000_000_000_000 + episode,
            1000 + episode,
            self.digest(run_id, episode),
            best,
        )

    def meta(self, run_id: str, episode: int) -> dict[str, object] | None:
        """What the checkpoint's marker records (its job's task and config), if it is there."""
        if (run_id, episode) not in self.saved:
            return None
        return dict(self.markers.get((run_id, episode), {}))

    def fetch(
        self, run_id: str, episode: int, dest: pathlib.Path, sha256: str = ""
    ) -> CheckpointInfo:
        """The checkpoint's record once its files are checked against ``sha256`` (the caller's
        record; the marker's when empty); ``dest`` is not written.

        Raises:
            CheckpointMissing: It is not there.
            CheckpointCorrupt: Its files do not hash to the digest expected.
        """
        del dest
        info = self.info(run_id, episode)
        if info is None:
            raise CheckpointMissing(run_id, episode, f"it is not in {self.location}")
        key = (run_id, episode)
        got = self.corrupt_digest(run_id, episode) if key in self.corrupt else info.sha256
        expected = sha256 or info.sha256
        if got != expected:
            raise CheckpointCorrupt(
                run_id,
                episode,
                f"digest mismatch: its files hash to {got} ({info.size_bytes} bytes), "
                f"expected {expected}",
            )
        return info

    # The ``CheckpointFiles`` the gateway deletes through.
    location = "memory"

    def tar_chunks(self, run_id: str, episode: int, chunk_size: int) -> Iterator[bytes]:
        yield f"{run_id}/{episode}".encode()

    def delete(self, run_id: str, episode: int) -> None:
        self.saved.pop((run_id, episode), None)
        self.markers.pop((run_id, episode), None)
        self.deleted.append((run_id, episode))

    def delete_run(self, run_id: str) -> None:
        for key in [k for k in self.saved if k[0] == run_id]:
            self.delete(*key)


@dataclass
class MemoryTrainer:
    """One trainer (see the module docstring).

    Attributes:
        address: Where the connector reaches it.
        providers: Task kinds it offers.
        reward_functions: The reward functions a GRPO task may name there (as a real trainer
            refuses any other, it fails a job that names one).
        slots_total: Jobs it runs at once.
        heartbeat_s: Seconds between heartbeats of a waiting job's stream.
        call_s: Seconds every unary call (probe, grant, cancel) takes to answer or fail: a
            round trip, even to a dead trainer (a refused connection).
        grant_delay_s: Seconds a ``grant`` call takes on top of that.
        answer_busy: New jobs it refuses as busy (``TrainerBusy``) although it reports free
            slots (a probe that raced another gateway's run); counts down.
        killed: It is gone: streams break (``TrainerLost``), calls find its address refusing
            connections (``TrainerUnreachable``).
        frozen: It is silent (stopped, or black-holed): streams send nothing, calls get no
            answer before their deadline; its jobs live on.
        jobs: Its live jobs by run id.
        probes: ``capabilities`` calls it answered.
        provider_defaults: Each provider's defaults, as it advertises them and its jobs apply
            them (``checkpoint_every``): the real providers' own by default (see the module
            docstring); empty, it is a trainer older than ``provider_defaults``.
    """

    address: str
    providers: tuple[str, ...] = ("imitation",)
    reward_functions: tuple[str, ...] = REWARD_FUNCTIONS
    slots_total: int = 4
    heartbeat_s: float = HEARTBEAT_S
    call_s: float = CALL_S
    grant_delay_s: float = 0.0
    answer_busy: int = 0
    killed: bool = False
    refuses: bool = True
    frozen: bool = False
    hyperparameter_metrics: bool = False
    jobs: dict[str, MemoryJob] = field(default_factory=dict)
    probes: int = 0
    episodes_sent: int = 0
    heartbeats_sent: int = 0
    store: MemoryCheckpoints = field(default_factory=MemoryCheckpoints)
    #: Rank 0's jobs of jobs that span trainers, by rendezvous (shared by the connector's
    #: trainers).
    rendezvous: dict[str, MemoryJob] = field(default_factory=dict)
    _scripts: deque[JobScript] = field(default_factory=deque)
    provider_defaults: dict[str, trainer_service_pb2.ProviderDefaults] = field(
        default_factory=lambda: {kind: make() for kind, make in BY_PROVIDER.items()}
    )
    _thaw: asyncio.Event | None = None

    @property
    def slots_free(self) -> int:
        """Slots no running job holds."""
        return self.slots_total - sum(j.slots for j in self.jobs.values() if not j.stopped)

    def script(self, *scripts: JobScript) -> None:
        """Queues scripts; each new job takes the next one (then the default)."""
        self._scripts.extend(scripts)

    def freeze(self) -> None:
        """The trainer goes silent with its jobs (SIGSTOP, or a black-holed network)."""
        self.frozen = True
        self._thaw = asyncio.Event()

    def thaw(self) -> None:
        """The trainer answers again (SIGCONT): its jobs go on where they were."""
        self.frozen = False
        if self._thaw is not None:
            self._thaw.set()
        for job in self.jobs.values():
            job.changed()

    async def thawed(self) -> None:
        """Waits until the trainer answers again."""
        if self.frozen and self._thaw is not None:
            await self._thaw.wait()

    def kill(self, refuses: bool = True) -> None:
        """The trainer dies: its streams break, later calls find its address refusing
        connections (``TrainerUnreachable``); its jobs are gone. With ``refuses`` False its
        machine is cut off instead (connections reset or time out: ``TrainerLost``), so the
        gateway cannot tell that the jobs are gone."""
        self.killed = True
        self.refuses = refuses
        jobs = list(self.jobs.values())
        self.jobs.clear()
        for job in jobs:
            job.stop()

    def blip(self) -> None:
        """The network drops every stream of the trainer; its jobs live on, detached."""
        for job in self.jobs.values():
            job.blip()

    def revive(self) -> None:
        """The trainer is back, without the jobs it had."""
        self.killed = False
        self.jobs.clear()

    def refusal(self) -> TrainerError:
        """What a call to the killed trainer fails with."""
        if self.refuses:
            return TrainerUnreachable(f"trainer {self.address}: UNAVAILABLE: Connection refused")
        return TrainerLost(f"trainer {self.address}: UNAVAILABLE: Connection reset by peer")

    def _check_alive(self) -> None:
        if self.killed:
            raise self.refusal()

    def capabilities(self) -> Capabilities:
        self._check_alive()
        self.probes += 1
        return Capabilities(
            self.providers,
            self.slots_total,
            self.slots_free,
            device="memory",
            reward_functions=self.reward_functions,
            provider_defaults={
                kind: defaults
                for kind, defaults in self.provider_defaults.items()
                if kind in self.providers
            },
        )

    def open(
        self,
        run_id: str,
        task: episode_pb2.TrainTask,
        config: episode_pb2.TrainConfig,
        grant: int,
        attach_after: int | None,
        resume_from: Sequence[ResumePoint] = (),
        placement: JobPlacement | None = None,
    ) -> MemoryStream:
        if self.killed:
            return MemoryStream(self, None, 0, self.refusal())
        job = self.jobs.get(run_id)
        # The request the gateway's own connector sends, and its fields the real core checks.
        request = train_request(run_id, task, config, grant, attach_after, resume_from, placement)
        violations = check_request(request)
        if violations:
            return MemoryStream(self, None, 0, self._invalid(run_id, *violations))
        if attach_after is not None:
            if job is None:
                return MemoryStream(self, None, 0, TrainerJobGone(f"{self.address}: NOT_FOUND"))
            # The real runner's rule: the run's task (with its live hyperparameters changed
            # since) and config, else the request is invalid.
            if not same_but_hyperparameters(job.task, task) or job.config != config:
                violation = FieldViolation("task", "differs from the live job's task/config")
                return MemoryStream(self, None, 0, self._invalid(run_id, violation))
            # The real reader's rule (the fake holds every episode; its choice is decided).
            candidates = [job.first - 1] if job.resumed is not None else []
            low, high = attach_range(job.first, job.last_produced, job.first - 1, candidates, True)
            if not low <= attach_after <= high:
                gone = TrainerJobGone(f"{self.address}: FAILED_PRECONDITION: episodes not held")
                return MemoryStream(self, None, 0, gone)
            job.move_grant(grant)
            return MemoryStream(self, job, attach_after)
        if job is not None and not replaceable(job.stopped, job.attached):
            return MemoryStream(self, None, 0, TrainerJobExists(f"{self.address}: EXISTS"))
        if task_kind(task) not in self.providers:
            error = TrainerFailed(f"{self.address}: no provider", "No provider for this task.")
            return MemoryStream(self, None, 0, error)
        unknown = [n for n in task.grpo.reward_functions if n not in self.reward_functions]
        if task_kind(task) == "grpo" and unknown:
            error = TrainerFailed(f"{self.address}: INVALID_ARGUMENT", f"Unknown {unknown[0]}.")
            return MemoryStream(self, None, 0, error)
        needed, what = job_slots(task, placement)
        # Never busy, as no slot will free up enough for it (a trainer without named devices).
        too_many = too_many_slots(what, needed, SlotPool(self.slots_total).most_per_job())
        if too_many is not None:
            return MemoryStream(self, None, 0, self._invalid(run_id, too_many))
        if self.answer_busy > 0 or self.slots_free < needed:
            self.answer_busy = max(0, self.answer_busy - 1)
            return MemoryStream(self, None, 0, TrainerBusy(f"{self.address}: SLOTS_BUSY"))
        # The real core restores before the provider runs (a share: before it meets rank 0).
        restored: CheckpointInfo | None = None
        resumed: Resumed | None = None
        if resume_from:
            try:
                resumed, restored = self._resume(request)
            except ProviderError as exc:
                failed = TrainerFailed(f"{self.address}: {exc.code}: {exc}", exc.user_message)
                return MemoryStream(self, None, 0, failed)
        leader = None
        if placement is not None and placement.first_rank > 0:
            leader = self.rendezvous.get(placement.rendezvous)
            if leader is None or leader.stopped:
                # As the real grpo provider's ranks fail when rank 0's store is gone.
                gone = TrainerProcessDied(
                    f"{self.address}: INTERNAL: rendezvous {placement.rendezvous} gone",
                    "A process of the training job stopped.",
                )
                return MemoryStream(self, None, 0, gone)
        script = self._scripts.popleft() if self._scripts else JobScript()
        job = MemoryJob(self, run_id, task, config, grant, script, resumed, placement, restored)
        self.jobs[run_id] = job
        if placement is not None and placement.first_rank == 0:
            # On the real trainer's default ``--rendezvous-host``: a HOST:PORT the shares'
            # requests carry (the connector's rendezvous are all on one "host").
            job.rendezvous = f"{DEFAULT_RENDEZVOUS_HOST}:{29500 + len(self.rendezvous)}"
            self.rendezvous[job.rendezvous] = job
        if leader is not None:
            leader.join(job)
        return MemoryStream(self, job, 0)

    def _invalid(self, run_id: str, *violations: FieldViolation) -> TrainerFailed:
        """What the gateway hears of a request the real runner finds invalid."""
        error = InvalidRequest(run_id, violations)
        return TrainerFailed(f"{self.address}: INVALID_ARGUMENT: {error}", error.user_message)

    def _resume(
        self, request: trainer_service_pb2.TrainRequest
    ) -> tuple[Resumed, CheckpointInfo | None]:
        """Where a job with ``resume_from`` starts, and the record of the checkpoint of its own
        run it restores: the real trainer core's choice (``trainer_service.core.job_resume``;
        a share's, ``job_share``) over the shared store. Every candidate loads once fetched (the
        fake's jobs restore anything).

        Raises:
            ProviderError: A share cannot restore rank 0's checkpoint.
        """
        run_id, refs, store = request.run_id, request.resume_from, self.store

        def fetch(ref: trainer_service_pb2.CheckpointRef, index: int) -> RestoredCheckpoint:
            del index
            dest = pathlib.Path("memory")
            return fetch_resume_candidate(store, ref, run_id, request.task, request.config, dest)

        skipped: list[tuple[int, str]] = []
        if is_share(placement_of(request)):
            chosen = share_candidate(refs, fetch, run_id)
        else:
            candidates = Candidates(refs, fetch, lambda n, why: skipped.append((n, why)))
            found = next(iter(candidates), None)
            if found is None:
                return Resumed(0, 0.0, tuple(skipped)), None
            chosen = found
        ref, restored = chosen
        own = store.info(run_id, restored.episode) if ref.run_id == run_id else None
        return Resumed(restored.episode, restored.best_reward, tuple(skipped)), own


class MemoryConnector:
    """A ``TrainerConnector`` over ``MemoryTrainer`` s (see the module docstring).

    Args:
        trainers: The trainers, reached by their addresses; any other address is refused.
    """

    def __init__(self, trainers: Iterable[MemoryTrainer]) -> None:
        self.trainers = {t.address: t for t in trainers}
        #: The checkpoint store every trainer reaches.
        self.checkpoints = MemoryCheckpoints()
        #: Rank 0's jobs of jobs that span trainers, by rendezvous.
        self.rendezvous: dict[str, MemoryJob] = {}
        for trainer in self.trainers.values():
            trainer.store = self.checkpoints
            trainer.rendezvous = self.rendezvous
        self.calls: list[Call] = []
        self.closed = 0
        #: Called with every recorded call as it comes (before the trainer answers it).
        self.on_call: Callable[[Call], None] | None = None
        #: The most ``grant`` calls of one run that were in flight at once.
        self.max_grants_in_flight = 0
        self._grants_in_flight: dict[str, int] = {}

    def _record(self, call: Call) -> None:
        self.calls.append(call)
        if self.on_call is not None:
            self.on_call(call)

    @property
    def addresses(self) -> tuple[str, ...]:
        """The trainers' addresses, in order."""
        return tuple(self.trainers)

    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    def _trainer(self, address: str) -> MemoryTrainer:
        trainer = self.trainers.get(address)
        if trainer is None:
            raise TrainerLost(f"trainer {address}: UNAVAILABLE: no such trainer")
        return trainer

    def job(self, run_id: str) -> MemoryJob:
        """The job of a run, on whichever trainer has it (rank 0's, of a job that spans
        trainers)."""
        for trainer in self.trainers.values():
            job = trainer.jobs.get(run_id)
            if job is not None and not job.is_share:
                return job
        raise KeyError(f"no trainer has a job of run {run_id}")

    # -- the record --------------------------------------------------------------------------

    def trains(self, run_id: str) -> list[TrainCall]:
        """The ``train`` calls of a run, in order."""
        return [c for c in self.calls if isinstance(c, TrainCall) and c.run_id == run_id]

    def grants(self, run_id: str) -> list[int]:
        """The ``through_episode`` of every ``grant`` call of a run, in order."""
        return [
            c.through_episode for c in self.calls if isinstance(c, GrantCall) and c.run_id == run_id
        ]

    def granted(self, run_id: str) -> int:
        """How far the gateway granted a run: the largest grant of its ``train`` and ``grant``
        calls (0 before any)."""
        return max([*self.grants(run_id), *(c.grant for c in self.trains(run_id))], default=0)

    def cancels(self, run_id: str) -> list[CancelCall]:
        """The ``cancel_job`` calls of a run."""
        return [c for c in self.calls if isinstance(c, CancelCall) and c.run_id == run_id]

    # -- TrainerConnector --------------------------------------------------------------------

    async def _round_trip(self, address: str, timeout: float) -> MemoryTrainer:
        trainer = self._trainer(address)
        if trainer.frozen:
            try:
                async with asyncio.timeout(timeout):
                    await trainer.thawed()
            except TimeoutError:
                raise TrainerLost(f"trainer {address}: DEADLINE_EXCEEDED") from None
        await asyncio.sleep(trainer.call_s)
        return trainer

    async def capabilities(self, address: str, timeout: float) -> Capabilities:
        return (await self._round_trip(address, timeout)).capabilities()

    def train(
        self,
        address: str,
        run_id: str,
        task: episode_pb2.TrainTask,
        config: episode_pb2.TrainConfig,
        grant_through_episode: int = 0,
        attach_after_episode: int | None = None,
        resume_from: Sequence[ResumePoint] = (),
        placement: JobPlacement | None = None,
    ) -> MemoryStream:
        self._record(
            TrainCall(
                address,
                run_id,
                grant_through_episode,
                attach_after_episode,
                self._now(),
                tuple(p.checkpoint.episode for p in resume_from),
                tuple(p.run_id for p in resume_from),
                placement,
            )
        )
        trainer = self.trainers.get(address)
        if trainer is None:
            return MemoryStream(MemoryTrainer(address), None, 0, TrainerLost(f"{address}: refused"))
        return trainer.open(
            run_id,
            task,
            config,
            grant_through_episode,
            attach_after_episode,
            resume_from,
            placement,
        )

    async def grant(self, address: str, run_id: str, through_episode: int, timeout: float) -> int:
        self._record(GrantCall(address, run_id, through_episode, self._now()))
        in_flight = self._grants_in_flight.get(run_id, 0) + 1
        self._grants_in_flight[run_id] = in_flight
        self.max_grants_in_flight = max(self.max_grants_in_flight, in_flight)
        try:
            trainer = await self._round_trip(address, timeout)
            if trainer.grant_delay_s:
                await asyncio.sleep(trainer.grant_delay_s)
            trainer._check_alive()
            job = trainer.jobs.get(run_id)
            if job is None:
                raise TrainerJobGone(f"trainer {address}: NOT_FOUND: no job of run {run_id}")
            # Like the real trainer: the last episode produced when the grant came, before it
            # let the job produce more.
            last = job.last_produced
            job.move_grant(through_episode)
            return last
        finally:
            self._grants_in_flight[run_id] -= 1

    async def cancel_job(
        self, address: str, run_id: str, timeout: float, checkpoint: bool = False
    ) -> Cancelled:
        self._record(CancelCall(address, run_id, self._now(), checkpoint))
        trainer = await self._round_trip(address, timeout)
        trainer._check_alive()
        job = trainer.jobs.pop(run_id, None)
        if job is None:
            return Cancelled(checkpoint_error="the job was gone" if checkpoint else "")
        if not checkpoint:
            job.stop(cancelled=True)
            return Cancelled(job.last_produced)
        produced, start = job.last_produced, job.first - 1
        # The real core asks the provider for a final checkpoint (its start is decided at once
        # here); the provider writes it as it stops, unless it checkpointed that episode already.
        if writes_final_checkpoint(job.stopped, True, produced, start) and not any(
            e.episode == produced for e in job.checkpoint_events
        ):
            job.checkpoint(produced)
        job.stop(cancelled=True)
        events = [e for e in job.checkpoint_events if e.episode == produced]
        event = None
        if events:
            last = events[-1]
            if isinstance(last, CheckpointSaved):
                info = CheckpointInfo(last.episode, last.create_time, last.size_bytes, last.sha256)
                event = CheckpointEvent(produced, info)
            else:
                event = CheckpointEvent(produced, None, last.message)
        info, error = final_checkpoint_of(event, produced, start, job.restored, job.stopped)
        return Cancelled(produced, saved_event(info) if info is not None else None, error)

    def hyperparameter_calls(self, run_id: str) -> list[HyperparametersCall]:
        """The ``set_hyperparameters`` calls of a run."""
        return [c for c in self.calls if isinstance(c, HyperparametersCall) and c.run_id == run_id]

    async def set_hyperparameters(
        self, address: str, run_id: str, change: Hyperparameters, timeout: float
    ) -> None:
        self._record(HyperparametersCall(address, run_id, change, self._now()))
        trainer = await self._round_trip(address, timeout)
        trainer._check_alive()
        job = trainer.jobs.get(run_id)
        if job is None:
            raise TrainerJobGone(f"trainer {address}: NOT_FOUND: no job of run {run_id}")
        if job.stopped or job.done:
            raise TrainerJobFinished(f"trainer {address}: FAILED_PRECONDITION: job finished")
        try:
            check_change(run_id, PROVIDER_RULES.get(job.kind), job.kind, job.task, change)
        except InvalidRequest as exc:
            detail = f"trainer {address}: INVALID_ARGUMENT: {exc}"
            raise TrainerRefused(detail, exc.user_message, exc.violations) from None
        job.hyperparameters = job.hyperparameters.merged(change)
        job.hyperparameter_changes.append((job.last_produced, change.as_dict()))

    async def close(self) -> None:
        """Counts the close; the trainers live on (a restarted gateway reaches them again)."""
        self.closed += 1

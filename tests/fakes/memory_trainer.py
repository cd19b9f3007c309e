"""An in-memory ``TrainerConnector`` for tests of the gateway core: trainers without grpc,
sockets or threads, on the test's event loop (so virtual time drives them too).

``MemoryConnector`` reaches ``MemoryTrainer`` s by address. A trainer offers providers in a
number of slots; each ``train`` call starts a ``MemoryJob`` (one slot, until its provider stops)
or re-attaches a stream to one. Like the real trainer (``trainer_service.core.jobs``), a job:

- produces episodes only up to its grant (``n <= grant``): it is not pulled past it, and its
  stream sends ``None`` heartbeats every ``heartbeat_s`` while it waits;
- produces a valid stream (``tests.fakes.episodes.make_episode``: episodes 1..N, best_reward the
  running maximum, done on the last);
- outlives a broken or cancelled stream (detached) and holds its episodes for a re-attach
  after ``attach_after_episode``; a re-attach to a job that is gone is ``TrainerJobGone``, a
  new ``train`` of a run whose job is still live ``TrainerJobExists``;
- releases its slot once its provider stopped (the done episode produced, a failure, or
  ``cancel_job``).

Checkpoints: a job with ``config.checkpoint_every`` writes one after every that many episodes
and after its done episode into the connector's shared store (``MemoryConnector.checkpoints``,
reachable by every trainer like a shared filesystem), and its stream reports each after the
episode it was taken after. ``cancel_job(checkpoint=True)`` writes one at the job's last
episode (none before its first: "the job had not trained an episode", as the real core says).
A ``train`` with ``resume_from`` starts from the first candidate in the store that is not marked
``corrupt`` and says so first (``Resumed``), numbering on from it; a candidate may be another
run's (a fork starts from its parent's checkpoint).

Live hyperparameters: a job starts with its task's (the providers' defaults applied: grpo's are
the real provider's own rules) and ``set_hyperparameters`` changes them for the episodes it
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
failed, cancelled), its shares fail as their peers are gone (``TrainerProcessDied``).

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
import hashlib
import math
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
from tests.fakes.episodes import broken, make_episode, reward_of
from trainer_service.providers.grpo.hyperparameters import has_reference_model as grpo_reference
from trainer_service.providers.grpo.hyperparameters import hyperparameters as grpo_initial
from trainwire.contract import (
    REWARD_FUNCTIONS,
    describe_violations,
    task_kind,
)
from trainwire.hyperparameters import Hyperparameters
from trainwire.v1 import episode_pb2

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

#: The learning rate of an imitation job whose task leaves it at 0 (the imitation provider's
#: ``DEFAULT_LEARNING_RATE``: that module imports torch, so the value is copied here; the
#: conformance suite, ``tests/conformance``, holds it to the real trainer's).
IMITATION_LEARNING_RATE = 0.03


def initial_hyperparameters(task: episode_pb2.TrainTask) -> Hyperparameters:
    """The live hyperparameters a job of ``task`` starts with, defaults applied: for grpo the
    real provider's own rules (``trainer_service.providers.grpo.hyperparameters``: LoRA's
    learning rate and beta differ)."""
    if task_kind(task) == "imitation":
        return Hyperparameters(
            learning_rate=task.imitation.learning_rate or IMITATION_LEARNING_RATE
        )
    return grpo_initial(task)


def has_reference_model(task: episode_pb2.TrainTask) -> bool:
    """Whether a job of ``task`` may weigh a KL term (beta above 0): every imitation job (it has
    no beta), a grpo job as the real provider says (started with beta above 0, or LoRA)."""
    return task_kind(task) != "grpo" or grpo_reference(task.grpo)


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
    ) -> None:
        self.trainer = trainer
        self.run_id = run_id
        #: Its share of a job that spans trainers (None: the whole job).
        self.placement = placement
        #: Slots it holds.
        self.slots = job_slots(task, placement)
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
        self.first = 1
        if resumed is not None and resumed.episode:
            self.first = resumed.episode + 1
            self._best = resumed.best_reward
        #: Checkpoint events, in order, each with the episode after which it is sent.
        self.checkpoint_events: list[CheckpointSaved | CheckpointFailed] = []
        #: The live hyperparameters of the next episode it produces.
        self.hyperparameters = initial_hyperparameters(task)
        #: Whether it started with a reference model (grpo: beta above 0, or LoRA).
        self.reference_model = has_reference_model(task)
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
            event = self.trainer.store.write(self.run_id, episode, self._best)
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
        every = self.config.checkpoint_every
        # Like the real trainer's providers (``JobCheckpoints.due``): after every that many
        # episodes and, whatever ``checkpoint_every``, after the last.
        if (every and n % every == 0) or episode.done:
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


def job_slots(task: episode_pb2.TrainTask, placement: JobPlacement | None) -> int:
    """Slots a job holds: its placement's processes, else one per GRPO process (1 for other
    kinds)."""
    if placement is not None:
        return placement.processes
    return max(1, task.grpo.num_processes) if task_kind(task) == "grpo" else 1


class MemoryCheckpoints:
    """The checkpoint store the memory trainers share: what each checkpoint restores (the best
    reward through its episode), and the ones a test marked corrupt."""

    def __init__(self) -> None:
        self.saved: dict[tuple[str, int], float] = {}
        self.corrupt: set[tuple[str, int]] = set()
        self.deleted: list[tuple[str, int]] = []

    @staticmethod
    def digest(run_id: str, episode: int) -> str:
        """The sha256 of the checkpoint of ``run_id`` after ``episode``."""
        return hashlib.sha256(f"{run_id}/{episode}".encode()).hexdigest()

    def write(self, run_id: str, episode: int, best_reward: float) -> CheckpointSaved:
        self.saved[(run_id, episode)] = best_reward
        digest = self.digest(run_id, episode)
        return CheckpointSaved(episode, 1_700_000_000_000_000_000 + episode, 1000 + episode, digest)

    def restore(self, points: Sequence[ResumePoint]) -> Resumed:
        """Where a job given ``points`` starts: the first one that is there and sound."""
        skipped: list[tuple[int, str]] = []
        for point in points:
            key = (point.run_id, point.checkpoint.episode)
            if key not in self.saved:
                skipped.append((point.checkpoint.episode, "missing"))
            elif key in self.corrupt or (
                # Like the real trainer: the digest the gateway recorded must match.
                point.checkpoint.sha256 and point.checkpoint.sha256 != self.digest(*key)
            ):
                skipped.append((point.checkpoint.episode, "digest mismatch"))
            else:
                return Resumed(point.checkpoint.episode, self.saved[key], tuple(skipped))
        return Resumed(0, 0.0, tuple(skipped))

    # The ``CheckpointFiles`` the gateway deletes through.
    location = "memory"

    def tar_chunks(self, run_id: str, episode: int, chunk_size: int) -> Iterator[bytes]:
        yield f"{run_id}/{episode}".encode()

    def delete(self, run_id: str, episode: int) -> None:
        self.saved.pop((run_id, episode), None)
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
        if attach_after is not None:
            if job is None:
                return MemoryStream(self, None, 0, TrainerJobGone(f"{self.address}: NOT_FOUND"))
            job.move_grant(grant)
            return MemoryStream(self, job, attach_after)
        if job is not None and not (job.stopped and not job.attached):
            return MemoryStream(self, None, 0, TrainerJobExists(f"{self.address}: EXISTS"))
        if task_kind(task) not in self.providers:
            error = TrainerFailed(f"{self.address}: no provider", "No provider for this task.")
            return MemoryStream(self, None, 0, error)
        unknown = [n for n in task.grpo.reward_functions if n not in self.reward_functions]
        if task_kind(task) == "grpo" and unknown:
            error = TrainerFailed(f"{self.address}: INVALID_ARGUMENT", f"Unknown {unknown[0]}.")
            return MemoryStream(self, None, 0, error)
        needed = job_slots(task, placement)
        if needed > self.slots_total:
            # Like the real trainer: never busy, as no slot will free up enough for it.
            error = TrainerFailed(
                f"{self.address}: INVALID_ARGUMENT",
                f"The trainer refused this task: needs {needed} slots; this trainer can give "
                f"one job at most {self.slots_total}",
            )
            return MemoryStream(self, None, 0, error)
        if self.answer_busy > 0 or self.slots_free < needed:
            self.answer_busy = max(0, self.answer_busy - 1)
            return MemoryStream(self, None, 0, TrainerBusy(f"{self.address}: SLOTS_BUSY"))
        leader = None
        if placement is not None and placement.first_rank > 0:
            leader = self.rendezvous.get(placement.rendezvous)
            if leader is None or leader.stopped:
                gone = TrainerCrashed(f"{self.address}: rendezvous {placement.rendezvous} gone")
                return MemoryStream(self, None, 0, gone)
        script = self._scripts.popleft() if self._scripts else JobScript()
        resumed = self.store.restore(resume_from) if resume_from else None
        job = MemoryJob(self, run_id, task, config, grant, script, resumed, placement)
        self.jobs[run_id] = job
        if placement is not None and placement.first_rank == 0:
            job.rendezvous = f"rendezvous.{self.address}:{29500 + len(self.rendezvous)}"
            self.rendezvous[job.rendezvous] = job
        if leader is not None:
            leader.join(job)
        return MemoryStream(self, job, 0)


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
        job.stop(cancelled=True)
        if not checkpoint:
            return Cancelled(job.last_produced)
        if not job.last_produced:
            # Like the real trainer: a job stopped before its first episode has no checkpoint.
            return Cancelled(checkpoint_error="the job had not trained an episode")
        # Like the real trainer: a checkpoint of the last episode already written (a periodic
        # one) is the final one; none is written again.
        written = [
            e
            for e in job.checkpoint_events
            if e.episode == job.last_produced and isinstance(e, CheckpointSaved)
        ]
        if written:
            return Cancelled(job.last_produced, written[-1])
        event = job.checkpoint(job.last_produced)
        if isinstance(event, CheckpointFailed):
            return Cancelled(job.last_produced, checkpoint_error=event.message)
        return Cancelled(job.last_produced, event)

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
        violations = change.violations(job.kind, reference_model=job.reference_model)
        if violations:
            message = describe_violations(violations)
            raise TrainerRefused(f"trainer {address}: INVALID_ARGUMENT", message, violations)
        job.hyperparameters = job.hyperparameters.merged(change)
        job.hyperparameter_changes.append((job.last_produced, change.as_dict()))

    async def close(self) -> None:
        """Counts the close; the trainers live on (a restarted gateway reaches them again)."""
        self.closed += 1

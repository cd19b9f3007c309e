"""The run state machine: ``TrainingRun`` and its legal transitions.

``PENDING -> RUNNING <-> PAUSED -> DONE | STOPPED | ERROR``; a PENDING run waits for a trainer
slot.
Pausing a paused run and resuming a running one are no-ops; any other control that does not fit
the state raises ``IllegalTransition``; every terminal state is absorbing.
"""

from __future__ import annotations

import dataclasses
import enum

from gateway.core.errors import IllegalTransition, InvalidRequest
from gateway.core.pacing import clamp_speed
from trainwire.contract import FieldViolation
from trainwire.v1 import episode_pb2

CONTRACT_MESSAGE = (
    "The training service sent back something I didn't understand. Check the server log."
)
LOST_MESSAGE = "The training service stopped responding."
UNEXPECTED_MESSAGE = "Training stopped unexpectedly."
INTERRUPTED_MESSAGE = "Interrupted: the gateway restarted while this run was active."


class RunState(enum.IntEnum):
    """Run states; the numbers equal ``trainwire.v1.Run.State``."""

    UNSPECIFIED = 0
    PENDING = 1
    RUNNING = 2
    PAUSED = 3
    DONE = 4
    STOPPED = 5
    ERROR = 6

    @property
    def finished(self) -> bool:
        """True for the absorbing states DONE, STOPPED and ERROR."""
        return self in _FINISHED

    @property
    def active(self) -> bool:
        """True for PENDING, RUNNING and PAUSED."""
        return self in _ACTIVE


_FINISHED = frozenset({RunState.DONE, RunState.STOPPED, RunState.ERROR})
_ACTIVE = frozenset({RunState.PENDING, RunState.RUNNING, RunState.PAUSED})


@dataclasses.dataclass(slots=True)
class TrainingRun:
    """One training run as the gateway owns it (times are Unix nanoseconds, 0 = unset).

    Attributes:
        id: The run id.
        task: What it trains (validated).
        config: How long it trains and its seed.
        speed: Playback speed multiplier, 0.1..20.
        episodes_per_second: Base publication rate; negative means unpaced.
        state: Where the run is in its life.
        error_message: Why it failed, for users (ERROR only).
        episode: The last published episode (0 before the first).
        reward: The last published episode's reward.
        best_reward: The best published reward.
        create_time: When it was created.
        start_time: When training started.
        end_time: When it finished.
        display_name: Free-form name.
        trainer: Address of its trainer, rank 0's for a job that spans trainers ("" while
            PENDING).
        request_id: Its idempotency key ("" when none).
        seq: Creation order in the store (newest is largest); 0 until stored.
        trainer_episode: The last episode received from the trainer (0 before the first); at
            most the lead ahead of ``episode`` while the run is paced.
        state_detail: For people: why the run is in its state (not stored; filled in by the
            registry for active runs).
        request_hash: The fingerprint of the request that created it (tells a retried
            request_id from a reused one; "" for runs stored before fingerprints).
        creator: The name of the token that created it ("" without authentication).
        checkpoint_episode: The episode of its latest recorded checkpoint (0: none yet);
            the store's checkpoint records keep it, ``Store.update_run`` never writes it.
        restarts: How often the gateway re-placed it from a checkpoint after its trainer died.
        parked: Paused with its job ended and its slot freed; resuming places it again from
            its checkpoint.
        labels: Labels for people and searches (validated; replaced whole, never mutated in
            place, so a snapshot keeps its own).
        fork_run_id: The run it was forked from ("" when trained from scratch).
        fork_episode: The checkpoint episode it was forked from: its episodes are numbered
            from ``fork_episode + 1`` (0 when not a fork).
        trainers: Every trainer its job runs on (or last ran on), rank 0's first (so
            ``trainers[0] == trainer``); one for a job on one trainer, none while PENDING.
    """

    id: str
    task: episode_pb2.TrainTask
    config: episode_pb2.TrainConfig
    speed: float = 1.0
    episodes_per_second: float = 1.0
    state: RunState = RunState.PENDING
    error_message: str = ""
    episode: int = 0
    reward: float = 0.0
    best_reward: float = 0.0
    create_time: int = 0
    start_time: int = 0
    end_time: int = 0
    display_name: str = ""
    trainer: str = ""
    request_id: str = ""
    seq: int = 0
    trainer_episode: int = 0
    state_detail: str = ""
    request_hash: str = ""
    creator: str = ""
    checkpoint_episode: int = 0
    restarts: int = 0
    parked: bool = False
    labels: dict[str, str] = dataclasses.field(default_factory=dict)
    fork_run_id: str = ""
    fork_episode: int = 0
    trainers: tuple[str, ...] = ()

    def snapshot(self) -> TrainingRun:
        """A copy that later transitions do not change (task and config are shared, read-only)."""
        return dataclasses.replace(self)

    def _illegal(self, action: str) -> IllegalTransition:
        return IllegalTransition(
            f"cannot {action} run {self.id!r}: it is {self.state.name}", self.id
        )

    def start(self, trainer: str, now: int, trainers: tuple[str, ...] = ()) -> None:
        """PENDING -> RUNNING on its trainer (rank 0's of ``trainers``, when its job spans
        several)."""
        if self.state is not RunState.PENDING:
            raise self._illegal("start")
        self.state = RunState.RUNNING
        self.trainer = trainer
        self.trainers = trainers or (trainer,)
        self.start_time = now

    def pause(self) -> bool:
        """RUNNING -> PAUSED; a paused run stays paused. Returns whether the state changed."""
        if self.state is RunState.PAUSED:
            return False
        if self.state is not RunState.RUNNING:
            raise self._illegal("pause")
        self.state = RunState.PAUSED
        return True

    def resume(self) -> bool:
        """PAUSED -> RUNNING; a running run stays running. Returns whether the state changed."""
        if self.state is RunState.RUNNING:
            return False
        if self.state is not RunState.PAUSED:
            raise self._illegal("resume")
        self.state = RunState.RUNNING
        return True

    def stop(self, now: int) -> None:
        """Any active state -> STOPPED."""
        if not self.state.active:
            raise self._illegal("stop")
        self._end(RunState.STOPPED, now)

    def set_speed(self, speed: float) -> None:
        """Sets the speed of an active run, clamped to 0.1..20.

        Raises:
            InvalidRequest: speed is NaN or infinite.
            IllegalTransition: the run is finished.
        """
        try:
            clamped = clamp_speed(speed)
        except ValueError:
            raise InvalidRequest(
                f"speed of run {self.id!r} must be finite, got {speed}",
                [FieldViolation("speed", f"{speed}; need a finite value")],
                self.id,
            ) from None
        if not self.state.active:
            raise self._illegal("change the speed of")
        self.speed = clamped

    # Published progress: the publisher's.

    def record_episode(self, episode: int, reward: float, best_reward: float) -> None:
        """Records a published episode."""
        self.episode = episode
        self.reward = reward
        self.best_reward = best_reward

    # Received progress: the trainer feed's (and a gateway restart's, which starts it over
    # from the published episode); checkpoint progress: the checkpoint ledger's.

    def received_through(self, episode: int) -> None:
        """The last episode received from the trainer is ``episode``."""
        self.trainer_episode = episode

    def checkpointed(self, episode: int) -> None:
        """A checkpoint at ``episode`` was recorded (the latest stays the latest)."""
        self.checkpoint_episode = max(self.checkpoint_episode, episode)

    # The lifecycle beyond the state: the driver's (``gateway.core.lifecycle``).

    def placed(self, trainer: str, trainers: tuple[str, ...]) -> None:
        """Its job (placed again) runs on ``trainers``, rank 0's ``trainer`` first; it is no
        longer parked."""
        self.parked = False
        self.trainer, self.trainers = trainer, trainers

    def park(self) -> None:
        """Its job ended for the park: its training state is in its checkpoint."""
        self.parked = True

    def restarted(self, number: int) -> None:
        """Its job is placed again from a checkpoint, as restart ``number``."""
        self.restarts = number

    # Identity: the task changes with live hyperparameters, the metadata with UpdateRun; both
    # are replaced whole, so snapshots keep their own.

    def retask(self, task: episode_pb2.TrainTask) -> None:
        """Its task is now ``task`` (the values in effect for the job placed next)."""
        self.task = task

    def relabel(self, display_name: str, labels: dict[str, str]) -> None:
        """Its name and labels are now these."""
        self.display_name, self.labels = display_name, labels

    def complete(self, now: int) -> None:
        """RUNNING (or PAUSED) -> DONE once the done episode is published."""
        if self.state not in (RunState.RUNNING, RunState.PAUSED):
            raise self._illegal("complete")
        self._end(RunState.DONE, now)

    def fail(self, message: str, now: int) -> None:
        """Any active state -> ERROR with a message for users."""
        if not self.state.active:
            raise self._illegal("fail")
        self._end(RunState.ERROR, now)
        self.error_message = message

    def _end(self, state: RunState, now: int) -> None:
        self.state = state
        self.end_time = now

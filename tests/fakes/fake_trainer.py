"""A scripted fake ``TrainerService`` on a real in-process gRPC server (port 0).

Each ``Train`` call follows the next queued ``Script`` (or the default one): stream normally,
slowly, only heartbeats, go silent, abort with a ``google.rpc.LocalizedMessage`` or plainly,
break one contract rule, answer ``RESOURCE_EXHAUSTED`` (busy, or another kind), or hold at an
episode until the test releases it or kills the server mid-stream. Like the real trainer it
honours grants (``grant_through_episode``, ``Grant``; ``Script.ignore_grants`` turns that off),
answers ``CancelJob``, and takes re-attaches as the real trainer does while the job's stream is
still open (that stream ends ``ABORTED``, the new one goes on after ``attach_after_episode``);
it keeps no detached jobs, so any other re-attach is ``NOT_FOUND``.
It runs on its own thread pool (sync server), so it
is independent of the event loop of the gateway under test.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any, NoReturn

import grpc
from google.protobuf import timestamp_pb2

from trainwire import contract, motion
from trainwire.reasons import ErrorReason
from trainwire.v1 import episode_pb2, trainer_service_pb2, trainer_service_pb2_grpc
from trainwire_ops.rich_status import rich_status

#: Contract rules a script can break (``Script.violate``).
VIOLATIONS = (
    "sequence",
    "finite",
    "metric_finite",
    "best_reward",
    "done",
    "done_missing",
    "detail_kind",
    "detail_size",
    "end_without_done",
)


@dataclass
class Script:
    """How one ``Train`` call behaves.

    Attributes:
        episodes: Episodes to send (default: the request's max_episodes).
        interval: Seconds between episodes (heartbeats are sent meanwhile).
        heartbeat_interval: Seconds between heartbeats while no episode goes out.
        heartbeats_only: Send heartbeats forever, never an episode.
        silent: Send nothing at all (until cancelled).
        busy: Answer RESOURCE_EXHAUSTED (reason SLOTS_BUSY) at once.
        exhausted: Answer RESOURCE_EXHAUSTED without the SLOTS_BUSY reason (a message too
            large, out of memory), with this LocalizedMessage text ("" for none).
        ignore_grants: Stream without waiting for grants.
        abort_after: Abort after this many episodes (``abort_code``; with ``localized`` the
            details carry a LocalizedMessage).
        abort_code: Status code of the abort.
        localized: The LocalizedMessage text for users.
        violate: A rule from ``VIOLATIONS`` broken at episode ``violate_at``.
        violate_at: Where the violation happens.
        hold_at: Before sending this episode, wait for ``release`` (or cancellation).
        detail_every: Imitation detail on every n-th episode and on the last.
        frames: Frames of the imitation detail.
        joints: Joints of the imitation detail (32 with 240 frames: the contract's largest).
        motion: Send ``scripted_episodes``: a reward curve that rises and, for imitation runs,
            the motion of the task's own rig and clip (the CLI's pictures need it).
    """

    episodes: int | None = None
    interval: float = 0.0
    heartbeat_interval: float = 0.05
    heartbeats_only: bool = False
    silent: bool = False
    busy: bool = False
    exhausted: str | None = None
    ignore_grants: bool = False
    abort_after: int | None = None
    abort_code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    localized: str | None = None
    violate: str | None = None
    violate_at: int = 3
    hold_at: int | None = None
    release: threading.Event = field(default_factory=threading.Event)
    detail_every: int = 10
    frames: int = 60
    joints: int = 11
    motion: bool = False


def reward_of(n: int) -> float:
    """The deterministic reward of episode n."""
    return round(0.5 + 0.45 * math.sin(n / 7.0), 6)


def make_episode(
    n: int, best: float, last: bool, detail: bool, frames: int = 60, joints: int = 11
) -> episode_pb2.Episode:
    """A valid imitation episode n (best = running max so far, including n)."""
    ep = episode_pb2.Episode(
        episode=n,
        reward=reward_of(n),
        best_reward=best,
        done=last,
        metrics={"loss": 1.0 / n, "reward_std": 0.1},
    )
    ep.produce_time.FromNanoseconds(time.time_ns())
    if detail:
        ep.imitation.frame_count = frames
        ep.imitation.joint_count = joints
        ep.imitation.angles.extend(
            math.sin(0.1 * f + 0.3 * j + 0.01 * n) for f in range(frames) for j in range(joints)
        )
    return ep


def valid_episodes(
    count: int, detail_every: int = 10, frames: int = 60, joints: int = 11
) -> Iterator[episode_pb2.Episode]:
    """A valid imitation stream of ``count`` episodes (``produce_time`` set when built)."""
    best = -math.inf
    for n in range(1, count + 1):
        best = max(best, reward_of(n))
        last = n == count
        yield make_episode(n, best, last, last or n % detail_every == 0, frames, joints)


def scripted_reward(n: int) -> float:
    """The fake's reward curve: rising towards 1 with a deterministic wobble."""
    return round(1.0 - 0.9 * math.exp(-n / 15.0) + 0.03 * math.sin(n * 1.7), 6)


def scripted_episodes(
    task: episode_pb2.TrainTask, config: episode_pb2.TrainConfig
) -> list[episode_pb2.Episode]:
    """A valid episode stream for the task: rewards from ``scripted_reward``; imitation runs carry
    the policy's motion every 10th episode and on the last (the target clip plus an error that
    shrinks as training goes), grpo runs a sample completion."""
    kind = contract.task_kind(task)
    clip = motion.clip_from_task(task.imitation) if kind == "imitation" else None
    total = config.max_episodes
    episodes: list[episode_pb2.Episode] = []
    best = -math.inf
    for n in range(1, total + 1):
        reward = scripted_reward(n)
        best = max(best, reward)
        episode = episode_pb2.Episode(
            episode=n,
            reward=reward,
            best_reward=best,
            done=n == total,
            metrics={"loss": 1.0 / n},
            produce_time=_now(),
        )
        if clip is not None and (n % 10 == 0 or n == total):
            error = 0.8 * (1.0 - n / total) + 0.15
            angles = [a + error * math.sin(i * 0.37 + n) for i, a in enumerate(clip.angles)]
            episode.imitation.CopyFrom(
                episode_pb2.ImitationDetail(
                    frame_count=clip.frame_count, joint_count=clip.joint_count, angles=angles
                )
            )
        elif kind == "grpo":
            episode.grpo.sample_completions.append(f"<answer>{n}</answer>")
        episodes.append(episode)
    return episodes


def _now() -> timestamp_pb2.Timestamp:
    stamp = timestamp_pb2.Timestamp()
    stamp.FromNanoseconds(time.time_ns())
    return stamp


class _Ended(threading.Event):
    """Set when the call ended; also reads as set once the whole fake is being killed."""

    def __init__(self, closed: threading.Event) -> None:
        super().__init__()
        self._closed = closed
        self.superseded = False  # ended because another call re-attached to the job

    def is_set(self) -> bool:
        return super().is_set() or self._closed.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return super().wait(timeout) or self._closed.is_set()


def _heartbeat(last: int, phase: str = "training") -> trainer_service_pb2.TrainResponse:
    hb = trainer_service_pb2.Heartbeat(last_episode=last, phase=phase)
    hb.time.FromNanoseconds(time.time_ns())
    return trainer_service_pb2.TrainResponse(heartbeat=hb)


def _break(ep: episode_pb2.Episode, rule: str) -> list[episode_pb2.Episode]:
    """The episode(s) to send instead of ``ep`` to break ``rule``."""
    if rule == "sequence":
        ep.episode += 1
    elif rule == "finite":
        ep.reward = math.nan
    elif rule == "metric_finite":
        ep.metrics["loss"] = math.inf
    elif rule == "best_reward":
        ep.best_reward = ep.best_reward + 1.0
    elif rule == "done":
        ep.done = True
        follower = episode_pb2.Episode()
        follower.CopyFrom(ep)
        follower.episode += 1
        follower.done = False
        return [ep, follower]
    elif rule == "detail_kind":
        ep.ClearField("imitation")
        ep.grpo.sample_completions.append("not an imitation run")
    elif rule == "detail_size":
        ep.imitation.frame_count = 2
        ep.imitation.joint_count = 11
        del ep.imitation.angles[:]
        ep.imitation.angles.extend([0.0] * 5)
    else:
        raise ValueError(f"unknown rule {rule}")
    return [ep]


def _abort_with(
    context: grpc.ServicerContext,
    code: grpc.StatusCode,
    message: str,
    reason: str,
    localized: str | None = None,
) -> NoReturn:
    """Aborts with a rich status, built as the real trainer builds its own."""
    context.abort_with_status(rich_status(code, message, reason, localized=localized))
    raise AssertionError("unreachable")


class FakeTrainer(trainer_service_pb2_grpc.TrainerServiceServicer):
    """The fake trainer. ``start()`` returns its address; ``push`` queues scripts per call.

    Args:
        slots: Concurrent Train calls it accepts; more get RESOURCE_EXHAUSTED.
        providers: What GetCapabilities reports.
        default: The script for calls with nothing queued.
    """

    def __init__(
        self,
        slots: int = 4,
        providers: tuple[str, ...] = ("imitation", "grpo"),
        default: Script | None = None,
    ) -> None:
        self.slots = slots
        self.providers = providers
        self.probes = 0  # GetCapabilities calls
        self.hang_capabilities = threading.Event()  # set: GetCapabilities hangs
        self.default = default or Script()
        self.scripts: deque[Script] = deque()
        self.requests: list[trainer_service_pb2.TrainRequest] = []
        self.grants: dict[str, int] = {}  # run id -> grant of its live call (0: none)
        self.granted: list[tuple[str, int]] = []  # every Grant call
        # Every CancelJob call's run, found or not: a stop cancels the stream and then the job,
        # and where the real trainer keeps the job detached in between, this fake ends it with
        # its stream, so which of the two arrives first is only a matter of timing here.
        self.jobs_cancelled: list[str] = []
        self._ended_by_run: dict[str, threading.Event] = {}
        # run id -> (its script, its first request, the event of the call that streams it)
        self._jobs: dict[str, tuple[Script, trainer_service_pb2.TrainRequest, _Ended]] = {}
        self.cancelled = 0
        self.active = 0
        self.sent = 0  # episodes sent over all calls
        self._cond = threading.Condition()
        self._server: grpc.Server | None = None
        self._closed = threading.Event()  # set by kill(): every handler returns promptly
        self.address = ""

    def push(self, *scripts: Script) -> None:
        """Queues scripts for the next Train calls, in order."""
        self.scripts.extend(scripts)

    def start(self) -> str:
        """Starts serving on 127.0.0.1:0; returns ``HOST:PORT``."""
        # Every live Train stream holds a worker; Grant, CancelJob and GetCapabilities need
        # free ones besides, or streams waiting for a grant would wait forever.
        workers = max(32, self.slots + 16)
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="fake")
        )
        trainer_service_pb2_grpc.add_TrainerServiceServicer_to_server(self, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        self._server = server
        self.address = f"127.0.0.1:{port}"
        return self.address

    def kill(self) -> None:
        """Stops the server at once: every open stream breaks."""
        self._closed.set()
        if self._server is not None:
            self._server.stop(0).wait(5)
            self._server = None

    stop = kill

    def wait_sent(self, count: int, timeout: float = 10.0) -> None:
        """Blocks until ``count`` episodes have been sent in total."""
        with self._cond:
            if not self._cond.wait_for(lambda: self.sent >= count, timeout):
                raise TimeoutError(f"only {self.sent} of {count} episodes sent")

    def wait_calls(self, count: int, timeout: float = 10.0) -> None:
        """Blocks until ``count`` Train calls have arrived."""
        with self._cond:
            if not self._cond.wait_for(lambda: len(self.requests) >= count, timeout):
                raise TimeoutError(f"only {len(self.requests)} of {count} Train calls")

    def wait_idle(self, timeout: float = 10.0) -> None:
        """Blocks until no Train call is running."""
        with self._cond:
            if not self._cond.wait_for(lambda: self.active == 0, timeout):
                raise TimeoutError(f"{self.active} Train calls still running")

    # -- TrainerService ----------------------------------------------------------------------

    def Grant(
        self, request: trainer_service_pb2.GrantRequest, context: grpc.ServicerContext
    ) -> trainer_service_pb2.GrantResponse:
        with self._cond:
            self.granted.append((request.run_id, request.through_episode))
            if request.run_id not in self.grants:
                _abort_with(
                    context, grpc.StatusCode.NOT_FOUND, "no such job", ErrorReason.JOB_NOT_FOUND
                )
            if request.through_episode > self.grants[request.run_id]:
                self.grants[request.run_id] = request.through_episode
                self._cond.notify_all()
        return trainer_service_pb2.GrantResponse(last_episode=0)

    def CancelJob(
        self, request: trainer_service_pb2.CancelJobRequest, context: grpc.ServicerContext
    ) -> trainer_service_pb2.CancelJobResponse:
        with self._cond:
            self.jobs_cancelled.append(request.run_id)
            ended = self._ended_by_run.get(request.run_id)
        if ended is None:
            _abort_with(
                context, grpc.StatusCode.NOT_FOUND, "no such job", ErrorReason.JOB_NOT_FOUND
            )
        ended.set()
        return trainer_service_pb2.CancelJobResponse()

    def GetCapabilities(
        self, request: trainer_service_pb2.GetCapabilitiesRequest, context: grpc.ServicerContext
    ) -> trainer_service_pb2.GetCapabilitiesResponse:
        with self._cond:
            self.probes += 1
            free = max(0, self.slots - self.active)
        if self.hang_capabilities.is_set():
            # A hung trainer (SIGSTOP, a stuck process): answers only after the caller gave up.
            while self.hang_capabilities.is_set() and context.is_active():
                self._closed.wait(0.05)
        return trainer_service_pb2.GetCapabilitiesResponse(
            providers=list(self.providers),
            device="cpu",
            slots_total=self.slots,
            slots_free=free,
            server_version="fake",
        )

    def Train(
        self, request: trainer_service_pb2.TrainRequest, context: grpc.ServicerContext
    ) -> Iterator[trainer_service_pb2.TrainResponse]:
        if request.HasField("attach_after_episode"):
            yield from self._attach(request, context)
            return
        with self._cond:
            script = self.scripts.popleft() if self.scripts else self.default
            self.requests.append(request)
            full = self.active >= self.slots
            refused = script.busy or full or script.exhausted is not None
            if not refused:
                self.active += 1
            self._cond.notify_all()
        if script.exhausted is not None:
            _abort_with(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "request too large",
                "MESSAGE_TOO_LARGE",  # not a Trainwire reason: a transport's own
                script.exhausted or None,
            )
        if script.busy or full:
            _abort_with(
                context, grpc.StatusCode.RESOURCE_EXHAUSTED, "no free slot", ErrorReason.SLOTS_BUSY
            )
        yield from self._serve(script, request, request, context)

    def _attach(
        self, request: trainer_service_pb2.TrainRequest, context: grpc.ServicerContext
    ) -> Iterator[trainer_service_pb2.TrainResponse]:
        """A re-attach: takes the job over from its open stream, or ``NOT_FOUND``."""
        with self._cond:
            self.requests.append(request)
            job = None if self._closed.is_set() else self._jobs.get(request.run_id)
            if job is not None:
                self.active += 1  # this call holds the job's slot now; the old one gives it up
            self._cond.notify_all()
        if self._closed.is_set():
            context.abort(grpc.StatusCode.UNAVAILABLE, "the fake trainer is going away")
        if job is None:
            _abort_with(
                context, grpc.StatusCode.NOT_FOUND, "no such job", ErrorReason.JOB_NOT_FOUND
            )
        script, first, previous = job
        previous.superseded = True
        previous.set()
        yield from self._serve(script, first, request, context)

    def _serve(
        self,
        script: Script,
        first: trainer_service_pb2.TrainRequest,
        request: trainer_service_pb2.TrainRequest,
        context: grpc.ServicerContext,
    ) -> Iterator[trainer_service_pb2.TrainResponse]:
        """Plays the job of ``first`` (its task and config) on the call of ``request`` (the
        same, or a re-attach), after the episode it attaches after."""
        ended = _Ended(self._closed)
        context.add_callback(ended.set)
        run_id = request.run_id
        with self._cond:
            self.grants[run_id] = 0 if script.ignore_grants else request.grant_through_episode
            self._ended_by_run[run_id] = ended
            self._jobs[run_id] = (script, first, ended)
        try:
            yield from self._play(script, first, context, ended, request.attach_after_episode)
        finally:
            with self._cond:
                if self._ended_by_run.get(run_id) is ended:
                    del self._ended_by_run[run_id]
                    del self._jobs[run_id]
                    self.grants.pop(run_id, None)
                self.active -= 1
                # The callback fires at termination: set before this point only when the call
                # was cancelled (or the server killed) while the script was still playing.
                if ended.is_set() and not ended.superseded:
                    self.cancelled += 1
                self._cond.notify_all()
        if ended.superseded:
            context.abort(
                grpc.StatusCode.ABORTED,
                f"run {run_id}: another caller re-attached to this job; this stream ends",
            )
        if self._closed.is_set():  # killed: a dying server's streams break, none ends OK
            context.abort(grpc.StatusCode.UNAVAILABLE, "the fake trainer is going away")

    def _wait(
        self, script: Script, seconds: float, last: int, ended: threading.Event
    ) -> Iterator[trainer_service_pb2.TrainResponse]:
        """Waits ``seconds``, sending heartbeats meanwhile."""
        deadline = time.monotonic() + seconds
        while not ended.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            if ended.wait(min(left, script.heartbeat_interval)):
                return
            if time.monotonic() < deadline:
                yield _heartbeat(last)

    def _wait_grant(
        self, script: Script, run_id: str, n: int, ended: threading.Event
    ) -> Iterator[trainer_service_pb2.TrainResponse]:
        """Holds episode ``n`` until it is granted, with "waiting" heartbeats meanwhile."""
        while not ended.is_set():
            with self._cond:
                grant = self.grants.get(run_id, 0)
                if not grant or n <= grant:
                    return
                self._cond.wait(script.heartbeat_interval)
                grant = self.grants.get(run_id, 0)
                if not grant or n <= grant:
                    return
            yield _heartbeat(n - 1, "waiting")

    def _play(
        self,
        script: Script,
        request: trainer_service_pb2.TrainRequest,
        context: grpc.ServicerContext,
        ended: threading.Event,
        after: int = 0,
    ) -> Iterator[trainer_service_pb2.TrainResponse]:
        if script.silent:
            while not ended.wait(0.05):
                pass
            return
        yield _heartbeat(after, "loading")
        if script.heartbeats_only:
            while not ended.wait(script.heartbeat_interval):
                yield _heartbeat(0, "loading")
            return
        count = script.episodes or request.config.max_episodes
        source = (
            scripted_episodes(request.task, request.config)[:count]
            if script.motion
            else valid_episodes(count, script.detail_every, script.frames, script.joints)
        )
        for ep in source:
            n = ep.episode
            if n <= after:
                continue
            if ended.is_set():
                return
            if script.abort_after is not None and n > script.abort_after:
                self._abort(script, request, context)
            if script.hold_at is not None and n == script.hold_at:
                while not script.release.wait(script.heartbeat_interval):
                    if ended.is_set():
                        return
                    yield _heartbeat(n - 1)
            if script.interval > 0 and n > 1:
                yield from self._wait(script, script.interval, n - 1, ended)
            yield from self._wait_grant(script, request.run_id, n, ended)
            if ended.is_set():
                return
            if script.violate == "end_without_done" and ep.done:
                return
            out = [ep]
            if script.violate not in (None, "end_without_done") and n == script.violate_at:
                assert script.violate is not None
                if script.violate == "done_missing":
                    return  # ends OK without done, mid-run
                out = _break(ep, script.violate)
            for item in out:
                item.produce_time.FromNanoseconds(time.time_ns())
                yield trainer_service_pb2.TrainResponse(episode=item)
                with self._cond:
                    self.sent += 1
                    self._cond.notify_all()
        if script.abort_after is not None and script.abort_after >= count:
            self._abort(script, request, context)

    def _abort(
        self,
        script: Script,
        request: trainer_service_pb2.TrainRequest,
        context: grpc.ServicerContext,
    ) -> None:
        if script.localized is None:
            context.abort(script.abort_code, f"run {request.run_id}: the fake trainer gave up")
        _abort_with(
            context,
            script.abort_code,
            f"run {request.run_id}: provider failed",
            ErrorReason.PROVIDER_FAILED,
            script.localized,
        )


@contextlib.contextmanager
def running_fake(**kwargs: Any) -> Iterator[FakeTrainer]:
    """A started ``FakeTrainer(**kwargs)``; on exit every held script is released, a hung
    ``GetCapabilities`` let go, and the server killed. Every suite's fake trainer comes from
    here (the ``fake`` and ``make_fake`` fixtures of tests/conftest.py use it)."""
    trainer = FakeTrainer(**kwargs)
    trainer.start()
    try:
        yield trainer
    finally:
        for script in trainer.scripts:
            script.release.set()
        trainer.default.release.set()
        trainer.hang_capabilities.clear()
        trainer.kill()

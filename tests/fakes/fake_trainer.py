"""A scripted fake ``TrainerService`` on a real in-process gRPC server (port 0).

Each ``Train`` call follows the next queued ``Script`` (or the default one): stream normally,
slowly, go silent, abort with a ``google.rpc.LocalizedMessage`` or plainly, break one contract
rule, or hold at an episode until the test releases it or kills the server mid-stream; a call
beyond its slots is answered ``RESOURCE_EXHAUSTED`` (``SLOTS_BUSY``). Like the real trainer it
honours grants (``grant_through_episode``, ``Grant``; ``Script.ignore_grants`` turns that off),
answers ``CancelJob``, and takes re-attaches as the real trainer does while the job's stream is
still open (that stream ends ``ABORTED``, the new one goes on after ``attach_after_episode``);
it keeps no detached jobs, so any other re-attach is ``NOT_FOUND``. ``SetHyperparameters``
is recorded and answered OK for a job with an open stream (``NOT_FOUND`` otherwise), or with
``hyperparameters_status`` when a test sets one.
It runs on its own thread pool (sync server), so it
is independent of the event loop of the gateway under test.

This module holds the servicer (its calls, slots, jobs and bookkeeping, and the waits tests
block on) and ``running_fake``. ``Script`` and ``VIOLATIONS`` live in ``tests.fakes.scripts``,
the episode streams in ``tests.fakes.episodes``, the playing of a script on one call in
``tests.fakes.playback``; the names the suites use are re-exported here.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc

from tests.fakes.episodes import scripted_episodes, valid_episodes
from tests.fakes.playback import ScriptPlayer, abort_with
from tests.fakes.scripts import VIOLATIONS, Script
from tests.fakes.waiting import TIMEOUT
from trainer_service.providers.defaults import BY_PROVIDER
from trainwire.reasons import ErrorReason
from trainwire.v1 import trainer_service_pb2, trainer_service_pb2_grpc

__all__ = [
    "VIOLATIONS",
    "FakeTrainer",
    "Script",
    "running_fake",
    "scripted_episodes",
    "valid_episodes",
]


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


class FakeTrainer(ScriptPlayer, trainer_service_pb2_grpc.TrainerServiceServicer):
    """The fake trainer. ``start()`` returns its address; ``push`` queues scripts per call.

    Args:
        slots: Concurrent Train calls it accepts; more get RESOURCE_EXHAUSTED.
        providers: What GetCapabilities reports.
        default: The script for calls with nothing queued.
        gpus: The GPUs GetCapabilities reports (``gpus`` may be changed while it serves).
        provider_defaults: Whether GetCapabilities advertises its providers' defaults (the real
            providers', from their torch-free source); False: a trainer older than them.
    """

    def __init__(
        self,
        slots: int = 4,
        providers: tuple[str, ...] = ("imitation", "grpo"),
        default: Script | None = None,
        gpus: tuple[trainer_service_pb2.Gpu, ...] = (),
        provider_defaults: bool = True,
    ) -> None:
        self.slots = slots
        self.providers = providers
        self.gpus = gpus
        self.provider_defaults = provider_defaults
        self.hang_capabilities = threading.Event()  # set: GetCapabilities hangs
        self.default = default or Script()
        self.scripts: deque[Script] = deque()
        self.requests: list[trainer_service_pb2.TrainRequest] = []
        self.grants: dict[str, int] = {}  # run id -> grant of its live call (0: none)
        # Every CancelJob call's run, found or not: a stop cancels the stream and then the job,
        # and where the real trainer keeps the job detached in between, this fake ends it with
        # its stream, so which of the two arrives first is only a matter of timing here.
        self.jobs_cancelled: list[str] = []
        self._ended_by_run: dict[str, threading.Event] = {}
        # run id -> (its script, its first request, the event of the call that streams it)
        self._jobs: dict[str, tuple[Script, trainer_service_pb2.TrainRequest, _Ended]] = {}
        #: Every SetHyperparameters request, in order.
        self.hyperparameter_requests: list[trainer_service_pb2.SetHyperparametersRequest] = []
        #: What SetHyperparameters answers when set (a refusal scripted by the test).
        self.hyperparameters_status: grpc.Status | None = None
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

    def wait_sent(self, count: int, timeout: float = TIMEOUT) -> None:
        """Blocks until ``count`` episodes have been sent in total."""
        with self._cond:
            if not self._cond.wait_for(lambda: self.sent >= count, timeout):
                raise TimeoutError(f"only {self.sent} of {count} episodes sent")

    def wait_idle(self, timeout: float = TIMEOUT) -> None:
        """Blocks until no Train call is running."""
        with self._cond:
            if not self._cond.wait_for(lambda: self.active == 0, timeout):
                raise TimeoutError(f"{self.active} Train calls still running")

    # -- TrainerService ----------------------------------------------------------------------

    def Grant(
        self, request: trainer_service_pb2.GrantRequest, context: grpc.ServicerContext
    ) -> trainer_service_pb2.GrantResponse:
        with self._cond:
            if request.run_id not in self.grants:
                abort_with(
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
            abort_with(context, grpc.StatusCode.NOT_FOUND, "no such job", ErrorReason.JOB_NOT_FOUND)
        ended.set()
        return trainer_service_pb2.CancelJobResponse()

    def SetHyperparameters(
        self,
        request: trainer_service_pb2.SetHyperparametersRequest,
        context: grpc.ServicerContext,
    ) -> trainer_service_pb2.SetHyperparametersResponse:
        with self._cond:
            self.hyperparameter_requests.append(request)
            live = request.run_id in self._jobs
            status = self.hyperparameters_status
        if status is not None:
            context.abort_with_status(status)
        if not live:
            abort_with(context, grpc.StatusCode.NOT_FOUND, "no such job", ErrorReason.JOB_NOT_FOUND)
        response = trainer_service_pb2.SetHyperparametersResponse()
        for name in ("learning_rate", "temperature", "beta"):
            if request.HasField(name):
                setattr(response, name, getattr(request, name))
        return response

    def GetCapabilities(
        self, request: trainer_service_pb2.GetCapabilitiesRequest, context: grpc.ServicerContext
    ) -> trainer_service_pb2.GetCapabilitiesResponse:
        with self._cond:
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
            gpus=list(self.gpus),
            provider_defaults={
                kind: make()
                for kind, make in BY_PROVIDER.items()
                if kind in self.providers and self.provider_defaults
            },
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
            if not full:
                self.active += 1
            self._cond.notify_all()
        if full:
            abort_with(
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
            abort_with(context, grpc.StatusCode.NOT_FOUND, "no such job", ErrorReason.JOB_NOT_FOUND)
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

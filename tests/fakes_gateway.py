"""A scripted, in-memory fake ``GatewayService`` for client and CLI tests.

It speaks the real contract over a real ``grpc.aio`` server on port 0: runs with a state machine,
request-id idempotency, paging, ``google.rpc.BadRequest`` details (from
``trainwire.contract.check_create_run``), history replay in batches, ``caught_up``, keepalives and
``finished``. Runs publish deterministic episodes (imitation runs carry a motion that converges on
the target clip) on their own at ``publish_interval`` seconds per episode, or only when a test
calls ``publish``.

It can misbehave on purpose (``WatchFault``): abort a watch stream with ``UNAVAILABLE`` after N
episodes, hang silently, or close without ``finished``, so the client's resume logic is proven
against a real transport.

``ThreadedServer`` runs any aio server factory on a private event loop in a background thread,
so synchronous clients (``GatewayClient``, the CLI) can call it from the test thread;
``serve_in_thread(fake)`` does so for this fake. To run a CLI test against the real gateway, give
``ThreadedServer`` a factory around ``gateway.server.build_server`` instead, e.g.::

    async def start_real() -> tuple[grpc.aio.Server, int]:
        server, port = build_server(config, core)  # port 0 in the config
        await server.start()
        return server, port

    with ThreadedServer(start_real) as served:
        assert main(["--gateway", served.target, "runs", "list"]) == 0

or, with the whole ``gateway.server.Gateway`` (store and core included)::

    gateway = Gateway(GatewayConfig(port=0, db=":memory:", trainers=(trainer_address,)))

    async def start() -> tuple[grpc.aio.Server, int]:
        port = await gateway.start()
        assert gateway.server is not None
        return gateway.server, port

    with ThreadedServer(start, gateway.stop) as served:
        ...
"""

from __future__ import annotations

import asyncio
import math
import threading
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
from google.protobuf import any_pb2, timestamp_pb2
from google.rpc import code_pb2, status_pb2
from grpc_status import rpc_status

from trainwire import contract, motion
from trainwire.v1 import episode_pb2, gateway_service_pb2, gateway_service_pb2_grpc

Run = gateway_service_pb2.Run
State = Run.State
T = TypeVar("T")

_TERMINAL = {State.STATE_DONE, State.STATE_STOPPED, State.STATE_ERROR}


@dataclass
class WatchFault:
    """Misbehaviour of one watch stream (the n-th ``WatchRun`` call, 0-based).

    Attributes:
        connection: Which ``WatchRun`` call (0 = the first) misbehaves.
        after: Episodes sent on that stream before the fault.
        action: ``unavailable`` (abort UNAVAILABLE), ``hang`` (send nothing more, never close),
            ``close`` (end the stream OK without ``finished``) or ``not_found``.
    """

    connection: int
    after: int
    action: str = "unavailable"


def _now() -> timestamp_pb2.Timestamp:
    stamp = timestamp_pb2.Timestamp()
    stamp.GetCurrentTime()
    return stamp


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


def _abort_details(code: grpc.StatusCode, message: str, *details: Any) -> grpc.Status:
    status = status_pb2.Status(code=getattr(code_pb2, code.name), message=message)
    for detail in details:
        packed = any_pb2.Any()
        packed.Pack(detail)
        status.details.append(packed)
    return rpc_status.to_status(status)


@dataclass
class FakeRun:
    """One run of the fake: its ``Run`` message, full script and published history."""

    run: gateway_service_pb2.Run
    script: list[episode_pb2.Episode]
    published: list[episode_pb2.Episode] = field(default_factory=list)
    fail_at: int | None = None


class FakeGateway(gateway_service_pb2_grpc.GatewayServiceServicer):
    """The fake servicer and its state. Mutate it only on its loop (``ThreadedServer.call``).

    Args:
        publish_interval: Seconds between auto-published episodes (divided by the run's speed);
            ``None`` publishes only on ``publish``; 0 publishes a run's whole script at creation.
        keepalive_interval: Seconds of silence on a watch stream before a keepalive.
        batch_size: Replayed history goes out in batches of this many episodes (0: one by one).
        faults: Watch streams that misbehave.
        fail_at: Runs fail (STATE_ERROR, ``error_message``) instead of publishing this episode.
        error_message: The failed runs' message.
    """

    def __init__(
        self,
        *,
        publish_interval: float | None = 0.0,
        keepalive_interval: float = 0.5,
        batch_size: int = 0,
        faults: list[WatchFault] | None = None,
        fail_at: int | None = None,
        error_message: str = "The training service stopped responding.",
    ) -> None:
        self.publish_interval = publish_interval
        self.keepalive_interval = keepalive_interval
        self.batch_size = batch_size
        self.faults = list(faults or [])
        self.fail_at = fail_at
        self.error_message = error_message
        self.runs: dict[str, FakeRun] = {}
        self.order: list[str] = []
        self.by_request_id: dict[str, str] = {}
        self.watch_requests: list[gateway_service_pb2.WatchRunRequest] = []
        self.calls: list[str] = []
        self.active_watchers = 0
        self._changed: asyncio.Condition | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._next_id = 1

    @property
    def changed(self) -> asyncio.Condition:
        # Created lazily so it binds to the server's loop, not the constructing thread's.
        if self._changed is None:
            self._changed = asyncio.Condition()
        return self._changed

    async def _notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    # -- helpers --------------------------------------------------------------------------------

    async def _find(self, run_id: str, context: grpc.aio.ServicerContext) -> FakeRun:
        if not run_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "run_id: required")
        fake = self.runs.get(run_id)
        if fake is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"run {run_id} not found")
        assert fake is not None
        return fake

    async def _finish(self, fake: FakeRun, state: int, message: str = "") -> None:
        fake.run.state = state  # type: ignore[assignment]
        fake.run.error_message = message
        fake.run.end_time.CopyFrom(_now())
        await self._notify()

    async def publish(self, run_id: str, count: int = 1) -> None:
        """Publishes the run's next ``count`` episodes (or fails it at ``fail_at``)."""
        fake = self.runs[run_id]
        for _ in range(count):
            if fake.run.state in _TERMINAL:
                return
            n = len(fake.published) + 1
            if fake.fail_at is not None and n >= fake.fail_at:
                await self._finish(fake, State.STATE_ERROR, self.error_message)
                return
            episode = fake.script[n - 1]
            fake.published.append(episode)
            fake.run.episode = n
            fake.run.reward = episode.reward
            fake.run.best_reward = episode.best_reward
            if episode.done:
                await self._finish(fake, State.STATE_DONE)
        await self._notify()

    async def _auto_publish(self, run_id: str) -> None:
        fake = self.runs[run_id]
        assert self.publish_interval is not None
        while fake.run.state not in _TERMINAL:
            if fake.run.state == State.STATE_PAUSED:
                async with self.changed:
                    await self.changed.wait_for(lambda: fake.run.state != State.STATE_PAUSED)
                continue
            await asyncio.sleep(self.publish_interval / max(fake.run.speed, 0.1))
            if fake.run.state == State.STATE_RUNNING:
                await self.publish(run_id)

    # -- unary RPCs -----------------------------------------------------------------------------

    async def CreateRun(
        self, request: gateway_service_pb2.CreateRunRequest, context: grpc.aio.ServicerContext
    ) -> gateway_service_pb2.CreateRunResponse:
        """Creates a run; validates it with the shared contract checks."""
        self.calls.append("CreateRun")
        if request.request_id and request.request_id in self.by_request_id:
            existing = self.runs[self.by_request_id[request.request_id]]
            return gateway_service_pb2.CreateRunResponse(run=existing.run)
        violations = contract.check_create_run(request)
        if violations:
            await context.abort_with_status(
                _abort_details(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "invalid run: " + contract.describe_violations(violations),
                    contract.bad_request(violations),
                )
            )
        run_id = f"r-{self._next_id}"
        self._next_id += 1
        run = Run(
            id=run_id,
            state=State.STATE_RUNNING,
            speed=min(20.0, max(0.1, request.speed or 1.0)),
            episodes_per_second=request.episodes_per_second or 10.0,
            task=request.task,
            config=request.config,
            create_time=_now(),
            start_time=_now(),
            display_name=request.display_name,
            request_id=request.request_id,
            trainer="fake-trainer:0",
        )
        fake = FakeRun(run, scripted_episodes(request.task, request.config), fail_at=self.fail_at)
        self.runs[run_id] = fake
        self.order.append(run_id)
        if request.request_id:
            self.by_request_id[request.request_id] = run_id
        if self.publish_interval == 0:
            await self.publish(run_id, len(fake.script))
        elif self.publish_interval is not None:
            task = asyncio.get_running_loop().create_task(self._auto_publish(run_id))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return gateway_service_pb2.CreateRunResponse(run=fake.run)

    async def GetRun(
        self, request: gateway_service_pb2.GetRunRequest, context: grpc.aio.ServicerContext
    ) -> gateway_service_pb2.GetRunResponse:
        """Returns one run."""
        self.calls.append("GetRun")
        fake = await self._find(request.run_id, context)
        return gateway_service_pb2.GetRunResponse(run=fake.run)

    async def ListRuns(
        self, request: gateway_service_pb2.ListRunsRequest, context: grpc.aio.ServicerContext
    ) -> gateway_service_pb2.ListRunsResponse:
        """Lists runs, newest first; the page token is an offset."""
        self.calls.append("ListRuns")
        size = request.page_size or 50
        if not 0 <= request.page_size <= 1000:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"page_size: {request.page_size}; need 0..1000"
            )
        try:
            offset = int(request.page_token or "0")
        except ValueError:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "page_token: not a token")
        runs = [self.runs[i].run for i in reversed(self.order)]
        if request.state:
            runs = [r for r in runs if r.state == request.state]
        page = runs[offset : offset + size]
        token = str(offset + size) if offset + size < len(runs) else ""
        return gateway_service_pb2.ListRunsResponse(runs=page, next_page_token=token)

    async def _control(self, name: str, run_id: str, context: grpc.aio.ServicerContext) -> FakeRun:
        self.calls.append(name)
        fake = await self._find(run_id, context)
        if fake.run.state in _TERMINAL:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"run {run_id} is {contract_state(fake.run.state)}; it cannot be changed",
            )
        return fake

    async def PauseRun(
        self, request: gateway_service_pb2.PauseRunRequest, context: grpc.aio.ServicerContext
    ) -> gateway_service_pb2.PauseRunResponse:
        """Pauses a run."""
        fake = await self._control("PauseRun", request.run_id, context)
        fake.run.state = State.STATE_PAUSED
        await self._notify()
        return gateway_service_pb2.PauseRunResponse(run=fake.run)

    async def ResumeRun(
        self, request: gateway_service_pb2.ResumeRunRequest, context: grpc.aio.ServicerContext
    ) -> gateway_service_pb2.ResumeRunResponse:
        """Resumes a run."""
        fake = await self._control("ResumeRun", request.run_id, context)
        fake.run.state = State.STATE_RUNNING
        await self._notify()
        return gateway_service_pb2.ResumeRunResponse(run=fake.run)

    async def StopRun(
        self, request: gateway_service_pb2.StopRunRequest, context: grpc.aio.ServicerContext
    ) -> gateway_service_pb2.StopRunResponse:
        """Stops a run."""
        fake = await self._control("StopRun", request.run_id, context)
        await self._finish(fake, State.STATE_STOPPED)
        return gateway_service_pb2.StopRunResponse(run=fake.run)

    async def SetRunSpeed(
        self, request: gateway_service_pb2.SetRunSpeedRequest, context: grpc.aio.ServicerContext
    ) -> gateway_service_pb2.SetRunSpeedResponse:
        """Sets a run's speed, clamped to 0.1..20."""
        if not math.isfinite(request.speed):
            await context.abort_with_status(
                _abort_details(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"run {request.run_id}: speed {request.speed} is not finite",
                    contract.bad_request(
                        [contract.FieldViolation("speed", f"{request.speed}; need a finite value")]
                    ),
                )
            )
        fake = await self._control("SetRunSpeed", request.run_id, context)
        fake.run.speed = min(20.0, max(0.1, request.speed))
        await self._notify()
        return gateway_service_pb2.SetRunSpeedResponse(run=fake.run)

    async def DeleteRun(
        self, request: gateway_service_pb2.DeleteRunRequest, context: grpc.aio.ServicerContext
    ) -> gateway_service_pb2.DeleteRunResponse:
        """Deletes a finished run."""
        self.calls.append("DeleteRun")
        fake = await self._find(request.run_id, context)
        if fake.run.state not in _TERMINAL:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"run {request.run_id} is still {contract_state(fake.run.state)}; stop it first",
            )
        del self.runs[request.run_id]
        self.order.remove(request.run_id)
        await self._notify()
        return gateway_service_pb2.DeleteRunResponse(run=fake.run)

    # -- streaming ------------------------------------------------------------------------------

    async def WatchRun(
        self, request: gateway_service_pb2.WatchRunRequest, context: grpc.aio.ServicerContext
    ) -> Any:
        """Replays the history after after_episode, then follows the run live."""
        connection = len(self.watch_requests)
        seen = gateway_service_pb2.WatchRunRequest()
        seen.CopyFrom(request)
        self.watch_requests.append(seen)
        fake = await self._find(request.run_id, context)
        if request.after_episode < 0:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"run {request.run_id}: after_episode {request.after_episode} is negative",
            )
        fault = next((f for f in self.faults if f.connection == connection), None)
        sent = 0
        position = request.after_episode
        self.active_watchers += 1
        await self._notify()
        try:

            async def fault_due() -> bool:
                if fault is None or sent < fault.after:
                    return False
                if fault.action == "unavailable":
                    await context.abort(
                        grpc.StatusCode.UNAVAILABLE,
                        f"run {request.run_id}: the gateway is shutting down",
                    )
                elif fault.action == "not_found":
                    await context.abort(
                        grpc.StatusCode.NOT_FOUND, f"run {request.run_id} not found"
                    )
                elif fault.action == "hang":
                    await asyncio.Event().wait()  # until the client cancels
                return True  # "close"

            # Replay the history that exists at attach time, batched if asked.
            history = list(fake.published[position:])
            index = 0
            while index < len(history):
                if await fault_due():
                    return
                size = self.batch_size or 1
                if fault is not None:  # end the chunk exactly where the fault strikes
                    size = min(size, fault.after - sent)
                chunk = history[index : index + size]
                index += len(chunk)
                if not self.batch_size:
                    yield gateway_service_pb2.WatchRunResponse(episode=chunk[0])
                else:
                    yield gateway_service_pb2.WatchRunResponse(
                        batch=gateway_service_pb2.EpisodeBatch(episodes=chunk)
                    )
                sent += len(chunk)
                position += len(chunk)
                if await fault_due():
                    return
            yield gateway_service_pb2.WatchRunResponse(
                caught_up=gateway_service_pb2.CaughtUp(last_episode=position)
            )
            # Follow live.
            while True:
                if request.run_id not in self.runs:
                    await context.abort(
                        grpc.StatusCode.NOT_FOUND, f"run {request.run_id} was deleted"
                    )
                if position < len(fake.published):
                    position += 1
                    yield gateway_service_pb2.WatchRunResponse(episode=fake.published[position - 1])
                    sent += 1
                    if await fault_due():
                        return
                    continue
                if fake.run.state in _TERMINAL:
                    yield gateway_service_pb2.WatchRunResponse(finished=fake.run)
                    return

                def moved(seen: int = position) -> bool:
                    return (
                        len(fake.published) > seen
                        or fake.run.state in _TERMINAL
                        or request.run_id not in self.runs
                    )

                try:
                    async with self.changed:
                        await asyncio.wait_for(
                            self.changed.wait_for(moved), self.keepalive_interval
                        )
                except TimeoutError:
                    yield gateway_service_pb2.WatchRunResponse(
                        keepalive=gateway_service_pb2.Keepalive(
                            last_episode=position, state=fake.run.state, time=_now()
                        )
                    )
        finally:
            self.active_watchers -= 1
            # Cancelled streams cannot await here; notify waiters from a task of its own.
            notify = asyncio.get_running_loop().create_task(self._notify())
            self._tasks.add(notify)
            notify.add_done_callback(self._tasks.discard)


class RecordingChannel(grpc.Channel):
    """A channel that records every call's method and timeout, then passes it on.

    Proves that every call carries a deadline. (``grpc.intercept_channel`` cannot wrap a
    grpc_testing channel: it passes ``wait_for_ready``, which grpc_testing does not take.)
    """

    def __init__(self, inner: grpc.Channel) -> None:
        self.inner = inner
        self.calls: list[tuple[str, float | None]] = []

    def _wrap(self, method: str, callable_: Any) -> Any:
        def call(request: Any, timeout: float | None = None, **kwargs: Any) -> Any:
            self.calls.append((method, timeout))
            return callable_(request, timeout=timeout, **kwargs)

        return call

    def unary_unary(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self._wrap(method, self.inner.unary_unary(method, *args, **kwargs))

    def unary_stream(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self._wrap(method, self.inner.unary_stream(method, *args, **kwargs))

    def stream_unary(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def stream_stream(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def subscribe(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError

    def unsubscribe(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self.inner.close()


def contract_state(state: int) -> str:
    """``STATE_DONE`` -> ``done``."""
    return Run.State.Name(state).removeprefix("STATE_").lower()  # type: ignore[arg-type]


async def start_fake_gateway(fake: FakeGateway) -> tuple[grpc.aio.Server, int]:
    """Starts an aio server for ``fake`` on 127.0.0.1, port 0; returns it and its port."""
    server = grpc.aio.server()
    gateway_service_pb2_grpc.add_GatewayServiceServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


class ThreadedServer:
    """Runs an aio server on a private event loop in a daemon thread.

    Args:
        start: A coroutine factory returning ``(server, port)``, run on the private loop
            (``start_fake_gateway``, or one wrapping the real ``gateway.server.build_server``).
        stop: A coroutine factory run on exit instead of ``server.stop(None)`` (e.g. the real
            ``Gateway.stop``, which also shuts its core down).
    """

    def __init__(
        self,
        start: Callable[[], Awaitable[tuple[grpc.aio.Server, int]]],
        stop: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self._start = start
        self._stop = stop
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.server: grpc.aio.Server | None = None
        self.port = 0

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 10.0) -> T:
        """Runs a coroutine on the server's loop and returns its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def __enter__(self) -> ThreadedServer:
        self._thread.start()

        async def start() -> tuple[grpc.aio.Server, int]:
            return await self._start()

        self.server, self.port = self.call(start())
        return self

    def __exit__(self, *exc_info: object) -> None:
        server = self.server
        if self._stop is not None:
            stop = self._stop

            async def custom_stop() -> None:
                await stop()

            self.call(custom_stop())
        elif server is not None:
            self.call(server.stop(grace=None))

        async def cancel_pending() -> None:
            current = asyncio.current_task()
            for task in asyncio.all_tasks():
                if task is not current:
                    task.cancel()

        self.call(cancel_pending())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


@contextmanager
def serve_in_thread(fake: FakeGateway) -> Iterator[ThreadedServer]:
    """Serves ``fake`` on port 0 in a background thread for the duration of the block."""
    with ThreadedServer(lambda: start_fake_gateway(fake)) as served:
        yield served


def wait_until(served: ThreadedServer, fake: FakeGateway, predicate: Callable[[], bool]) -> None:
    """Blocks the calling thread until ``predicate`` (evaluated on the server's loop) holds."""

    async def waiter() -> None:
        async with fake.changed:
            await fake.changed.wait_for(predicate)

    served.call(waiter())


__all__ = [
    "FakeGateway",
    "FakeRun",
    "RecordingChannel",
    "ThreadedServer",
    "WatchFault",
    "scripted_episodes",
    "scripted_reward",
    "serve_in_thread",
    "start_fake_gateway",
    "wait_until",
]

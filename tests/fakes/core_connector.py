"""A ``TrainerConnector`` over real in-process trainer cores: the gateway's own gRPC connector
(``gateway.trainer_client.GrpcTrainerConnector``) and the trainer's own servicer
(``trainer_service.servicer.TrainerServicer``) over ``trainer_service.core.jobs.JobRunner`` s,
with only the transport replaced.

``CoreConnector`` keeps a ``JobRunner`` per address. Each call goes through the servicer's
handler with a ``_Context`` that records the status it applies, and comes back through the
connector's own conversion (``classify``, ``stream_event``, ``hyperparameters_error``...) as a
``grpc.aio.AioRpcError`` of that status would: every request and response is serialized and
parsed on the way, as on the wire. A ``Train`` call's handler runs in a task of its own that
writes what it yields into the call's buffer, as a gRPC server writes into its transport
whether or not the client reads yet; ``cancel`` cancels that task (the handler's ``finally``
detaches the job, as on a real cancellation).

``CoreProvider`` is the provider the runners run (as ``imitation``; ``CoreGrpoProvider`` as
``grpo``): no torch, one episode per
pull with the deterministic rewards of ``tests.fakes.episodes.reward_of``, the live
hyperparameters it trains with as metrics, and checkpoints (a state file of its episode) as the
real providers write them: when due, and a final one when asked to stop with one.

What this leaves out: merged downloads (``MergeCheckpoint``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import pathlib
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Sequence
from typing import Any

import grpc
from google.protobuf.message import Message

from gateway.trainer_client import GrpcTrainerConnector
from tests.fakes.episodes import reward_of
from trainer_service.core.jobs import JobRunner, RunnerSettings
from trainer_service.core.provider import (
    CheckpointUnusable,
    EpisodeCounter,
    ProviderError,
    TrainJob,
)
from trainer_service.core.registry import ProviderRegistry
from trainer_service.core.slots import SlotPool
from trainer_service.providers import grpo
from trainer_service.providers.defaults import IMITATION, imitation_proto
from trainer_service.servicer import TrainerServicer
from trainwire.contract import FieldViolation
from trainwire.hyperparameters import Hyperparameters
from trainwire.v1 import episode_pb2, trainer_service_pb2
from trainwire_ops.checkpoints import CheckpointStore


class CoreProvider:
    """A torch-less imitation provider for the real job runner (see the module docstring), with
    the real imitation provider's defaults (from their torch-free source)."""

    DEFAULT_CHECKPOINT_EVERY = IMITATION.checkpoint_every

    def defaults(self) -> trainer_service_pb2.ProviderDefaults:
        return imitation_proto()

    def validate(
        self,
        task: episode_pb2.TrainTask,
        data_roots: Sequence[pathlib.Path],
        reward_modules: Sequence[str] = (),
    ) -> list[FieldViolation]:
        del task, data_roots, reward_modules
        return []

    def hyperparameters(self, task: episode_pb2.TrainTask) -> Hyperparameters:
        return Hyperparameters(
            learning_rate=task.imitation.learning_rate or IMITATION.learning_rate
        )

    def run(self, job: TrainJob) -> Generator[episode_pb2.Episode, None, bool]:
        """Yields the job's episodes; returns whether it trained its last one."""
        counter = EpisodeCounter(job.config.max_episodes, job.resume)
        saved = 0
        if job.resume is not None:
            state = json.loads((job.resume.directory / "state.json").read_text())
            if state != job.resume.episode:
                raise CheckpointUnusable(f"its state says episode {state}")
            saved = job.resume.episode
        values = job.hyperparameters.current.as_dict()

        def save() -> None:
            nonlocal saved
            directory = job.checkpoints.scratch(counter.episode)
            (directory / "state.json").write_text(json.dumps(counter.episode))
            job.checkpoints.commit(counter.episode, counter.best_reward or 0.0, directory)
            saved = counter.episode

        try:
            while not counter.finished:
                if job.stop_event.is_set():
                    return False
                change = job.hyperparameters.take()  # right before the step, as providers do
                if change is not None:
                    values.update(change.as_dict())
                n = counter.next_episode
                episode = counter.make(reward_of(n), {"loss": 1.0 / n, **values})
                if job.checkpoints.due(n):
                    save()
                yield episode
            return True
        finally:
            if job.checkpoints.final_wanted() and counter.episode > saved:
                save()


class _Meeting:
    """Where the ranks of one job that spans trainers meet (what torch.distributed's store is to
    the real GRPO provider): how many processes joined, and how rank 0's share ended."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.joined = 0
        self.ended: bool | None = None  # None: rank 0 runs; True: done; False: stopped short
        self.cond = threading.Condition()

    def join(self, processes: int) -> None:
        with self.cond:
            self.joined += processes
            self.cond.notify_all()

    def end(self, done: bool) -> None:
        with self.cond:
            self.ended = done
            self.cond.notify_all()

    def wait(self, condition: Callable[[], bool], stop: threading.Event) -> bool:
        """Waits until ``condition()`` (True) or ``stop`` is set (False)."""
        with self.cond:
            while not condition():
                if stop.is_set():
                    return False
                self.cond.wait(0.01)
            return True


class CoreGrpoProvider(CoreProvider):
    """``CoreProvider`` as ``grpo``: the real GRPO provider's torch-less rules (the
    hyperparameters a job starts with and the changes it can take, the slots it needs, the
    reward functions it offers), its own episodes. It validates no files.

    A job that spans trainers meets its other shares as the real provider's ranks do: rank 0's
    share binds a rendezvous (announced to its stream) and trains once every process joined;
    another trainer's share joins it, yields nothing, and ends with rank 0's: OK once it
    finished, ``PROCESS_DIED`` when it stopped short. The trainers of one connector share one
    provider, so its ``meetings`` are where they meet.
    """

    DEFAULT_CHECKPOINT_EVERY = grpo.DEFAULT_CHECKPOINT_EVERY

    def __init__(self) -> None:
        self.meetings: dict[str, _Meeting] = {}
        self._lock = threading.Lock()

    def defaults(self) -> trainer_service_pb2.ProviderDefaults:
        return grpo.defaults()

    def hyperparameters(self, task: episode_pb2.TrainTask) -> Hyperparameters:
        return grpo.hyperparameters(task)

    def check_hyperparameters(
        self, task: episode_pb2.TrainTask, change: Hyperparameters
    ) -> list[FieldViolation]:
        return grpo.check_hyperparameters(task, change)

    def slots_needed(self, task: episode_pb2.TrainTask) -> int:
        return grpo.slots_needed(task)

    def reward_functions(self, reward_modules: Sequence[str] = ()) -> tuple[str, ...]:
        return grpo.reward_functions(reward_modules)

    def run(self, job: TrainJob) -> Generator[episode_pb2.Episode, None, bool]:
        placement = job.placement
        if placement is None:
            return (yield from super().run(job))
        if placement.hosts_rendezvous:
            return (yield from self._run_rank_0(job, placement.world_size, placement.processes))
        return self._run_share(job, placement.rendezvous, placement.processes)

    def _run_rank_0(
        self, job: TrainJob, world_size: int, processes: int
    ) -> Generator[episode_pb2.Episode, None, bool]:
        meeting = _Meeting(world_size)
        with self._lock:
            address = f"{job.rendezvous_host}:{29500 + len(self.meetings)}"
            self.meetings[address] = meeting
        meeting.join(processes)
        job.announce_rendezvous(address)
        done = False
        try:
            if not meeting.wait(lambda: meeting.joined >= world_size, job.stop_event):
                return False
            done = yield from super().run(job)
            return done
        finally:
            meeting.end(done)

    def _run_share(self, job: TrainJob, rendezvous: str, processes: int) -> bool:
        with self._lock:
            meeting = self.meetings.get(rendezvous)
        if meeting is None or meeting.ended is not None:
            raise ProviderError(
                "A process of the training job stopped.",
                detail=f"no rendezvous at {rendezvous}",
                code="UNAVAILABLE",
                reason="PROCESS_DIED",
            )
        meeting.join(processes)
        if not meeting.wait(lambda: meeting.ended is not None, job.stop_event):
            return False
        if not meeting.ended:
            raise ProviderError(
                "A process of the training job stopped.",
                detail=f"rank 0 at {rendezvous} stopped short",
                code="ABORTED",
                reason="PROCESS_DIED",
            )
        return True


def make_runner(
    slots: int,
    store: CheckpointStore,
    scratch: pathlib.Path,
    heartbeat_s: float = 0.05,
    detach_grace_s: float = 30.0,
    grpo_provider: CoreGrpoProvider | None = None,
) -> JobRunner:
    """A job runner of ``CoreProvider`` (as ``imitation``, and ``grpo_provider`` as ``grpo``
    when given) in ``slots`` slots over a shared checkpoint store."""
    return JobRunner(
        ProviderRegistry(
            {"imitation": CoreProvider(), "grpo": grpo_provider}
            if grpo_provider is not None
            else {"imitation": CoreProvider()}
        ),
        SlotPool(slots),
        RunnerSettings(heartbeat_s=heartbeat_s, detach_grace_s=detach_grace_s, scratch_dir=scratch),
        checkpoint_store=store,
    )


# -- the transport -----------------------------------------------------------------------------


def _wire(message: Message) -> Any:
    """``message`` as the other side parses it."""
    return type(message).FromString(message.SerializeToString())


class _Context:
    """What a handler of ``TrainerServicer`` uses of its ``grpc.aio.ServicerContext``: the
    status it applies (``trainwire_ops.rich_status.apply``) and the call's deadline."""

    def __init__(self, timeout: float | None) -> None:
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._deadline = None if timeout is None else loop.time() + timeout
        self.code = grpc.StatusCode.OK
        self.details = ""
        self.trailing: tuple[tuple[str, str | bytes], ...] = ()

    def set_code(self, code: grpc.StatusCode) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details

    def set_trailing_metadata(self, metadata: Sequence[tuple[str, str | bytes]]) -> None:
        self.trailing = tuple(metadata)

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - self._loop.time())

    def error(self) -> grpc.aio.AioRpcError | None:
        """The status the handler applied, as the client's call raises it (None: OK)."""
        if self.code == grpc.StatusCode.OK:
            return None
        return rpc_error(self.code, self.details, self.trailing)


def rpc_error(
    code: grpc.StatusCode, details: str, trailing: Sequence[tuple[str, str | bytes]] = ()
) -> grpc.aio.AioRpcError:
    """What a client's call raises for a status."""
    return grpc.aio.AioRpcError(
        code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailing), details=details
    )


class _End:
    """The end of a call's buffer: its status (None: OK)."""

    def __init__(self, error: grpc.aio.AioRpcError | None) -> None:
        self.error = error


class _StreamCall:
    """One ``Train`` call: what the connector's ``_GrpcTrainerStream`` uses of a
    ``grpc.aio.UnaryStreamCall`` (``read``, ``code``, ``cancel``, ``add_done_callback``)."""

    def __init__(
        self, handler: Callable[[Any, _Context], AsyncIterator[Message]], request: Message
    ) -> None:
        self._buffer: asyncio.Queue[Message | _End] = asyncio.Queue()
        self._end: _End | None = None
        self._callbacks: list[Callable[[Any], None]] = []
        self._context = _Context(None)
        self.task = asyncio.get_running_loop().create_task(self._serve(handler, _wire(request)))

    async def _serve(
        self, handler: Callable[[Any, _Context], AsyncIterator[Message]], request: Message
    ) -> None:
        end = _End(rpc_error(grpc.StatusCode.CANCELLED, "Locally cancelled by application!"))
        try:
            async for response in handler(request, self._context):
                self._buffer.put_nowait(_wire(response))
            end = _End(self._context.error())
        except asyncio.CancelledError:
            pass  # the client cancelled: CANCELLED
        except Exception as exc:  # a handler that raises: gRPC answers UNKNOWN
            end = _End(rpc_error(grpc.StatusCode.UNKNOWN, f"Unexpected {exc!r}"))
        self._finish(end)

    def _finish(self, end: _End) -> None:
        if self._end is not None:
            return
        self._end = end
        self._buffer.put_nowait(end)
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback(self)

    async def read(self) -> Any:
        item = await self._buffer.get()
        if isinstance(item, _End):
            self._buffer.put_nowait(item)  # every later read sees the end too
            if item.error is not None:
                raise item.error
            return grpc.aio.EOF
        return item

    async def code(self) -> grpc.StatusCode:
        await asyncio.wait({self.task})
        assert self._end is not None
        return grpc.StatusCode.OK if self._end.error is None else self._end.error.code()

    def cancel(self) -> bool:
        if self._end is not None:
            return False
        self.task.cancel()
        # The client sees the cancellation at once, whatever the handler still does.
        self._finish(
            _End(rpc_error(grpc.StatusCode.CANCELLED, "Locally cancelled by application!"))
        )
        return True

    def done(self) -> bool:
        return self._end is not None

    def add_done_callback(self, callback: Callable[[Any], None]) -> None:
        if self._end is not None:
            callback(self)
        else:
            self._callbacks.append(callback)


class _Stub:
    """A ``TrainerServiceStub`` whose calls run a servicer's handlers in process."""

    def __init__(self, servicer: TrainerServicer | None, address: str, calls: set[_StreamCall]):
        self._servicer = servicer
        self._address = address
        self._calls = calls

    def _unavailable(self) -> grpc.aio.AioRpcError:
        return rpc_error(grpc.StatusCode.UNAVAILABLE, f"failed to connect to {self._address}")

    async def _unary(
        self,
        handler: Callable[[Any, _Context], Awaitable[Message]],
        request: Message,
        timeout: float,
    ) -> Any:
        context = _Context(timeout)
        try:
            async with asyncio.timeout(timeout):
                reply = await handler(_wire(request), context)
        except TimeoutError:
            raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
        error = context.error()
        if error is not None:
            raise error
        return _wire(reply)

    def __getattr__(self, name: str) -> Any:
        if name == "Train":
            return self._train
        if name == "MergeCheckpoint":
            raise NotImplementedError("CoreConnector does not merge checkpoints")

        async def call(request: Message, timeout: float) -> Any:
            if self._servicer is None:
                raise self._unavailable()
            return await self._unary(getattr(self._servicer, name), request, timeout)

        return call

    def _train(self, request: Message) -> _StreamCall:
        if self._servicer is None:
            unavailable = self._unavailable()

            async def refused(request: Any, context: _Context) -> AsyncIterator[Message]:
                context.set_code(unavailable.code())
                context.set_details(unavailable.details() or "")
                return
                yield  # an async generator

            call = _StreamCall(refused, request)
        else:
            call = _StreamCall(self._servicer.Train, request)
        self._calls.add(call)
        call.add_done_callback(lambda _: self._calls.discard(call))
        return call


class CoreConnector(GrpcTrainerConnector):
    """``GrpcTrainerConnector`` over in-process ``JobRunner`` s by address (see the module
    docstring); an address without one is unreachable (``UNAVAILABLE``).

    Args:
        runners: The trainers' cores by address.
    """

    def __init__(self, runners: dict[str, JobRunner] | None = None) -> None:
        super().__init__()
        self.runners: dict[str, JobRunner] = {}
        self._servicers: dict[str, TrainerServicer] = {}
        self._open_calls: set[_StreamCall] = set()
        self._channel = object()  # what ``_open`` counts calls on
        for address, runner in (runners or {}).items():
            self.add(address, runner)

    def add(self, address: str, runner: JobRunner) -> None:
        """Reaches ``runner`` at ``address``."""
        self.runners[address] = runner
        self._servicers[address] = TrainerServicer(runner)

    def _open(self, address: str) -> tuple[Any, Any]:
        self._calls[self._channel] = self._calls.get(self._channel, 0) + 1  # type: ignore[index]
        return self._channel, _Stub(self._servicers.get(address), address, self._open_calls)

    async def close(self) -> None:
        """Cancels every call still open and waits for their handlers to end."""
        calls = list(self._open_calls)
        for call in calls:
            call.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*(call.task for call in calls), return_exceptions=True)

    def shutdown(self, timeout: float) -> None:
        """Shuts every runner down and waits for its job threads (blocking)."""
        for runner in self.runners.values():
            runner.shutdown()
        for address, runner in self.runners.items():
            if not runner.wait_idle(timeout):
                raise AssertionError(f"the jobs of {address} did not stop within {timeout:g} s")

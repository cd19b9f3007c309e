"""GatewayClient.watch over a grpc_testing channel: the test thread plays a scripted gateway,
stream by stream, including streams that break the rules."""

from __future__ import annotations

import math
import queue
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeAlias

import grpc
import grpc_testing
import pytest

from tests.fakes.recording_channel import RecordingChannel
from tests.fakes.waiting import TIMEOUT
from trainwire import client as tc
from trainwire import contract
from trainwire.v1 import episode_pb2, gateway_service_pb2

# A client thread that dies before calling leaves take_unary_stream waiting forever: fail fast.
pytestmark = pytest.mark.timeout(20)

_SERVICE = gateway_service_pb2.DESCRIPTOR.services_by_name["GatewayService"]
_WATCH = _SERVICE.methods_by_name["WatchRun"]
Run: TypeAlias = gateway_service_pb2.Run
Response: TypeAlias = gateway_service_pb2.WatchRunResponse


def _episode(n: int, total: int = 100) -> episode_pb2.Episode:
    return episode_pb2.Episode(episode=n, reward=n / 10, best_reward=n / 10, done=n == total)


def _ep(n: int, total: int = 100) -> Response:
    return Response(episode=_episode(n, total))


def _batch(*numbers: int, total: int = 100) -> Response:
    return Response(
        batch=gateway_service_pb2.EpisodeBatch(episodes=[_episode(n, total) for n in numbers])
    )


def _finished(state: int = Run.State.STATE_DONE) -> Response:
    return Response(finished=Run(id="r-1", state=state))  # type: ignore[arg-type]


def _caught_up(n: int) -> Response:
    return Response(caught_up=gateway_service_pb2.CaughtUp(last_episode=n))


class Scripted:
    """The test's side of the channel: takes each WatchRun call and plays responses into it."""

    def __init__(self, channel: grpc_testing.Channel) -> None:
        self.channel = channel

    def next_stream(self, *responses: Response) -> tuple[gateway_service_pb2.WatchRunRequest, Any]:
        _, request, rpc = self.channel.take_unary_stream(_WATCH)
        for response in responses:
            rpc.send_response(response)
        return request, rpc


@pytest.fixture
def channel() -> grpc_testing.Channel:
    return grpc_testing.channel([_SERVICE], grpc_testing.strict_real_time())


@pytest.fixture
def recorder(channel: grpc_testing.Channel) -> RecordingChannel:
    return RecordingChannel(channel)


@pytest.fixture
def server(channel: grpc_testing.Channel) -> Scripted:
    return Scripted(channel)


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(1) as executor:
        yield executor


def _client(
    recorder: RecordingChannel, max_retries: int = 4, idle_timeout: float | None = None
) -> tc.GatewayClient:
    return tc.GatewayClient(
        channel=recorder,
        retry=tc.RetryPolicy(max_retries=max_retries, initial_backoff=0.0, max_backoff=0.0),
        idle_timeout=idle_timeout,
        stream_timeout=120.0,
    )


class Watcher:
    """Runs ``client.watch`` in the pool, handing each event to the test as it arrives.

    grpc_testing drops responses not yet read when an RPC is terminated with an error, so a test
    waits until the client has an episode before it breaks the stream.
    """

    def __init__(
        self, pool: ThreadPoolExecutor, client: tc.GatewayClient, after: int = 0, **kwargs: Any
    ) -> None:
        self.events: queue.Queue[tc.WatchEvent] = queue.Queue()
        self.reconnects: list[tc.Reconnect] = []
        self.future: Future[list[tc.WatchEvent]] = pool.submit(self._run, client, after, kwargs)

    def _run(
        self, client: tc.GatewayClient, after: int, kwargs: dict[str, Any]
    ) -> list[tc.WatchEvent]:
        seen = []
        for event in client.watch("r-1", after, on_reconnect=self.reconnects.append, **kwargs):
            seen.append(event)
            self.events.put(event)
        return seen

    def wait_for_episode(self, number: int) -> None:
        while True:
            event = self.events.get(timeout=TIMEOUT)
            if isinstance(event, episode_pb2.Episode) and event.episode == number:
                return

    def result(self) -> list[tc.WatchEvent]:
        return self.future.result(timeout=TIMEOUT)


def _numbers(events: list[tc.WatchEvent]) -> list[int]:
    return [e.episode for e in events if isinstance(e, episode_pb2.Episode)]


def test_batches_are_flattened_and_finished_ends_the_iterator(
    recorder: RecordingChannel, server: Scripted, pool: ThreadPoolExecutor
) -> None:
    watcher = Watcher(pool, _client(recorder))
    keepalive = gateway_service_pb2.Keepalive(last_episode=4, state=Run.State.STATE_RUNNING)
    request, rpc = server.next_stream(
        _batch(1, 2, 3, total=5),
        _caught_up(3),
        _ep(4, total=5),
        Response(keepalive=keepalive),
        _ep(5, total=5),
        _finished(),
    )
    events = watcher.result()
    assert (request.run_id, request.after_episode) == ("r-1", 0)
    kinds = [type(e).__name__ for e in events]
    assert kinds == ["Episode"] * 3 + ["CaughtUp", "Episode", "Keepalive", "Episode", "Run"]
    assert _numbers(events) == [1, 2, 3, 4, 5]
    assert events[-1].state == Run.State.STATE_DONE
    assert watcher.reconnects == []
    assert recorder.calls == [("/trainwire.v1.GatewayService/WatchRun", 120.0)]
    rpc.cancelled()  # blocks until the client hangs up, which it does after finished


def test_resumes_after_unavailable_from_the_last_episode_without_duplicates(
    recorder: RecordingChannel, server: Scripted, pool: ThreadPoolExecutor
) -> None:
    watcher = Watcher(pool, _client(recorder))
    _, first = server.next_stream(_ep(1, 4), _caught_up(1), _ep(2, 4))
    watcher.wait_for_episode(2)
    first.terminate((), grpc.StatusCode.UNAVAILABLE, "run r-1: the gateway is shutting down")
    # A sloppy server replays episode 2 again and repeats caught_up: both are dropped.
    second, _ = server.next_stream(_batch(2, 3, total=4), _caught_up(3), _ep(4, 4), _finished())
    events = watcher.result()
    assert second.after_episode == 2
    assert _numbers(events) == [1, 2, 3, 4]
    assert sum(isinstance(e, gateway_service_pb2.CaughtUp) for e in events) == 1
    assert [(r.attempt, r.code, r.after_episode) for r in watcher.reconnects] == [
        (1, grpc.StatusCode.UNAVAILABLE, 2)
    ]
    assert "shutting down" in watcher.reconnects[0].reason
    assert [timeout for _, timeout in recorder.calls] == [120.0, 120.0]


@pytest.mark.parametrize(
    ("code", "details"),
    [
        (grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"),
        (grpc.StatusCode.ABORTED, "aborted"),
        (grpc.StatusCode.INTERNAL, "Received RST_STREAM with error code 2"),
        (grpc.StatusCode.OK, ""),  # closed without finished
    ],
)
def test_other_dropped_streams_resume_too(
    recorder: RecordingChannel,
    server: Scripted,
    pool: ThreadPoolExecutor,
    code: grpc.StatusCode,
    details: str,
) -> None:
    watcher = Watcher(pool, _client(recorder))
    _, first = server.next_stream(_ep(1, 2))
    watcher.wait_for_episode(1)
    first.terminate((), code, details)
    second, _ = server.next_stream(_ep(2, 2), _finished())
    assert _numbers(watcher.result()) == [1, 2]
    assert second.after_episode == 1
    assert len(watcher.reconnects) == 1
    assert watcher.reconnects[0].code == (None if code == grpc.StatusCode.OK else code)


def test_an_idle_stream_is_cancelled_and_resumed(
    recorder: RecordingChannel, server: Scripted, pool: ThreadPoolExecutor
) -> None:
    watcher = Watcher(pool, _client(recorder, idle_timeout=2.0))
    _, first = server.next_stream(_ep(1, 2))  # ...then silence: no keepalive, no close
    second, _ = server.next_stream(_ep(2, 2), _finished())
    assert _numbers(watcher.result()) == [1, 2]
    first.cancelled()  # blocks until the watchdog cancels the silent stream
    assert second.after_episode == 1
    assert watcher.reconnects[0].code is None and "no message" in watcher.reconnects[0].reason


@pytest.mark.parametrize(
    ("code", "cls"),
    [
        (grpc.StatusCode.NOT_FOUND, tc.NotFound),
        (grpc.StatusCode.INVALID_ARGUMENT, tc.InvalidArgument),
        (grpc.StatusCode.INTERNAL, tc.Internal),
        (grpc.StatusCode.CANCELLED, tc.Cancelled),
    ],
)
def test_other_errors_end_the_watch_without_retrying(
    recorder: RecordingChannel,
    server: Scripted,
    pool: ThreadPoolExecutor,
    code: grpc.StatusCode,
    cls: type[tc.TrainwireError],
) -> None:
    watcher = Watcher(pool, _client(recorder))
    _, rpc = server.next_stream(_ep(1))
    watcher.wait_for_episode(1)
    rpc.terminate((), code, "run r-1 was deleted")
    with pytest.raises(cls, match="run r-1 was deleted") as caught:
        watcher.result()
    assert isinstance(caught.value.__cause__, grpc.RpcError)
    assert watcher.reconnects == []
    assert len(recorder.calls) == 1


def test_gives_up_after_max_retries_in_a_row_without_progress(
    recorder: RecordingChannel, server: Scripted, pool: ThreadPoolExecutor
) -> None:
    watcher = Watcher(pool, _client(recorder, max_retries=2))
    for _ in range(3):
        _, rpc = server.next_stream()
        rpc.terminate((), grpc.StatusCode.UNAVAILABLE, "connection refused")
    with pytest.raises(tc.Unavailable, match="connection refused"):
        watcher.result()
    assert [r.attempt for r in watcher.reconnects] == [1, 2]
    assert len(recorder.calls) == 3


def test_progress_resets_the_retry_budget(
    recorder: RecordingChannel, server: Scripted, pool: ThreadPoolExecutor
) -> None:
    watcher = Watcher(pool, _client(recorder, max_retries=1))
    for n in (1, 2, 3):
        request, rpc = server.next_stream(_ep(n, 4))
        assert request.after_episode == n - 1
        watcher.wait_for_episode(n)
        rpc.terminate((), grpc.StatusCode.UNAVAILABLE, "flaky")
    server.next_stream(_ep(4, 4), _finished())
    assert _numbers(watcher.result()) == [1, 2, 3, 4]
    assert [r.attempt for r in watcher.reconnects] == [1, 1, 1]


def test_a_gap_is_data_loss(
    recorder: RecordingChannel, server: Scripted, pool: ThreadPoolExecutor
) -> None:
    watcher = Watcher(pool, _client(recorder))
    _, rpc = server.next_stream(_ep(1), _ep(3))
    with pytest.raises(tc.DataLoss, match="r-1: the watch stream skipped from episode 1 to 3"):
        watcher.result()
    rpc.cancelled()  # blocks until the client cancels


def test_watch_starts_after_the_given_episode(
    recorder: RecordingChannel, server: Scripted, pool: ThreadPoolExecutor
) -> None:
    watcher = Watcher(pool, _client(recorder), after=5)
    request, _ = server.next_stream(_ep(6, 7), _caught_up(6), _ep(7, 7), _finished())
    assert request.after_episode == 5
    assert _numbers(watcher.result()) == [6, 7]


def test_a_checker_vets_each_episode(
    recorder: RecordingChannel, server: Scripted, pool: ThreadPoolExecutor
) -> None:
    checker = contract.StreamChecker("imitation", 3, "r-1")
    watcher = Watcher(pool, _client(recorder), checker=checker)
    bad = episode_pb2.Episode(episode=2, reward=0.5, best_reward=math.inf)
    _, rpc = server.next_stream(_ep(1, 3), Response(episode=bad))
    with pytest.raises(contract.ContractViolation) as caught:
        watcher.result()
    assert (caught.value.rule, caught.value.episode) == ("finite", 2)
    assert checker.last_episode == 1
    rpc.cancelled()  # blocks until the client cancels


def test_closing_the_iterator_cancels_the_stream(
    recorder: RecordingChannel, server: Scripted, pool: ThreadPoolExecutor
) -> None:
    events = _client(recorder).watch("r-1")
    first: Future[tc.WatchEvent] = pool.submit(next, events)
    _, rpc = server.next_stream(_ep(1))
    assert first.result(timeout=TIMEOUT).episode == 1  # type: ignore[union-attr]
    events.close()
    rpc.cancelled()  # blocks until the client cancels


def test_a_negative_start_is_rejected(recorder: RecordingChannel) -> None:
    with pytest.raises(ValueError, match="after_episode"):
        next(_client(recorder).watch("r-1", -1))


def test_cancel_from_another_thread_ends_the_iteration_quietly(
    recorder: RecordingChannel, server: Scripted, pool: ThreadPoolExecutor
) -> None:
    stream = _client(recorder).watch("r-1")
    arrived: queue.Queue[tc.WatchEvent] = queue.Queue()

    def follow() -> list[tc.WatchEvent]:
        seen = []
        for event in stream:
            seen.append(event)
            arrived.put(event)
        return seen

    future = pool.submit(follow)
    _, rpc = server.next_stream(_ep(1), _ep(2))
    while stream.last_episode < 2:
        arrived.get(timeout=TIMEOUT)
    stream.cancel()
    rpc.cancelled()  # blocks until the call is cancelled
    assert _numbers(future.result(timeout=TIMEOUT)) == [1, 2]
    assert stream.cancelled
    assert len(recorder.calls) == 1  # no reconnection after a cancel


def test_a_forks_watch_starts_after_its_fork_episode_and_then_allows_no_gap(
    recorder: RecordingChannel, server: Scripted, pool: ThreadPoolExecutor
) -> None:
    # A fork's history starts after its fork episode: the first episode may skip ahead.
    watcher = Watcher(pool, _client(recorder))
    server.next_stream(_ep(21, 23), _caught_up(21), _ep(22, 23), _ep(23, 23), _finished())
    assert _numbers(watcher.result()) == [21, 22, 23]
    watcher = Watcher(pool, _client(recorder))
    _, rpc = server.next_stream(_ep(21), _ep(23))
    with pytest.raises(tc.DataLoss, match="r-1: the watch stream skipped from episode 21 to 23"):
        watcher.result()
    rpc.cancelled()

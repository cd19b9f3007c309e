"""The clients (``trainwire.client`` and ``trainwire.aio``) against the real gateway (in-memory
store, the wire-level fake trainer behind it): watch resumes across dropped, hung and closed
streams (a ``FaultProxy`` in between) exactly once, and every unary call maps its status to its
typed error. Both clients pass the same watch tests.

These tests also run in fresh venvs at the lowest and highest grpcio/protobuf the client
supports (tests/integration/test_client_versions.py), with the gateway in another process."""

from __future__ import annotations

import asyncio
import math
import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeAlias

import grpc
import pytest

from tests.fakes.live import LiveStack, live_stack
from tests.fakes.waiting import TIMEOUT, until, wait_for
from tests.fakes.watch_faults import WatchFault
from trainwire import aio
from trainwire import client as tc
from trainwire.v1 import episode_pb2, gateway_service_pb2

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]

Run: TypeAlias = gateway_service_pb2.Run
_FAST = tc.RetryPolicy(max_retries=3, initial_backoff=0.01, max_backoff=0.05)
_SETTINGS: dict[str, Any] = {
    "timeout": 10.0,
    "retry": _FAST,
    "stream_timeout": 30.0,
}


@pytest.fixture(scope="module")
def stack() -> Iterator[LiveStack]:
    """One gateway for the module (each test makes its own runs): in the client-version venvs
    it is a subprocess, and starting one per test was most of those tests' time."""
    with live_stack(slots=64) as live:
        yield live


@pytest.fixture
def client(stack: LiveStack) -> Iterator[tc.GatewayClient]:
    with tc.GatewayClient(stack.target, **_SETTINGS) as gw:
        yield gw


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(1) as executor:
        yield executor


def _episodes(events: list[tc.WatchEvent]) -> list[int]:
    return [e.episode for e in events if isinstance(e, episode_pb2.Episode)]


def _create(client: tc.GatewayClient, episodes: int, rate: float = -1.0, clip: str = "wave") -> Run:
    return client.create_run(
        tc.imitation_task(clip=clip), tc.train_config(episodes), episodes_per_second=rate
    )


def _running(client: tc.GatewayClient, run_id: str) -> None:
    """Waits until the run left PENDING (a trainer slot took it)."""
    wait_for(lambda: client.get_run(run_id).state != Run.State.STATE_PENDING, "a slot")


def _finished(client: tc.GatewayClient, run_id: str) -> Run:
    events = list(client.watch(run_id, after_episode=5000))
    final = events[-1]
    assert isinstance(final, Run)
    return final


# -- one watch, sync or asyncio ------------------------------------------------------------------


Watcher: TypeAlias = Callable[..., list[tc.WatchEvent]]


def _sync_watch(
    target: str,
    run_id: str,
    *,
    idle_timeout: float | None = 10.0,
    on_reconnect: Callable[[tc.Reconnect], None] | None = None,
    on_event: Callable[[tc.WatchEvent], None] | None = None,
) -> list[tc.WatchEvent]:
    events: list[tc.WatchEvent] = []
    with tc.GatewayClient(target, idle_timeout=idle_timeout, **_SETTINGS) as gw:
        for event in gw.watch(run_id, on_reconnect=on_reconnect):
            events.append(event)
            if on_event is not None:
                on_event(event)
    return events


def _aio_watch(
    target: str,
    run_id: str,
    *,
    idle_timeout: float | None = 10.0,
    on_reconnect: Callable[[tc.Reconnect], None] | None = None,
    on_event: Callable[[tc.WatchEvent], None] | None = None,
) -> list[tc.WatchEvent]:
    async def follow() -> list[tc.WatchEvent]:
        events: list[tc.WatchEvent] = []
        async with aio.GatewayClient(target, idle_timeout=idle_timeout, **_SETTINGS) as gw:
            stream = gw.watch(run_id, on_reconnect=on_reconnect)
            async with stream:
                async for event in stream:
                    events.append(event)
                    if on_event is not None:
                        on_event(event)
        return events

    return asyncio.run(follow())


@pytest.fixture(params=["sync", "aio"])
def watch(request: pytest.FixtureRequest) -> Watcher:
    """Watches a run to its end with the sync or the asyncio client."""
    return _sync_watch if request.param == "sync" else _aio_watch


# -- watch ---------------------------------------------------------------------------------------


def test_replay_resumes_across_drops_exactly_once(
    stack: LiveStack, client: tc.GatewayClient, watch: Watcher
) -> None:
    run = _create(client, 60)
    assert _finished(client, run.id).state == Run.State.STATE_DONE
    # The history comes as one batch: drops mid-batch, three times in a row.
    proxy = stack.proxy(WatchFault(0, 10), WatchFault(1, 3), WatchFault(2, 14))
    reconnects: list[tc.Reconnect] = []
    events = watch(proxy.target, run.id, on_reconnect=reconnects.append)
    assert _episodes(events) == list(range(1, 61))
    assert [r.after_episode for r in proxy.watch_requests] == [0, 10, 13, 27]
    assert [r.after_episode for r in reconnects] == [10, 13, 27]
    assert all(r.code == grpc.StatusCode.UNAVAILABLE for r in reconnects)
    final = events[-1]
    assert isinstance(final, Run) and final.state == Run.State.STATE_DONE
    assert sum(isinstance(e, gateway_service_pb2.CaughtUp) for e in events) == 1


def test_live_follow_resumes_across_drops_exactly_once(
    stack: LiveStack, client: tc.GatewayClient, watch: Watcher
) -> None:
    proxy = stack.proxy(WatchFault(0, 6), WatchFault(1, 9), WatchFault(2, 1))
    run = _create(client, 40, rate=40.0, clip="walk")
    events = watch(proxy.target, run.id)
    assert _episodes(events) == list(range(1, 41))
    assert len(proxy.watch_requests) == 4
    final = events[-1]
    assert isinstance(final, Run) and final.state == Run.State.STATE_DONE


def test_a_hung_stream_is_resumed_after_the_idle_timeout(
    stack: LiveStack, client: tc.GatewayClient, watch: Watcher
) -> None:
    # The proxy forwards nothing more, keepalives included, and never closes.
    proxy = stack.proxy(WatchFault(0, 5, "hang"))
    run = _create(client, 20, clip="jump")
    reconnects: list[tc.Reconnect] = []
    # Seconds, not tenths: on a loaded machine a healthy stream may pause that long.
    events = watch(proxy.target, run.id, idle_timeout=2.0, on_reconnect=reconnects.append)
    assert _episodes(events) == list(range(1, 21))
    assert [(r.code, r.after_episode) for r in reconnects] == [(None, 5)]


def test_a_stream_closed_without_finished_is_resumed(
    stack: LiveStack, client: tc.GatewayClient, watch: Watcher
) -> None:
    proxy = stack.proxy(WatchFault(0, 4, "close"))
    run = _create(client, 9)
    assert _episodes(watch(proxy.target, run.id)) == list(range(1, 10))
    assert [r.after_episode for r in proxy.watch_requests] == [0, 4]


def test_not_found_mid_stream_is_raised_not_retried(
    stack: LiveStack, client: tc.GatewayClient, watch: Watcher
) -> None:
    proxy = stack.proxy(WatchFault(0, 3, "not_found"))
    run = _create(client, 9)
    seen: list[int] = []

    def note(event: tc.WatchEvent) -> None:
        if isinstance(event, episode_pb2.Episode):
            seen.append(event.episode)

    with pytest.raises(tc.NotFound, match=f"run '{run.id}' not found"):
        watch(proxy.target, run.id, on_event=note)
    assert seen == [1, 2, 3]
    assert len(proxy.watch_requests) == 1


def test_keepalives_keep_a_quiet_stream_alive(
    stack: LiveStack, client: tc.GatewayClient, watch: Watcher, pool: ThreadPoolExecutor
) -> None:
    run = _create(client, 30, rate=20.0)
    _running(client, run.id)
    client.pause_run(run.id)  # nothing is published while paused: only keepalives (0.2 s)
    proxy = stack.proxy()
    reconnects: list[tc.Reconnect] = []
    arrived: queue.Queue[tc.WatchEvent] = queue.Queue()
    future = pool.submit(
        watch,
        proxy.target,
        run.id,
        idle_timeout=2.0,
        on_reconnect=reconnects.append,
        on_event=arrived.put,
    )
    keepalives = 0
    while keepalives < 15:  # 3 s of nothing but keepalives: longer than idle_timeout
        if isinstance(arrived.get(timeout=TIMEOUT), gateway_service_pb2.Keepalive):
            keepalives += 1
    client.resume_run(run.id)
    events = future.result(timeout=TIMEOUT)
    assert _episodes(events) == list(range(1, 31))
    assert reconnects == []
    assert len(proxy.watch_requests) == 1


def test_a_stopped_run_ends_the_watch_and_a_deleted_one_is_not_found(
    stack: LiveStack, client: tc.GatewayClient, watch: Watcher, pool: ThreadPoolExecutor
) -> None:
    run = _create(client, 500, rate=2.0)
    proxy = stack.proxy()
    future = pool.submit(watch, proxy.target, run.id)
    wait_for(lambda: proxy.active_watchers == 1, "the watcher")
    client.stop_run(run.id)
    final = future.result(timeout=TIMEOUT)[-1]
    assert isinstance(final, Run) and final.state == Run.State.STATE_STOPPED
    client.delete_run(run.id)
    with pytest.raises(tc.NotFound, match=run.id):
        watch(stack.target, run.id)


def test_leaving_the_iterator_cancels_the_server_stream(
    stack: LiveStack, client: tc.GatewayClient
) -> None:
    run = _create(client, 500, rate=2.0)
    proxy = stack.proxy()
    with tc.GatewayClient(proxy.target, **_SETTINGS) as gw:
        for event in gw.watch(run.id):
            if isinstance(event, gateway_service_pb2.CaughtUp):
                break
        wait_for(lambda: proxy.active_watchers == 0, "the stream's end")
    assert client.get_run(run.id).state == Run.State.STATE_RUNNING

    async def leave_early() -> None:
        async with aio.GatewayClient(proxy.target, **_SETTINGS) as gw:
            async with gw.watch(run.id) as stream:
                async for event in stream:
                    if isinstance(event, gateway_service_pb2.CaughtUp):
                        break
            assert stream.cancelled

    asyncio.run(leave_early())
    wait_for(lambda: proxy.active_watchers == 0, "the aio stream's end")
    assert client.get_run(run.id).state == Run.State.STATE_RUNNING
    assert len(proxy.watch_requests) == 2


def test_cancel_from_another_thread_ends_the_watch_quietly(
    client: tc.GatewayClient,
) -> None:
    run = _create(client, 500, rate=2.0)
    stream = client.watch(run.id)
    seen = threading.Event()
    timer = threading.Timer(0.5, stream.cancel)
    timer.start()
    try:
        for _ in stream:
            seen.set()
    finally:
        timer.cancel()
    assert stream.cancelled and seen.is_set()


# -- unary calls ---------------------------------------------------------------------------------


def test_unary_calls_and_their_errors_over_the_real_gateway(client: tc.GatewayClient) -> None:
    task = tc.imitation_task(clip="wave")
    first = client.create_run(
        task, tc.train_config(500), request_id="req-1", speed=2.0, episodes_per_second=1.0
    )
    again = client.create_run(
        task, tc.train_config(500), request_id="req-1", speed=2.0, episodes_per_second=1.0
    )
    assert again.id == first.id and first.speed == 2.0
    later = [_create(client, 500, rate=1.0).id for _ in range(4)]
    listed = [r.id for r in client.list_runs(page_size=2)]
    mine = [first.id, *later]
    assert [i for i in listed if i in mine] == mine[::-1]  # newest first, across pages
    assert len(client.list_runs(page_size=2, limit=3)) == 3

    wait_for(lambda: client.get_run(first.id).state == Run.State.STATE_RUNNING, "RUNNING")
    assert client.pause_run(first.id).state == Run.State.STATE_PAUSED
    paused = client.list_runs(state=Run.State.STATE_PAUSED)
    assert first.id in [r.id for r in paused]
    assert all(r.state == Run.State.STATE_PAUSED for r in paused)
    assert client.resume_run(first.id).state == Run.State.STATE_RUNNING
    assert client.set_run_speed(first.id, 50).speed == 20.0
    with pytest.raises(tc.IllegalTransition, match=f"cannot delete run '{first.id}'") as caught:
        client.delete_run(first.id)
    assert isinstance(caught.value, tc.FailedPrecondition)
    assert caught.value.reason == "ILLEGAL_TRANSITION"
    assert client.stop_run(first.id).state == Run.State.STATE_STOPPED
    with pytest.raises(tc.FailedPrecondition, match=first.id):
        client.pause_run(first.id)
    assert client.delete_run(first.id).id == first.id
    with pytest.raises(tc.RunNotFound, match=f"run '{first.id}' not found") as missing:
        client.get_run(first.id)
    assert missing.value.metadata["run_id"] == first.id

    with pytest.raises(tc.InvalidArgument) as bad:
        client.set_run_speed(later[0], math.nan)
    assert [v.field for v in bad.value.field_violations] == ["speed"]
    with pytest.raises(tc.InvalidRequest) as bad:
        client.create_run(tc.imitation_task(clip="moonwalk", group_size=1), tc.train_config(0))
    assert {v.field for v in bad.value.field_violations} == {
        "task.imitation.clip_name",
        "task.imitation.group_size",
        "config.max_episodes",
    }
    for run_id in later:  # the module's other tests share the gateway and its slots
        client.stop_run(run_id)


def test_the_aio_client_has_the_same_unary_surface(stack: LiveStack) -> None:
    async def scenario() -> None:
        async with aio.GatewayClient(stack.target, **_SETTINGS) as gw:
            run = await gw.create_run(
                tc.imitation_task(), tc.train_config(500), episodes_per_second=1.0
            )
            assert (await gw.get_run(run.id)).id == run.id
            assert run.id in [r.id for r in await gw.list_runs(page_size=1, limit=5)]

            async def placed() -> bool:
                return (await gw.get_run(run.id)).state != Run.State.STATE_PENDING

            await until(placed, "the run placed")
            assert (await gw.pause_run(run.id)).state == Run.State.STATE_PAUSED
            assert (await gw.resume_run(run.id)).state == Run.State.STATE_RUNNING
            assert (await gw.set_run_speed(run.id, 0.01)).speed == 0.1
            assert (await gw.stop_run(run.id)).state == Run.State.STATE_STOPPED
            assert (await gw.delete_run(run.id)).id == run.id
            with pytest.raises(tc.RunNotFound):
                await gw.get_run(run.id)
            with pytest.raises(tc.InvalidRequest) as bad:
                await gw.create_run(tc.imitation_task(clip="moonwalk"), tc.train_config(1))
            assert [v.field for v in bad.value.field_violations] == ["task.imitation.clip_name"]

    asyncio.run(scenario())


def test_an_unreachable_gateway_is_unavailable_in_one_line() -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    target = f"127.0.0.1:{port}"
    with tc.GatewayClient(target, timeout=2.0) as gw, pytest.raises(tc.Unavailable):
        gw.get_run("r1")

    async def aio_call() -> None:
        async with aio.GatewayClient(target, timeout=2.0) as gw:
            await gw.get_run("r1")

    with pytest.raises(tc.Unavailable):
        asyncio.run(aio_call())

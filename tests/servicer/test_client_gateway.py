"""GatewayClient against a real in-process aio GatewayService (tests/fakes_gateway.py) on port 0:
watch resumes over a real transport without duplicates or gaps, and every unary call maps its
status to the right typed error."""

from __future__ import annotations

import math
import queue
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TypeAlias

import grpc
import pytest

from tests.fakes_gateway import FakeGateway, ThreadedServer, WatchFault, serve_in_thread, wait_until
from trainwire import client as tc
from trainwire.v1 import episode_pb2, gateway_service_pb2

pytestmark = pytest.mark.timeout(30)

Run: TypeAlias = gateway_service_pb2.Run
_FAST = tc.RetryPolicy(max_retries=3, initial_backoff=0.01, max_backoff=0.05)


def _client(served: ThreadedServer, idle_timeout: float | None = 10.0) -> tc.GatewayClient:
    return tc.GatewayClient(
        served.target, timeout=5.0, retry=_FAST, idle_timeout=idle_timeout, stream_timeout=30.0
    )


def _episodes(events: list[tc.WatchEvent]) -> list[int]:
    return [e.episode for e in events if isinstance(e, episode_pb2.Episode)]


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(1) as executor:
        yield executor


@pytest.mark.parametrize("batch_size", [0, 7])
def test_replay_resumes_across_drops_exactly_once(batch_size: int) -> None:
    # Drops mid-batch and at batch boundaries, three times in a row.
    faults = [WatchFault(0, 10), WatchFault(1, 3), WatchFault(2, 14)]
    fake = FakeGateway(publish_interval=0.0, batch_size=batch_size, faults=faults)
    with serve_in_thread(fake) as served, _client(served) as client:
        run = client.create_run(tc.imitation_task(clip="wave"), tc.train_config(60))
        reconnects: list[tc.Reconnect] = []
        events = list(client.watch(run.id, on_reconnect=reconnects.append))
    assert _episodes(events) == list(range(1, 61))
    assert [r.after_episode for r in fake.watch_requests] == [0, 10, 13, 27]
    assert [r.after_episode for r in reconnects] == [10, 13, 27]
    assert all(r.code == grpc.StatusCode.UNAVAILABLE for r in reconnects)
    final = events[-1]
    assert isinstance(final, gateway_service_pb2.Run) and final.state == Run.State.STATE_DONE
    assert sum(isinstance(e, gateway_service_pb2.CaughtUp) for e in events) == 1


def test_live_follow_resumes_across_drops_exactly_once() -> None:
    fake = FakeGateway(
        publish_interval=0.004, faults=[WatchFault(0, 6), WatchFault(1, 9), WatchFault(2, 1)]
    )
    with serve_in_thread(fake) as served, _client(served) as client:
        run = client.create_run(tc.imitation_task(clip="walk"), tc.train_config(40))
        events = list(client.watch(run.id))
    assert _episodes(events) == list(range(1, 41))
    assert len(fake.watch_requests) == 4
    assert events[-1].state == Run.State.STATE_DONE  # type: ignore[union-attr]


def test_a_hung_stream_is_resumed_after_the_idle_timeout() -> None:
    fake = FakeGateway(
        publish_interval=0.0, keepalive_interval=10.0, faults=[WatchFault(0, 5, "hang")]
    )
    # Seconds, not tenths: on a loaded machine a healthy stream may pause that long.
    with serve_in_thread(fake) as served, _client(served, idle_timeout=2.0) as client:
        run = client.create_run(tc.imitation_task(clip="jump"), tc.train_config(20))
        reconnects: list[tc.Reconnect] = []
        events = list(client.watch(run.id, on_reconnect=reconnects.append))
    assert _episodes(events) == list(range(1, 21))
    assert [(r.code, r.after_episode) for r in reconnects] == [(None, 5)]


def test_a_stream_closed_without_finished_is_resumed() -> None:
    fake = FakeGateway(publish_interval=0.0, faults=[WatchFault(0, 4, "close")])
    with serve_in_thread(fake) as served, _client(served) as client:
        run = client.create_run(tc.imitation_task(clip="wave"), tc.train_config(9))
        assert _episodes(list(client.watch(run.id))) == list(range(1, 10))
    assert [r.after_episode for r in fake.watch_requests] == [0, 4]


def test_keepalives_keep_a_quiet_stream_alive(pool: ThreadPoolExecutor) -> None:
    fake = FakeGateway(publish_interval=None, keepalive_interval=0.1)
    with serve_in_thread(fake) as served, _client(served, idle_timeout=2.0) as client:
        run = client.create_run(tc.imitation_task(clip="wave"), tc.train_config(3))
        reconnects: list[tc.Reconnect] = []
        arrived: queue.Queue[tc.WatchEvent] = queue.Queue()

        def follow() -> list[tc.WatchEvent]:
            seen = []
            for event in client.watch(run.id, on_reconnect=reconnects.append):
                seen.append(event)
                arrived.put(event)
            return seen

        future = pool.submit(follow)
        keepalives = 0
        while keepalives < 25:  # 2.5 s of silence but for keepalives: longer than idle_timeout
            if isinstance(arrived.get(timeout=5), gateway_service_pb2.Keepalive):
                keepalives += 1
        served.call(fake.publish(run.id, 3))
        events = future.result(timeout=10)
    assert _episodes(events) == [1, 2, 3]
    assert reconnects == []
    assert len(fake.watch_requests) == 1


def test_a_stopped_run_ends_the_watch_and_a_deleted_one_is_not_found(
    pool: ThreadPoolExecutor,
) -> None:
    fake = FakeGateway(publish_interval=None, keepalive_interval=0.05)
    with serve_in_thread(fake) as served, _client(served) as client:
        run = client.create_run(tc.imitation_task(clip="wave"), tc.train_config(5))
        future = pool.submit(lambda: list(client.watch(run.id)))
        wait_until(served, fake, lambda: fake.active_watchers == 1)
        client.stop_run(run.id)
        # The watcher sees the finished run and ends; a second watch then fails on delete.
        assert future.result(timeout=5)[-1].state == Run.State.STATE_STOPPED  # type: ignore[union-attr]
        client.delete_run(run.id)
        with pytest.raises(tc.NotFound, match=run.id):
            list(client.watch(run.id))


def test_not_found_mid_stream_is_raised_not_retried() -> None:
    fake = FakeGateway(publish_interval=0.0, faults=[WatchFault(0, 3, "not_found")])
    with serve_in_thread(fake) as served, _client(served) as client:
        run = client.create_run(tc.imitation_task(clip="wave"), tc.train_config(9))
        seen: list[int] = []
        with pytest.raises(tc.NotFound, match=f"run {run.id} not found"):
            for event in client.watch(run.id):
                if isinstance(event, episode_pb2.Episode):
                    seen.append(event.episode)
    assert seen == [1, 2, 3]
    assert len(fake.watch_requests) == 1


def test_leaving_the_iterator_cancels_the_server_stream() -> None:
    fake = FakeGateway(publish_interval=None, keepalive_interval=0.05)
    with serve_in_thread(fake) as served, _client(served) as client:
        run = client.create_run(tc.imitation_task(clip="wave"), tc.train_config(5))
        served.call(fake.publish(run.id, 2))
        for event in client.watch(run.id):
            if isinstance(event, gateway_service_pb2.CaughtUp):
                break
        wait_until(served, fake, lambda: fake.active_watchers == 0)
        assert client.get_run(run.id).state == Run.State.STATE_RUNNING


# -- unary calls ---------------------------------------------------------------------------------


def test_unary_calls_and_their_errors_over_a_real_server() -> None:
    fake = FakeGateway(publish_interval=None)
    with serve_in_thread(fake) as served, _client(served) as client:
        task = tc.imitation_task(clip="wave")
        first = client.create_run(task, tc.train_config(10), request_id="req-1", speed=2.0)
        again = client.create_run(task, tc.train_config(10), request_id="req-1")
        assert again.id == first.id and first.speed == 2.0
        for _ in range(4):
            client.create_run(task, tc.train_config(10))
        assert [r.id for r in client.list_runs(page_size=2)] == [f"r-{i}" for i in range(5, 0, -1)]
        assert len(client.list_runs(page_size=2, limit=3)) == 3

        assert client.pause_run(first.id).state == Run.State.STATE_PAUSED
        paused = client.list_runs(state=Run.State.STATE_PAUSED)
        assert [r.id for r in paused] == [first.id]
        assert client.resume_run(first.id).state == Run.State.STATE_RUNNING
        assert client.set_run_speed(first.id, 50).speed == 20.0
        with pytest.raises(tc.FailedPrecondition, match=f"run {first.id} is still running"):
            client.delete_run(first.id)
        assert client.stop_run(first.id).state == Run.State.STATE_STOPPED
        with pytest.raises(tc.FailedPrecondition, match=first.id):
            client.pause_run(first.id)
        assert client.delete_run(first.id).id == first.id
        with pytest.raises(tc.NotFound, match=f"run {first.id} not found"):
            client.get_run(first.id)

        with pytest.raises(tc.InvalidArgument) as caught:
            client.set_run_speed("r-2", math.nan)
        assert [v.field for v in caught.value.field_violations] == ["speed"]
        with pytest.raises(tc.InvalidArgument) as caught:
            client.create_run(tc.imitation_task(clip="moonwalk", group_size=1), tc.train_config(0))
        assert {v.field for v in caught.value.field_violations} == {
            "task.imitation.clip_name",
            "task.imitation.group_size",
            "config.max_episodes",
        }

"""Gateway operations: Prometheus metrics scraped over HTTP, and JSON lifecycle logs.

A real gateway on port 0 (metrics on port 0) in front of the scripted fake trainer; the last
test runs ``python -m gateway --log-format json`` as a process and reads its log.
"""

from __future__ import annotations

import asyncio
import json
import pathlib
import re
import signal
import urllib.error
import urllib.request
from collections.abc import AsyncIterator

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.metrics import GatewayMetrics
from tests.fakes.fake_trainer import FakeTrainer, Script
from tests.fakes.gateway_harness import (
    Client,
    WatchResult,
    absorb,
    collect,
    gateway_process,
    published,
    running_gateway,
)
from tests.fakes.waiting import TIMEOUT, until
from trainwire.v1 import gateway_service_pb2 as pb
from trainwire.v1 import gateway_service_pb2_grpc

SERVICE = "trainwire.v1.GatewayService"
STATES = ("PENDING", "RUNNING", "PAUSED", "DONE", "STOPPED", "ERROR")
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def rpc(method: str, code: str | None = None, kind: str = "unary") -> dict[str, str]:
    """Labels of a GatewayService RPC metric."""
    labels = {"grpc_type": kind, "grpc_service": SERVICE, "grpc_method": method}
    if code is not None:
        labels["grpc_code"] = code
    return labels


def _fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=TIMEOUT) as response:
        return response.read().decode()


async def scrape(url: str) -> Samples:
    """Every sample the endpoint serves, by (name, labels)."""
    text = await asyncio.to_thread(_fetch, url)
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def sample(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


@pytest.fixture
async def client(fake: FakeTrainer) -> AsyncIterator[Client]:
    async with running_gateway((fake.address,), metrics_port=0) as c:
        yield c


async def _watch_until_caught_up(
    stub: gateway_service_pb2_grpc.GatewayServiceStub, run_id: str, caught_up: asyncio.Event
) -> WatchResult:
    result = WatchResult()
    call = stub.WatchRun(pb.WatchRunRequest(run_id=run_id), timeout=TIMEOUT)
    async for message in call:
        absorb(result, message)
        if result.caught_up is not None:
            caught_up.set()
    return result


async def test_metrics_over_http_count_runs_episodes_watchers_rpcs_and_violations(
    client: Client, fake: FakeTrainer
) -> None:
    endpoint = client.gateway.metrics_endpoint
    assert endpoint is not None and endpoint.port > 0
    url = endpoint.url
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+/metrics", url)
    total = 30
    fake.push(Script(hold_at=3))  # two episodes, then hold while the watchers are counted
    script = fake.scripts[0]
    run = await client.create(max_episodes=total)
    attached = [asyncio.Event(), asyncio.Event()]
    watches = [
        asyncio.create_task(_watch_until_caught_up(client.stub, run.id, event))
        for event in attached
    ]
    for event in attached:
        await asyncio.wait_for(event.wait(), TIMEOUT)

    during = await scrape(url)
    assert sample(during, "trainwire_gateway_watchers") == 2
    assert sample(during, "trainwire_gateway_runs", state="DONE") == 0
    assert sample(during, "trainwire_gateway_runs_created_total") == 1

    script.release.set()
    results = await asyncio.gather(*watches)
    for result in results:
        assert result.numbers == list(range(1, total + 1))
        assert result.finished is not None and result.finished.state == pb.Run.STATE_DONE
    with pytest.raises(grpc.aio.AioRpcError) as missing:
        await client.stub.GetRun(pb.GetRunRequest(run_id="no-such-run"), timeout=TIMEOUT)
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND

    # A second run whose trainer breaks the contract at episode 3.
    fake.push(Script(violate="sequence", violate_at=3))
    bad = await client.create(max_episodes=10)
    assert (await client.finished(bad.id)).state == pb.Run.STATE_ERROR

    after = await scrape(url)
    runs = {state: sample(after, "trainwire_gateway_runs", state=state) for state in STATES}
    assert runs == {s: (1.0 if s in ("DONE", "ERROR") else 0.0) for s in STATES}
    assert sample(after, "trainwire_gateway_runs_ended_total", state="DONE") == 1
    assert sample(after, "trainwire_gateway_runs_ended_total", state="ERROR") == 1
    assert sample(after, "trainwire_gateway_episodes_published_total") == total + 2
    # The bad run's trainer sent 2 good episodes and the one that broke the rule.
    assert sample(after, "trainwire_gateway_episodes_received_total") == total + 3
    assert sample(after, "trainwire_gateway_episodes_sent_total") == 2 * total
    assert sample(after, "trainwire_gateway_watchers") == 0
    assert sample(after, "trainwire_gateway_contract_violations_total", rule="sequence") == 1
    assert sample(after, "trainwire_gateway_trainer_up", trainer=fake.address) == 1
    assert sample(after, "trainwire_gateway_trainer_slots", trainer=fake.address) == 4
    assert (sample(after, "trainwire_gateway_store_commits_total") or 0) >= 1
    assert (sample(after, "trainwire_gateway_store_operations_total") or 0) >= total + 2

    assert sample(after, "grpc_server_started_total", **rpc("CreateRun")) == 2
    assert sample(after, "grpc_server_handled_total", **rpc("CreateRun", "OK")) == 2
    assert sample(after, "grpc_server_handled_total", **rpc("GetRun", "NOT_FOUND")) == 1
    assert sample(after, "grpc_server_handled_total", **rpc("GetRun", "OK")) is None
    watch = rpc("WatchRun", "OK", "server_stream")
    assert sample(after, "grpc_server_handled_total", **watch) == 3  # two watchers + finished()
    assert sample(after, "grpc_server_handling_seconds_count", **watch) == 3
    assert (sample(after, "grpc_server_handling_seconds_sum", **watch) or 0) > 0
    # Messages: one request per RPC; one response per unary call that succeeded, one per
    # message of a stream (the two watchers' messages, plus finished()'s).
    messages = {k: v for k, v in rpc("CreateRun").items() if k != "grpc_code"}
    assert sample(after, "grpc_server_msg_received_total", **messages) == 2
    assert sample(after, "grpc_server_msg_sent_total", **messages) == 2
    watch_labels = {k: v for k, v in watch.items() if k != "grpc_code"}
    streamed = sum(len(r.kinds) for r in results)
    assert (sample(after, "grpc_server_msg_sent_total", **watch_labels) or 0) > streamed
    # Process and platform collectors; no *_created series.
    assert (sample(after, "process_cpu_seconds_total") or 0) > 0
    assert (sample(after, "process_resident_memory_bytes") or 0) > 0
    names = {name for name, _ in after}
    assert "python_info" in names
    assert not [n for n in names if n.endswith("_created")], "no *_created series"


async def test_cancelled_watch_is_counted_cancelled_and_detached(
    client: Client, fake: FakeTrainer
) -> None:
    fake.push(Script(hold_at=3))
    run = await client.create(max_episodes=10)
    await published(client.stub, run.id, 2)  # cancels its watch after two episodes
    metrics = client.gateway.metrics
    cancelled = rpc("WatchRun", "CANCELLED", "server_stream")
    await until(
        lambda: metrics.value("grpc_server_handled_total", cancelled) == 1, "CANCELLED counted"
    )
    assert metrics.value("trainwire_gateway_watchers") == 0
    assert metrics.value("trainwire_gateway_runs", {"state": "RUNNING"}) == 1
    # A second run comes and goes; the trainer is asked again once it ended and the gauge
    # shows the held run's slot busy.
    other = await client.create(max_episodes=5)
    assert (await client.finished(other.id)).state == pb.Run.STATE_DONE
    trainer = {"trainer": fake.address}
    await until(
        lambda: metrics.value("trainwire_gateway_trainer_slots_busy", trainer) == 1,
        "the trainer probed after the second run ended",
    )
    assert metrics.value("trainwire_gateway_trainer_slots", trainer) == 4
    await client.stub.StopRun(pb.StopRunRequest(run_id=run.id), timeout=TIMEOUT)
    assert metrics.value("trainwire_gateway_runs", {"state": "RUNNING"}) == 0
    assert metrics.value("trainwire_gateway_runs", {"state": "STOPPED"}) == 1
    assert metrics.value("grpc_server_handled_total", rpc("StopRun", "OK")) == 1


async def test_run_gauges_survive_a_restart_and_follow_deletes(
    fake: FakeTrainer, tmp_path: pathlib.Path
) -> None:
    db = str(tmp_path / "gateway.sqlite3")
    async with running_gateway((fake.address,), db=db, metrics_port=0) as first:
        run = await first.create(max_episodes=5)
        assert (await first.finished(run.id)).state == pb.Run.STATE_DONE
        fake.push(Script(hold_at=2))
        held = await first.create(max_episodes=5)
        await published(first.stub, held.id, 1)
        endpoint = first.gateway.metrics_endpoint
        assert endpoint is not None
        url = endpoint.url
    # Stopped with the gateway: nothing listens there any more.
    with pytest.raises(urllib.error.URLError):
        await asyncio.to_thread(_fetch, url)

    async with running_gateway((fake.address,), db=db) as second:
        assert second.gateway.metrics_endpoint is None  # off unless a port is given
        metrics = second.gateway.metrics

        # The held run was active at shutdown; the fake trainer keeps no job to re-attach to,
        # so it ends interrupted (ERROR).
        def counts() -> dict[str, float]:
            return {s: metrics.value("trainwire_gateway_runs", {"state": s}) for s in STATES}

        expected = {s: (1.0 if s in ("DONE", "ERROR") else 0.0) for s in STATES}
        await until(lambda: counts() == expected, f"gauges {expected}")
        await second.stub.DeleteRun(pb.DeleteRunRequest(run_id=run.id), timeout=TIMEOUT)
        assert metrics.value("trainwire_gateway_runs", {"state": "DONE"}) == 0


def test_metrics_observer_ignores_repeats_and_unknown_runs() -> None:
    metrics = GatewayMetrics()
    metrics.run_state_changed("r", "PENDING")
    metrics.run_state_changed("r", "RUNNING")
    metrics.run_state_changed("r", "RUNNING")  # a speed change
    metrics.run_state_changed("r", "DONE")
    metrics.run_state_changed("r", "DONE")  # reported twice
    metrics.run_state_changed("other", "ERROR")  # never seen created
    counts = {s: metrics.value("trainwire_gateway_runs", {"state": s}) for s in STATES}
    assert counts == {s: (1.0 if s == "DONE" else 0.0) for s in STATES}
    assert metrics.value("trainwire_gateway_runs_ended_total", {"state": "DONE"}) == 1


# -- JSON logs of the real process -------------------------------------------------------------


async def test_json_logs_carry_one_line_per_lifecycle_event_with_the_run_id(
    fake: FakeTrainer, tmp_path: pathlib.Path
) -> None:
    log = tmp_path / "gateway.log"
    flags = ("--metrics-port", "0", "--db", ":memory:", "--log-format", "json")
    async with gateway_process(fake.address, log, *flags, "--schedule-poll", "0.05") as (
        proc,
        address,
    ):
        assert proc.stdout is not None
        second = (await asyncio.wait_for(proc.stdout.readline(), TIMEOUT)).decode()
        metrics = re.fullmatch(r"gateway metrics on (http://127\.0\.0\.1:\d+/metrics)\n", second)
        assert metrics, second

        async with grpc.aio.insecure_channel(address) as channel:
            stub = gateway_service_pb2_grpc.GatewayServiceStub(channel)
            client = Client(None, channel, stub, "")  # type: ignore[arg-type]
            # controlled: created, started, paused, resumed, stopped.
            fake.push(Script(hold_at=3))
            controlled = await client.create(max_episodes=10)
            await published(stub, controlled.id, 2)
            for call, request in (
                (stub.PauseRun, pb.PauseRunRequest),
                (stub.ResumeRun, pb.ResumeRunRequest),
                (stub.StopRun, pb.StopRunRequest),
            ):
                await call(request(run_id=controlled.id), timeout=TIMEOUT)
            # done: created, started, finished; 40 episodes, none logged at INFO.
            done = await client.create(max_episodes=40)
            assert (await collect(stub, done.id)).finished is not None
            # broken: created, started, failed.
            fake.push(Script(violate="finite", violate_at=2))
            broken = await client.create(max_episodes=10)
            assert (await client.finished(broken.id)).state == pb.Run.STATE_ERROR
            scraped = await scrape(metrics.group(1))
            assert sample(scraped, "trainwire_gateway_runs", state="STOPPED") == 1
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), TIMEOUT) == 0

    records = [json.loads(line) for line in log.read_text().splitlines()]  # every line is JSON
    assert all({"time", "level", "logger", "message"} <= r.keys() for r in records)

    def events(run_id: str) -> list[str]:
        return [r["event"] for r in records if r.get("run_id") == run_id and "event" in r]

    assert events(controlled.id) == ["created", "started", "paused", "resumed", "stopped"]
    assert events(done.id) == ["created", "started", "finished"]
    assert events(broken.id) == ["created", "started", "failed"]
    for record in records:
        if record.get("event"):
            assert record["level"] == "INFO"
            assert record["run_id"] in record["message"]
    info_about_done = [r for r in records if r.get("run_id") == done.id and r["level"] == "INFO"]
    assert len(info_about_done) == 3  # no per-episode lines
    violation = [r for r in records if r.get("rule") == "finite"]
    assert len(violation) == 1 and violation[0]["run_id"] == broken.id
    assert violation[0]["level"] == "ERROR"

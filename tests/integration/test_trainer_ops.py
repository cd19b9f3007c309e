"""Operating the trainer: Prometheus metrics (scraped over HTTP) and JSON logs.

Real trainers on port 0 with metrics on port 0; jobs run through gRPC; numbers are read back from
``/metrics`` the way Prometheus reads them, or from the server's own registry.
"""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import queue
import re
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from tests.fakes.trainer_harness import running_trainer
from tests.fakes.waiting import JOB_TIMEOUT, TIMEOUT, until
from trainer_service.__main__ import parse_args
from trainer_service.core.provider import ProviderError
from trainer_service.metrics import (
    AioMetricsServerInterceptor,
    RpcMetrics,
    final_code,
)
from trainer_service.testing import FakeProvider, imitation_request
from trainwire.v1 import episode_pb2, trainer_service_pb2, trainer_service_pb2_grpc

pytestmark = pytest.mark.slow

REPO = pathlib.Path(__file__).resolve().parents[2]
SERVICE = "trainwire.v1.TrainerService"
TRAIN = {"grpc_type": "server_stream", "grpc_service": SERVICE, "grpc_method": "Train"}
CAPS = {"grpc_type": "unary", "grpc_service": SERVICE, "grpc_method": "GetCapabilities"}
RFC3339_UTC = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")


def scrape(url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """GETs ``/metrics`` and parses it: (sample name, labels) -> value."""
    with urllib.request.urlopen(url, timeout=TIMEOUT) as response:
        assert response.status == 200
        text = response.read().decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def sample(
    samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str
) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def episodes_of(responses: list[trainer_service_pb2.TrainResponse]) -> list[episode_pb2.Episode]:
    return [r.episode for r in responses if r.WhichOneof("event") == "episode"]


# -- metrics over HTTP -------------------------------------------------------------------------


def test_metrics_endpoint_counts_an_imitation_job() -> None:
    with running_trainer(
        {"imitation": "trainer_service.providers.imitation"}, slots=2, config={"metrics_port": 0}
    ) as running:
        endpoint = running.server.metrics_endpoint
        assert endpoint is not None and endpoint.port > 0
        assert endpoint.url == f"http://127.0.0.1:{endpoint.port}/metrics"
        before = scrape(endpoint.url)
        assert sample(before, "trainwire_trainer_slots") == 2
        assert sample(before, "trainwire_trainer_slots_busy") == 0

        responses = list(
            running.stub.Train(imitation_request("run-m", max_episodes=6), timeout=JOB_TIMEOUT)
        )
        episodes = episodes_of(responses)
        assert len(episodes) == 6 and episodes[-1].done
        caps = running.stub.GetCapabilities(
            trainer_service_pb2.GetCapabilitiesRequest(), timeout=TIMEOUT
        )
        assert caps.slots_free == 2

        after = scrape(endpoint.url)
        assert sample(after, "trainwire_trainer_episodes_sent_total", kind="imitation") == 6
        assert sample(after, "trainwire_trainer_jobs_started_total", kind="imitation") == 1
        ended = sample(after, "trainwire_trainer_jobs_ended_total", kind="imitation", outcome="ok")
        assert ended == 1
        assert sample(after, "grpc_server_started_total", **TRAIN) == 1
        assert sample(after, "grpc_server_handled_total", **TRAIN, grpc_code="OK") == 1
        assert sample(after, "grpc_server_handling_seconds_count", **TRAIN, grpc_code="OK") == 1
        seconds = sample(after, "grpc_server_handling_seconds_sum", **TRAIN, grpc_code="OK")
        assert seconds is not None and seconds > 0
        assert sample(after, "grpc_server_handled_total", **CAPS, grpc_code="OK") == 1
        assert sample(after, "trainwire_trainer_slots") == 2
        assert sample(after, "trainwire_trainer_slots_busy") == 0
        url = endpoint.url
    # Stopping the trainer stops its metrics endpoint.
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(url, timeout=TIMEOUT)


# -- codes, outcomes and counters, read from the registry --------------------------------------


def test_refused_cancelled_and_expired_streams_have_their_codes() -> None:
    fake = FakeProvider(hold_after=1)
    with running_trainer({"imitation": fake}, slots=1) as running:
        call = running.stub.Train(imitation_request("run-held"), timeout=JOB_TIMEOUT)
        assert next(call).episode.episode == 1
        assert running.value("trainwire_trainer_slots_busy") == 1

        refused = running.stub.Train(imitation_request("run-refused"), timeout=JOB_TIMEOUT)
        with pytest.raises(grpc.RpcError) as info:
            list(refused)
        assert info.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        # Recorded before the status went out, so no wait.
        assert (
            running.value("grpc_server_handled_total", **TRAIN, grpc_code="RESOURCE_EXHAUSTED") == 1
        )

        call.cancel()
        running.wait_value("grpc_server_handled_total", 1, **TRAIN, grpc_code="CANCELLED")
        # The job's end is counted by its own thread once its provider has stopped, which may be
        # after the RPC's status went out: wait for it.
        running.wait_value(
            "trainwire_trainer_jobs_ended_total", 1, kind="imitation", outcome="cancelled"
        )
        assert running.runner.wait_idle(TIMEOUT)
        assert running.value("trainwire_trainer_slots_busy") == 0

        expiring = running.stub.Train(imitation_request("run-deadline"), timeout=0.5)
        with pytest.raises(grpc.RpcError) as info:
            list(expiring)
        assert info.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        running.wait_value("grpc_server_handled_total", 1, **TRAIN, grpc_code="DEADLINE_EXCEEDED")
        assert running.value("grpc_server_started_total", **TRAIN) == 3
        # Only the two jobs that got a slot were started; one episode each went out.
        assert running.value("trainwire_trainer_jobs_started_total", kind="imitation") == 2
        assert running.value("trainwire_trainer_episodes_sent_total", kind="imitation") == 2


def _skip_episode_two(episode: episode_pb2.Episode) -> episode_pb2.Episode:
    if episode.episode >= 2:
        episode.episode += 1
    return episode


def test_contract_violation_is_counted() -> None:
    with running_trainer({"imitation": FakeProvider(tamper=_skip_episode_two)}) as running:
        call = running.stub.Train(imitation_request("run-bad"), timeout=JOB_TIMEOUT)
        with pytest.raises(grpc.RpcError) as info:
            list(call)
        assert info.value.code() is grpc.StatusCode.INTERNAL
        violations = running.value(
            "trainwire_trainer_contract_violations_total", kind="imitation", rule="sequence"
        )
        assert violations == 1
        outcome = {"kind": "imitation", "outcome": "contract_violation"}
        # The job's end is counted by its own thread, maybe after the status went out.
        running.wait_value("trainwire_trainer_jobs_ended_total", 1, **outcome)
        assert running.value("grpc_server_handled_total", **TRAIN, grpc_code="INTERNAL") == 1


def test_failures_and_heartbeats_are_counted() -> None:
    error = ProviderError("No model.", detail="x", code="NOT_FOUND", reason="NO_MODEL")
    providers: dict[str, object] = {"imitation": FakeProvider(fail_at=2)}
    for provider, code, outcome in (
        (FakeProvider(fail_at=2), grpc.StatusCode.INTERNAL, "crash"),
        (FakeProvider(fail_at=2, error=error), grpc.StatusCode.NOT_FOUND, "error"),
    ):
        providers["imitation"] = provider
        with running_trainer(providers) as running:
            with pytest.raises(grpc.RpcError) as info:
                list(running.stub.Train(imitation_request("run-fail"), timeout=JOB_TIMEOUT))
            assert info.value.code() is code
            ended = {"kind": "imitation", "outcome": outcome}
            running.wait_value("trainwire_trainer_jobs_ended_total", 1, **ended)
            assert running.value("grpc_server_handled_total", **TRAIN, grpc_code=code.name) == 1
    with running_trainer({"imitation": FakeProvider(hold_after=1)}) as running:
        call = running.stub.Train(imitation_request("run-down"), timeout=JOB_TIMEOUT)
        assert next(call).episode.episode == 1
        stopped = running.server.stop(TIMEOUT)  # the grace lets the job end as "shutdown"
        with pytest.raises(grpc.RpcError) as info:
            list(call)
        assert info.value.code() is grpc.StatusCode.UNAVAILABLE
        assert stopped.wait(TIMEOUT)
        ended = {"kind": "imitation", "outcome": "shutdown"}
        running.wait_value("trainwire_trainer_jobs_ended_total", 1, **ended)
        assert running.value("grpc_server_handled_total", **TRAIN, grpc_code="UNAVAILABLE") == 1
    with running_trainer({"imitation": FakeProvider(hold_after=0)}, heartbeat_s=0.02) as running:
        call = running.stub.Train(imitation_request("run-beat"), timeout=JOB_TIMEOUT)
        beats = [next(call) for _ in range(3)]
        assert all(b.WhichOneof("event") == "heartbeat" for b in beats)
        # The server counts a heartbeat once it is written and the next one is asked for.
        assert running.value("trainwire_trainer_heartbeats_sent_total", kind="imitation") >= 2
        call.cancel()


# -- the interceptor on a toy aio service: aborts, exceptions, streams ------------------------


def _toy_handlers(release: asyncio.Event) -> grpc.GenericRpcHandler:
    async def ok(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return request

    async def abort(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, "no")
        raise AssertionError("unreachable")

    async def crash(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        raise RuntimeError("boom")

    async def stream_abort(
        request: bytes, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        yield b"one"
        await context.abort(grpc.StatusCode.NOT_FOUND, "gone")

    async def stream_crash(
        request: bytes, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        yield b"one"
        raise RuntimeError("boom")

    async def stream_set_code(
        request: bytes, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        yield b"one"
        context.set_code(grpc.StatusCode.ABORTED)

    async def stream_forever(
        request: bytes, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        yield b"tick"
        await release.wait()

    unary: dict[str, Callable[..., Any]] = {"Ok": ok, "Abort": abort, "Crash": crash}
    streams: dict[str, Callable[..., Any]] = {
        "StreamAbort": stream_abort,
        "StreamCrash": stream_crash,
        "StreamSetCode": stream_set_code,
        "StreamForever": stream_forever,
    }
    handlers = {name: grpc.unary_unary_rpc_method_handler(f) for name, f in unary.items()}
    handlers |= {name: grpc.unary_stream_rpc_method_handler(f) for name, f in streams.items()}
    return grpc.method_handlers_generic_handler("toy.v1.ToyService", handlers)


async def test_interceptor_codes_on_a_toy_service() -> None:
    registry = CollectorRegistry()
    metrics = RpcMetrics(registry)
    release = asyncio.Event()
    server = grpc.aio.server(interceptors=(AioMetricsServerInterceptor(metrics),))
    server.add_generic_rpc_handlers((_toy_handlers(release),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()

    def handled(method: str, code: str, kind: str) -> float | None:
        labels = {"grpc_type": kind, "grpc_service": "toy.v1.ToyService", "grpc_method": method}
        return registry.get_sample_value("grpc_server_handled_total", {**labels, "grpc_code": code})

    async def counted(method: str, code: str, kind: str = "server_stream") -> None:
        """Waits for a call's count: the server may record it after the client saw the status."""
        await until(lambda: handled(method, code, kind) == 1, f"{method} {code}")

    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            expected = {
                "Ok": grpc.StatusCode.OK,
                "Abort": grpc.StatusCode.PERMISSION_DENIED,
                "Crash": grpc.StatusCode.UNKNOWN,
            }
            for method, code in expected.items():
                call = channel.unary_unary(f"/toy.v1.ToyService/{method}")
                if code is grpc.StatusCode.OK:
                    assert await call(b"x", timeout=TIMEOUT) == b"x"
                else:
                    with pytest.raises(grpc.RpcError) as info:
                        await call(b"x", timeout=TIMEOUT)
                    assert info.value.code() is code
                await counted(method, code.name, "unary")
            streams = {
                "StreamAbort": grpc.StatusCode.NOT_FOUND,
                "StreamCrash": grpc.StatusCode.UNKNOWN,
                "StreamSetCode": grpc.StatusCode.ABORTED,
            }
            for method, code in streams.items():
                stream = channel.unary_stream(f"/toy.v1.ToyService/{method}")(b"x", timeout=TIMEOUT)
                assert await stream.read() == b"one"
                with pytest.raises(grpc.RpcError) as info:
                    await stream.read()
                assert info.value.code() is code
                await counted(method, code.name)
            forever = channel.unary_stream("/toy.v1.ToyService/StreamForever")
            cancelled = forever(b"x", timeout=TIMEOUT)
            assert await cancelled.read() == b"tick"
            cancelled.cancel()
            await counted("StreamForever", "CANCELLED")
            expiring = forever(b"x", timeout=0.5)
            assert await expiring.read() == b"tick"
            with pytest.raises(grpc.RpcError) as info:
                await expiring.read()
            assert info.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
            await counted("StreamForever", "DEADLINE_EXCEEDED")
        ok = {"grpc_type": "unary", "grpc_service": "toy.v1.ToyService", "grpc_method": "Ok"}
        assert registry.get_sample_value("grpc_server_started_total", ok) == 1
        sent = {**ok, "grpc_method": "StreamSetCode", "grpc_type": "server_stream"}
        assert registry.get_sample_value("grpc_server_msg_sent_total", sent) == 1
    finally:
        release.set()
        await server.stop(None)


def test_final_code_rules() -> None:
    assert final_code(None) == "OK"
    assert final_code(None, error=RuntimeError()) == "UNKNOWN"
    assert final_code(grpc.StatusCode.NOT_FOUND, error=Exception()) == "NOT_FOUND"
    assert final_code(5) == "NOT_FOUND"  # a raw integer code
    assert final_code(grpc.StatusCode.OK, cancelled=True) == "CANCELLED"
    assert final_code(None, cancelled=True, deadline_passed=True) == "DEADLINE_EXCEEDED"


# -- the command line: flags, JSON logs, the metrics line ---------------------------------------


def test_ops_flags_are_parsed_and_checked(capsys: pytest.CaptureFixture[str]) -> None:
    config = parse_args(["--metrics-port", "0", "--log-format", "json", "--log-level", "debug"])
    assert (config.metrics_port, config.log_format, config.log_level) == (0, "json", "debug")
    assert parse_args([]).metrics_port is None
    assert parse_args([]).log_format == "text"
    for argv in (["--log-format", "xml"], ["--metrics-port", "70000"], ["--log-level", "loud"]):
        with pytest.raises(SystemExit) as info:
            parse_args(argv)
        assert info.value.code == 2
    err = capsys.readouterr().err
    assert "xml" in err and "metrics port 70000" in err and "loud" in err


def _lines(stream: Any) -> queue.Queue[str]:
    """Reads ``stream`` line by line in a thread, so waiting for a line can time out."""
    lines: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        for line in stream:
            lines.put(line)

    threading.Thread(target=pump, daemon=True).start()
    return lines


def test_cli_json_logs_and_metrics(tmp_path: pathlib.Path) -> None:
    env = dict(os.environ, PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "trainer_service", "--port", "0", "--metrics-port", "0"),
            *("--log-format", "json", "--device", "cpu", "--data-root", str(tmp_path)),
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stderr is not None
        stdout = _lines(proc.stdout)
        listening = stdout.get(timeout=TIMEOUT).strip()
        assert listening.startswith("trainer listening on 127.0.0.1:"), listening
        metrics_line = stdout.get(timeout=TIMEOUT).strip()
        match = re.fullmatch(r"trainer metrics on (http://127\.0\.0\.1:\d+/metrics)", metrics_line)
        assert match, metrics_line
        port = int(listening.rsplit(":", 1)[1])
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = trainer_service_pb2_grpc.TrainerServiceStub(channel)
            responses = list(
                stub.Train(imitation_request("run-json", max_episodes=20), timeout=JOB_TIMEOUT)
            )
        assert len(episodes_of(responses)) == 20
        samples = scrape(match.group(1))
        assert sample(samples, "trainwire_trainer_episodes_sent_total", kind="imitation") == 20
        assert sample(samples, "grpc_server_handled_total", **TRAIN, grpc_code="OK") == 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=TIMEOUT) == 0
        records = [json.loads(line) for line in proc.stderr.read().splitlines() if line.strip()]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=TIMEOUT)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
    assert records, "no log lines"
    for record in records:
        assert {"time", "level", "logger", "message"} <= record.keys(), record
        assert RFC3339_UTC.match(record["time"]), record["time"]
    about_run = [r for r in records if "run-json" in r["message"] and r["level"] == "INFO"]
    started = [r for r in about_run if "job started" in r["message"]]
    finished = [r for r in about_run if "job finished at episode 20" in r["message"]]
    assert len(started) == 1 and started[0]["run_id"] == "run-json"
    assert started[0]["logger"] == "trainer_service.core.jobs"
    assert len(finished) == 1 and finished[0]["run_id"] == "run-json"
    assert finished[0]["outcome"] == "ok"
    # Lifecycle lines only (started, what it trains, its final checkpoint, finished): nothing
    # per episode at INFO (20 episodes went out).
    assert len(about_run) <= 4, [r["message"] for r in about_run]
    assert sum("checkpoint at episode 20" in r["message"] for r in about_run) == 1
    assert any(r["message"] == "trainer stopped" for r in records)

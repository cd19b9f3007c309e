"""A gateway with TLS and tokens, in process: who gets in, over gRPC and HTTP, and what is said.

Certificates come from ``trustme`` (``tests.security_fixtures``); the trainer is the scripted
fake. Every call has a deadline. Every test also checks that no token reached a log line or the
metrics.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status
from prometheus_client import generate_latest

from gateway.config import GatewayConfig
from gateway.server import Gateway
from tests.fakes.fake_trainer import FakeTrainer
from tests.fakes.gateway_harness import create_request
from tests.fakes.waiting import TIMEOUT
from tests.security_fixtures import Pki, Tokens
from trainwire.v1 import gateway_service_pb2 as pb
from trainwire.v1 import gateway_service_pb2_grpc

ROLES = (None, "viewer", "operator", "admin")
REFUSED = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)
#: What each RPC needs (the issue's table), and a request it can answer without a real run.
NEEDS = {
    "GetRun": "viewer",
    "ListRuns": "viewer",
    "WatchRun": "viewer",
    "ListCheckpoints": "viewer",
    "DownloadCheckpoint": "viewer",
    "GetRunCurve": "viewer",
    "CreateRun": "operator",
    "PauseRun": "operator",
    "ResumeRun": "operator",
    "StopRun": "operator",
    "SetRunSpeed": "operator",
    "SetRunHyperparameters": "operator",
    "UpdateRun": "operator",
    "DeleteRun": "admin",
}
RANK = {None: 0, "viewer": 1, "operator": 2, "admin": 3}


def _request(rpc: str) -> object:
    if rpc == "CreateRun":
        return create_request(max_episodes=3)
    if rpc == "ListRuns":
        return pb.ListRunsRequest(page_size=5)
    if rpc == "SetRunSpeed":
        return pb.SetRunSpeedRequest(run_id="no-such-run", speed=2.0)
    if rpc == "UpdateRun":
        return pb.UpdateRunRequest(run=pb.Run(id="no-such-run", display_name="x"))
    if rpc == "SetRunHyperparameters":
        return pb.SetRunHyperparametersRequest(run_id="no-such-run", learning_rate=0.01)
    return getattr(pb, f"{rpc}Request")(run_id="no-such-run")


@dataclass
class Secured:
    gateway: Gateway
    address: str
    pki: Pki
    tokens: Tokens
    http: str

    def channel(self) -> grpc.aio.Channel:
        credentials = grpc.ssl_channel_credentials(self.pki.ca_pem())
        return grpc.aio.secure_channel(self.address, credentials)

    def ssl_context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.pki.ca_file))


@pytest.fixture
async def secured(
    fake: FakeTrainer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> AsyncIterator[Secured]:
    caplog.set_level(logging.DEBUG)
    pki = Pki(tmp_path / "pki")
    tokens = Tokens.make(tmp_path / "tokens")
    config = GatewayConfig(
        port=0,
        trainers=(fake.address,),
        db=":memory:",
        keepalive_s=0.2,
        schedule_poll_s=0.05,
        shutdown_grace_s=0.5,
        http_port=0,
        metrics_port=0,
        tls_cert=str(pki.server.cert),
        tls_key=str(pki.server.key),
        auth_tokens=str(tokens.path),
    )
    gateway = Gateway(config)
    port = await gateway.start()
    assert gateway.http is not None and gateway.http.url.startswith("https://")
    try:
        yield Secured(gateway, f"127.0.0.1:{port}", pki, tokens, gateway.http.url)
    finally:
        metrics = generate_latest(gateway.metrics.registry).decode()
        await gateway.stop()
        leaked = [
            record.getMessage()
            for record in caplog.records
            if any(token in record.getMessage() for token in tokens.all())
        ]
        assert not leaked, f"a token reached the log: {leaked[:1]}"
        assert not any(token in metrics for token in tokens.all())


async def _call(
    stub: gateway_service_pb2_grpc.GatewayServiceStub, rpc: str, metadata: object
) -> grpc.StatusCode:
    try:
        if rpc in ("WatchRun", "DownloadCheckpoint"):
            call = getattr(stub, rpc)(_request(rpc), timeout=TIMEOUT, metadata=metadata)
            async for _ in call:
                pass
        else:
            await getattr(stub, rpc)(_request(rpc), timeout=TIMEOUT, metadata=metadata)
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


async def test_every_rpc_answers_each_role_as_the_table_says(
    secured: Secured, caplog: pytest.LogCaptureFixture
) -> None:
    async with secured.channel() as channel:
        stub = gateway_service_pb2_grpc.GatewayServiceStub(channel)
        refused = 0
        for rpc, needs in NEEDS.items():
            for role in ROLES:
                code = await _call(stub, rpc, secured.tokens.metadata(role))
                if role is None:
                    expected: object = grpc.StatusCode.UNAUTHENTICATED
                elif RANK[role] < RANK[needs]:
                    expected = grpc.StatusCode.PERMISSION_DENIED
                else:
                    expected = "allowed"
                got = "allowed" if code not in REFUSED else code
                assert got == expected, (rpc, role, code)
                refused += code in REFUSED
                if got == "allowed" and rpc not in ("ListRuns", "CreateRun"):
                    assert code == grpc.StatusCode.NOT_FOUND, (rpc, role, code)
        unknown = (("authorization", "Bearer tw_not-a-token-this-gateway-knows"),)
        assert await _call(stub, "ListRuns", unknown) == grpc.StatusCode.UNAUTHENTICATED
        refused += 1
    lines = [r for r in caplog.records if r.getMessage().startswith("auth: refused")]
    assert len(lines) == refused  # one line per refusal
    denied = [line.getMessage() for line in lines if "needs" in line.getMessage()]
    assert any("DeleteRun" in m and "'operator-o'" in m and "needs admin" in m for m in denied)


async def test_a_refusal_names_the_role_needed_and_the_creator_is_the_token_name(
    secured: Secured,
) -> None:
    async with secured.channel() as channel:
        stub = gateway_service_pb2_grpc.GatewayServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as denied:
            await stub.DeleteRun(
                pb.DeleteRunRequest(run_id="x"),
                timeout=TIMEOUT,
                metadata=secured.tokens.metadata("operator"),
            )
        assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "needs role admin" in (denied.value.details() or "")
        status = rpc_status.from_call(denied.value)  # type: ignore[arg-type]
        assert status is not None
        info = error_details_pb2.ErrorInfo()
        assert status.details[0].Unpack(info)
        assert info.reason == "PERMISSION_DENIED" and info.metadata["required_role"] == "admin"

        reply = await stub.CreateRun(
            create_request(max_episodes=3),
            timeout=TIMEOUT,
            metadata=secured.tokens.metadata("operator"),
        )
        assert reply.run.creator == "operator-o"
        got = await stub.GetRun(
            pb.GetRunRequest(run_id=reply.run.id),
            timeout=TIMEOUT,
            metadata=secured.tokens.metadata("viewer"),
        )
        assert got.run.creator == "operator-o"


async def test_health_is_open_and_plaintext_is_refused(secured: Secured) -> None:
    async with secured.channel() as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=TIMEOUT
        )
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    async with grpc.aio.insecure_channel(secured.address) as plain:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await health_pb2_grpc.HealthStub(plain).Check(
                health_pb2.HealthCheckRequest(), timeout=TIMEOUT
            )
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


CREATE_BODY = {"task": {"imitation": {"clipName": "wave"}}, "config": {"maxEpisodes": 3}}
#: (method, path, body, the RPC it stands for) of every HTTP route that carries data.
HTTP_ROUTES = (
    ("GET", "/v1/runs", None, "ListRuns"),
    ("POST", "/v1/runs", CREATE_BODY, "CreateRun"),
    ("GET", "/v1/runs/nope", None, "GetRun"),
    ("GET", "/v1/runs/nope/motion", None, "GetRun"),
    ("GET", "/v1/runs/nope/curve", None, "GetRunCurve"),
    ("PATCH", "/v1/runs/nope", {"displayName": "x"}, "UpdateRun"),
    ("GET", "/v1/runs/nope/events", None, "WatchRun"),
    ("GET", "/v1/runs/nope/checkpoints", None, "ListCheckpoints"),
    ("GET", "/v1/runs/nope/checkpoints/0:download", None, "DownloadCheckpoint"),
    ("GET", "/v1/motions", None, "ListRuns"),
    ("POST", "/v1/runs/nope:pause", {}, "PauseRun"),
    ("POST", "/v1/runs/nope:resume", {}, "ResumeRun"),
    ("POST", "/v1/runs/nope:stop", {}, "StopRun"),
    ("POST", "/v1/runs/nope:setSpeed", {"speed": 2}, "SetRunSpeed"),
    ("POST", "/v1/runs/nope:setHyperparameters", {"learningRate": 0.01}, "SetRunHyperparameters"),
    ("DELETE", "/v1/runs/nope", None, "DeleteRun"),
)  # fmt: skip


async def test_the_http_side_enforces_the_same_roles(secured: Secured) -> None:
    connector = aiohttp.TCPConnector(ssl=secured.ssl_context())
    timeout = aiohttp.ClientTimeout(total=TIMEOUT)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        for path in ("/", "/static/app.js"):  # the page loads before it has a token
            async with session.get(secured.http + path) as response:
                assert response.status == 200, path
        for method, path, body, rpc in HTTP_ROUTES:
            for role in ROLES:
                headers = {}
                if role is not None:
                    headers["Authorization"] = f"Bearer {secured.tokens.by_role[role]}"
                async with session.request(
                    method, secured.http + path, json=body, headers=headers
                ) as response:
                    status = response.status
                    payload = await response.json()
                if role is None:
                    assert status == 401, (method, path, role, status)
                    assert response.headers["WWW-Authenticate"].startswith("Bearer")
                    assert payload["error"]["status"] == "UNAUTHENTICATED"
                elif RANK[role] < RANK[NEEDS[rpc]]:
                    assert status == 403, (method, path, role, status)
                    assert f"needs role {NEEDS[rpc]}" in payload["error"]["message"]
                else:
                    assert status not in (401, 403), (method, path, role, status, payload)
        # An EventSource and a download link cannot send headers: the event stream and the
        # checkpoint download take the token in their URL, and nothing else does.
        viewer = secured.tokens.by_role["viewer"]
        async with session.get(f"{secured.http}/v1/runs/nope/events?access_token={viewer}") as r:
            assert r.status == 404
        download = f"{secured.http}/v1/runs/nope/checkpoints/0:download?access_token={viewer}"
        async with session.get(download) as r:
            assert r.status == 404
        async with session.get(f"{secured.http}/v1/runs?access_token={viewer}") as r:
            assert r.status == 401 and viewer not in await r.text()


async def test_the_http_side_refuses_plaintext(secured: Secured) -> None:
    plain = secured.http.replace("https://", "http://")
    timeout = aiohttp.ClientTimeout(total=TIMEOUT)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        with pytest.raises(aiohttp.ClientError):
            async with session.get(plain + "/v1/runs") as response:
                await response.read()


async def test_tokens_are_re_read_on_reload(secured: Secured) -> None:
    from gateway.auth import Role
    from gateway.tools.add_token import add_token

    late = add_token(secured.tokens.path, "late-admin", Role.ADMIN)
    secured.tokens.by_role["late"] = late  # checked against the logs at the end, too
    metadata = (("authorization", f"Bearer {late}"),)
    async with secured.channel() as channel:
        stub = gateway_service_pb2_grpc.GatewayServiceStub(channel)
        assert await _call(stub, "ListRuns", metadata) == grpc.StatusCode.UNAUTHENTICATED
        secured.gateway.reload()
        assert await _call(stub, "ListRuns", metadata) == grpc.StatusCode.OK
        await asyncio.sleep(0)

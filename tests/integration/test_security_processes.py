"""The services as processes: the safe default for plaintext binds, SIGHUP certificate rotation
under an open watch, and the CLI's TLS errors in one line. Nothing a test sends as a token may
appear in a process's log."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.fakes.fake_trainer import FakeTrainer
from tests.fakes.gateway_harness import ROOT, create_request, gateway_process
from tests.fakes.waiting import JOB_TIMEOUT, TIMEOUT, until
from tests.security_fixtures import CertFiles, Pki, Tokens
from trainwire.v1 import gateway_service_pb2 as pb
from trainwire.v1 import gateway_service_pb2_grpc
from trainwire_ops.tls import ServerTls

pytestmark = pytest.mark.slow

ENV = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}


@pytest.mark.parametrize("service", ["gateway", "trainer_service"])
def test_a_plaintext_bind_other_machines_reach_is_refused_in_one_line(service: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", service, "--host", "0.0.0.0", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        cwd=ROOT,
        env=ENV,
    )
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "refusing to serve plaintext on 0.0.0.0" in lines[0]
    assert "--tls-cert" in lines[0] and "--insecure" in lines[0]


def test_insecure_allows_a_plaintext_bind_knowingly(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway", "--host", "0.0.0.0", "--port", "0", "--insecure",
         "--db", ":memory:", "--http-port", "-1", "--trainer", "127.0.0.1:9"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        cwd=ROOT,
        env=ENV,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode()
        assert line.startswith("gateway listening on 0.0.0.0:"), line
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(TIMEOUT) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _install(source: CertFiles, target: CertFiles) -> None:
    """Rotates the files the way an operator would: write new ones, rename over the old."""
    for src, dst in ((source.cert, target.cert), (source.key, target.key)):
        tmp = dst.with_suffix(".new")
        shutil.copyfile(src, tmp)
        tmp.chmod(0o600)
        tmp.replace(dst)


async def _health(address: str, ca: bytes) -> grpc.StatusCode:
    options = (("grpc.use_local_subchannel_pool", 1),)  # a new connection, never a shared one
    credentials = grpc.ssl_channel_credentials(ca)
    async with grpc.aio.secure_channel(address, credentials, options=options) as channel:
        try:
            await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=TIMEOUT
            )
        except grpc.aio.AioRpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


async def _serves(address: str, ca: bytes) -> bool:
    """Whether a new connection that trusts ``ca`` gets an answer."""
    return await _health(address, ca) == grpc.StatusCode.OK


async def test_sighup_rotates_the_certificate_and_an_open_watch_keeps_streaming(
    fake: FakeTrainer, tmp_path: Path
) -> None:
    old, new = Pki(tmp_path / "old", "old"), Pki(tmp_path / "new", "new")
    live = CertFiles(tmp_path / "live.pem", tmp_path / "live.key")
    _install(old.server, live)
    tokens = Tokens.make(tmp_path / "tokens")
    log = tmp_path / "gateway.log"
    flags = ("--db", ":memory:", "--tls-cert", str(live.cert), "--tls-key", str(live.key),
             "--auth-tokens", str(tokens.path), "--log-level", "DEBUG")  # fmt: skip
    async with gateway_process(fake.address, log, *flags) as (proc, address):
        metadata = tokens.metadata("operator")
        credentials = grpc.ssl_channel_credentials(old.ca_pem())
        async with grpc.aio.secure_channel(address, credentials) as channel:
            stub = gateway_service_pb2_grpc.GatewayServiceStub(channel)
            run = (
                await stub.CreateRun(
                    create_request(max_episodes=400, episodes_per_second=40),
                    timeout=TIMEOUT,
                    metadata=metadata,
                )
            ).run
            watch = stub.WatchRun(
                pb.WatchRunRequest(run_id=run.id), timeout=JOB_TIMEOUT, metadata=metadata
            )
            seen = 0

            async def read_until(count: int) -> None:
                nonlocal seen
                while seen < count:
                    message = await asyncio.wait_for(watch.read(), TIMEOUT)
                    assert message is not grpc.aio.EOF, "the watch ended"
                    kind = message.WhichOneof("event")
                    seen += len(message.batch.episodes) if kind == "batch" else kind == "episode"

            await read_until(5)
            _install(new.server, live)
            proc.send_signal(signal.SIGHUP)
            # New connections see the new certificate.
            await until(lambda: _serves(address, new.ca_pem()), f"the new certificate ({log})")
            assert await _health(address, old.ca_pem()) == grpc.StatusCode.UNAVAILABLE
            before = seen
            await read_until(before + 20)  # the watch opened before the rotation goes on
            await stub.StopRun(pb.StopRunRequest(run_id=run.id), timeout=TIMEOUT, metadata=metadata)
            watch.cancel()
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), TIMEOUT) == 0
    text = log.read_text()
    assert "TLS certificate reloaded" in text
    assert not any(token in text for token in tokens.all())
    assert "PRIVATE KEY" not in text


async def _serve_tls(cert: CertFiles) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    port = server.add_secure_port("127.0.0.1:0", ServerTls(cert.cert, cert.key).grpc_credentials())
    await server.start()
    return server, f"127.0.0.1:{port}"


async def _cli(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "trainwire.cli", "--timeout", "10", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        cwd=ROOT, env={**ENV, **(env or {})},
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), TIMEOUT)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_cli_tls_failures_are_one_line_saying_what_failed(tmp_path: Path) -> None:
    pki = Pki(tmp_path)
    stranger = Pki(tmp_path / "stranger", "stranger")
    cases = {
        "unknown CA": (pki.server, stranger.ca_file),
        "expired": (pki.expired_server(), pki.ca_file),
        "mismatch": (pki.server_for("other.example", label="other"), pki.ca_file),
    }
    for what, (cert, ca) in cases.items():
        server, address = await _serve_tls(cert)
        try:
            code, _, err = await _cli("--gateway", address, "--ca", str(ca), "runs", "list")
        finally:
            await server.stop(None)
        lines = err.strip().splitlines()
        assert code == 1 and len(lines) == 1, (what, err)
        assert lines[0].startswith("error: UNAVAILABLE: TLS handshake with"), lines[0]
        assert what in lines[0], lines[0]
    # --server-name checks the name the certificate carries: the handshake passes, and this
    # bare server (no gateway service) answers UNIMPLEMENTED.
    server, address = await _serve_tls(pki.server_for("other.example", label="other"))
    try:
        code, _, err = await _cli(
            "--gateway", address, "--ca", str(pki.ca_file), "--server-name", "other.example",
            "runs", "list",
        )  # fmt: skip
    finally:
        await server.stop(None)
    assert code == 1 and "UNIMPLEMENTED" in err and "TLS" not in err, err
    code, _, err = await _cli(
        "--gateway", address, "--server-name", "other.example", "runs", "list"
    )
    assert code != 0 and "--server-name checks a TLS certificate" in err, err


async def test_cli_and_client_speak_tls_with_a_token(fake: FakeTrainer, tmp_path: Path) -> None:
    from gateway.config import GatewayConfig
    from gateway.server import Gateway
    from trainwire.client import GatewayClient, PermissionDenied, Unauthenticated

    pki = Pki(tmp_path)
    tokens = Tokens.make(tmp_path / "tokens")
    gateway = Gateway(
        GatewayConfig(
            port=0, trainers=(fake.address,), db=":memory:", shutdown_grace_s=0.5,
            tls_cert=str(pki.server.cert), tls_key=str(pki.server.key),
            tls_client_ca=str(pki.ca_file), auth_tokens=str(tokens.path),
        )
    )  # fmt: skip
    port = await gateway.start()
    address = f"127.0.0.1:{port}"
    try:
        env = {
            "TRAINWIRE_CA": str(pki.ca_file),
            "TRAINWIRE_CERT": str(pki.client.cert),
            "TRAINWIRE_KEY": str(pki.client.key),
            "TRAINWIRE_TOKEN": tokens.by_role["viewer"],
        }
        code, _, err = await _cli("--gateway", address, "runs", "list", env=env)
        assert code == 0, err
        code, _, err = await _cli("--gateway", address, "runs", "delete", "x", env=env)
        assert code == 1 and err.strip() == (
            "error: PERMISSION_DENIED: trainwire.v1.GatewayService/DeleteRun needs role admin; "
            "token 'viewer-v' has viewer"
        )
        no_cert = {k: v for k, v in env.items() if k in ("TRAINWIRE_CA", "TRAINWIRE_TOKEN")}
        code, _, err = await _cli("--gateway", address, "runs", "list", env=no_cert)
        assert code == 1 and len(err.strip().splitlines()) == 1 and "client certificate" in err

        def client_calls() -> None:
            kwargs = {
                "root_certificates": pki.ca_pem(),
                "certificate_chain": pki.client.chain(),
                "private_key": pki.client.private_key(),
                "timeout": TIMEOUT,
            }
            with GatewayClient(address, token=tokens.by_role["admin"], **kwargs) as admin:
                assert admin.list_runs() == []
            with GatewayClient(address, **kwargs) as anonymous, pytest.raises(Unauthenticated):
                anonymous.list_runs()
            with (
                GatewayClient(address, token=tokens.by_role["viewer"], **kwargs) as viewer,
                pytest.raises(PermissionDenied, match="needs role operator"),
            ):
                viewer.pause_run("x")

        await asyncio.to_thread(client_calls)
    finally:
        await gateway.stop()


async def test_sighup_rotates_the_trainers_certificate_too(tmp_path: Path) -> None:
    from tests.fakes.gateway_harness import trainer_process

    old, new = Pki(tmp_path / "old", "old"), Pki(tmp_path / "new", "new")
    live = CertFiles(tmp_path / "live.pem", tmp_path / "live.key")
    _install(old.server, live)
    log = tmp_path / "trainer.log"
    flags = ("--tls-cert", str(live.cert), "--tls-key", str(live.key))
    with trainer_process(log, *flags, slots=1) as (proc, address):
        assert await _health(address, old.ca_pem()) == grpc.StatusCode.OK
        _install(new.server, live)
        proc.send_signal(signal.SIGHUP)
        await until(lambda: _serves(address, new.ca_pem()), f"the new certificate ({log})")
        assert proc.poll() is None  # SIGHUP reloads; it does not end the trainer
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, TIMEOUT) == 0

"""Mutual TLS between the gateway and a trainer: a trainer started with a client CA serves only
callers holding a certificate that CA signed, and a gateway that has one trains through it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from gateway.config import GatewayConfig
from gateway.core.trainers import TrainerError, TrainerLost
from gateway.server import Gateway
from gateway.trainer_client import GrpcTrainerConnector
from tests.fakes.gateway_harness import create_request
from tests.fakes.waiting import TIMEOUT, until
from tests.security_fixtures import Pki, Tokens, mtls_trainer
from trainwire.v1 import gateway_service_pb2 as pb
from trainwire.v1 import gateway_service_pb2_grpc, trainer_service_pb2, trainer_service_pb2_grpc


def _gateway_credentials(pki: Pki) -> grpc.ChannelCredentials:
    """What a gateway presents to an mTLS trainer: ``pki``'s CA and its client certificate."""
    return grpc.ssl_channel_credentials(pki.ca_pem(), pki.client.private_key(), pki.client.chain())


def _capabilities(address: str, credentials: grpc.ChannelCredentials) -> grpc.StatusCode:
    with grpc.secure_channel(address, credentials) as channel:
        try:
            trainer_service_pb2_grpc.TrainerServiceStub(channel).GetCapabilities(
                trainer_service_pb2.GetCapabilitiesRequest(), timeout=TIMEOUT
            )
        except grpc.RpcError as exc:
            return exc.code()  # type: ignore[no-any-return, attr-defined]
    return grpc.StatusCode.OK


def test_a_caller_without_a_client_certificate_is_refused(tmp_path: Path) -> None:
    pki = Pki(tmp_path)
    stranger = Pki(tmp_path / "stranger", "stranger")
    with mtls_trainer(pki) as (_, address):
        ca = pki.ca_pem()
        assert _capabilities(address, grpc.ssl_channel_credentials(ca)) == (
            grpc.StatusCode.UNAVAILABLE
        )
        foreign = grpc.ssl_channel_credentials(
            ca, stranger.client.private_key(), stranger.client.chain()
        )
        assert _capabilities(address, foreign) == grpc.StatusCode.UNAVAILABLE
        with grpc.insecure_channel(address) as plain, pytest.raises(grpc.RpcError):
            trainer_service_pb2_grpc.TrainerServiceStub(plain).GetCapabilities(
                trainer_service_pb2.GetCapabilitiesRequest(), timeout=TIMEOUT
            )
        good = _gateway_credentials(pki)
        assert _capabilities(address, good) == grpc.StatusCode.OK


@pytest.mark.parametrize("server_name", [None, "trainer.internal"])
async def test_a_run_goes_through_the_gateway_to_an_mtls_trainer_to_done(
    tmp_path: Path, server_name: str | None
) -> None:
    # With a server name, the trainer's certificate names only that (not 127.0.0.1, which the
    # gateway dials): --trainer-server-name is what lets the gateway in.
    pki = Pki(tmp_path)
    tokens = Tokens.make(tmp_path / "tokens")
    shown = pki.server_for(server_name, label="named") if server_name else pki.server
    with mtls_trainer(pki, shown) as (_, address):
        gateway = Gateway(
            GatewayConfig(
                port=0,
                trainers=(address,),
                db=":memory:",
                schedule_poll_s=0.05,
                shutdown_grace_s=0.5,
                tls_cert=str(pki.server.cert),
                tls_key=str(pki.server.key),
                trainer_ca=str(pki.ca_file),
                trainer_cert=str(pki.client.cert),
                trainer_key=str(pki.client.key),
                trainer_server_name=server_name,
                auth_tokens=str(tokens.path),
            )
        )
        port = await gateway.start()
        try:
            credentials = grpc.ssl_channel_credentials(pki.ca_pem())
            async with grpc.aio.secure_channel(f"127.0.0.1:{port}", credentials) as channel:
                stub = gateway_service_pb2_grpc.GatewayServiceStub(channel)
                metadata = tokens.metadata("operator")
                created = await stub.CreateRun(
                    create_request(max_episodes=5), timeout=TIMEOUT, metadata=metadata
                )
                final = None
                call = stub.WatchRun(
                    pb.WatchRunRequest(run_id=created.run.id), timeout=TIMEOUT, metadata=metadata
                )
                async for message in call:
                    if message.WhichOneof("event") == "finished":
                        final = message.finished
                assert final is not None, "the watch ended without finished"
                assert final.state == pb.Run.State.STATE_DONE, final.error_message
                assert final.episode == 5 and final.trainer == address
                assert final.creator == "operator-o"
        finally:
            await gateway.stop()


async def test_a_certificate_reload_closes_each_old_trainer_channel_after_its_last_call(
    tmp_path: Path,
) -> None:
    pki = Pki(tmp_path)
    credentials = _gateway_credentials(pki)
    connector = GrpcTrainerConnector(credentials)
    request = create_request(max_episodes=50)
    with mtls_trainer(pki) as (_, address):
        try:
            # A stream held by its grant stays open on the first channel.
            stream = connector.train(
                address, "held", request.task, request.config, grant_through_episode=1
            )
            first = await asyncio.wait_for(anext(aiter(stream)), TIMEOUT)
            assert first is not None and first.episode == 1
            assert connector.open_channels == 1
            connector.set_credentials(credentials)  # what a SIGHUP does
            caps = await connector.capabilities(address, TIMEOUT)  # over a new channel
            assert caps.slots_total == 2
            assert connector.open_channels == 2  # the old one still carries the stream
            assert await connector.grant(address, "held", 2, TIMEOUT) == 1
            second = await asyncio.wait_for(anext(aiter(stream)), TIMEOUT)
            while second is None:  # a heartbeat
                second = await asyncio.wait_for(anext(aiter(stream)), TIMEOUT)
            assert second.episode == 2, "the stream went on over the retired channel"
            await connector.cancel_job(address, "held", TIMEOUT)
            with pytest.raises(TrainerError):
                async for _ in stream:
                    pass
            await until(lambda: connector.open_channels == 1, "the retired channel closed")
            connector.set_credentials(credentials)  # nothing open: closed at once
            await until(lambda: connector.open_channels == 0, "the idle channel closed")
            assert (await connector.capabilities(address, TIMEOUT)).slots_total == 2
        finally:
            await connector.close()
        assert connector.open_channels == 0


async def test_a_trainer_certificate_for_another_name_needs_the_server_name(
    tmp_path: Path,
) -> None:
    pki = Pki(tmp_path)
    credentials = _gateway_credentials(pki)
    with mtls_trainer(pki, pki.server_for("trainer.internal", label="named")) as (_, address):
        plain = GrpcTrainerConnector(credentials)
        named = GrpcTrainerConnector(credentials, server_name="trainer.internal")
        try:
            with pytest.raises(TrainerLost):
                await plain.capabilities(address, 5)
            assert (await named.capabilities(address, TIMEOUT)).slots_total == 2
        finally:
            await plain.close()
            await named.close()

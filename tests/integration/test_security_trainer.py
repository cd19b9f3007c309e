"""Mutual TLS between the gateway and a trainer: a trainer started with a client CA serves only
callers holding a certificate that CA signed, and a gateway that has one trains through it."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from gateway.config import GatewayConfig
from gateway.server import Gateway
from tests.fakes.gateway_harness import create_request
from tests.security_fixtures import Pki, Tokens, mtls_trainer
from trainwire.v1 import gateway_service_pb2 as pb
from trainwire.v1 import gateway_service_pb2_grpc, trainer_service_pb2, trainer_service_pb2_grpc

TIMEOUT = 20.0


def _capabilities(address: str, credentials: grpc.ChannelCredentials) -> grpc.StatusCode:
    with grpc.secure_channel(address, credentials) as channel:
        try:
            trainer_service_pb2_grpc.TrainerServiceStub(channel).GetCapabilities(
                trainer_service_pb2.GetCapabilitiesRequest(), timeout=5
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
                trainer_service_pb2.GetCapabilitiesRequest(), timeout=5
            )
        good = grpc.ssl_channel_credentials(ca, pki.client.private_key(), pki.client.chain())
        assert _capabilities(address, good) == grpc.StatusCode.OK


async def test_a_run_goes_through_the_gateway_to_an_mtls_trainer_to_done(tmp_path: Path) -> None:
    pki = Pki(tmp_path)
    tokens = Tokens.make(tmp_path / "tokens")
    with mtls_trainer(pki) as (_, address):
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

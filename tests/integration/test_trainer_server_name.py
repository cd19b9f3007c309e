"""A trainer whose TLS certificate does not carry the name the gateway checks: the real handshake
fails, and the gateway's warning says to set ``--trainer-server-name`` (or which value of it is
wrong) instead of only gRPC's text."""

from __future__ import annotations

import logging
from pathlib import Path

import grpc
import pytest

from gateway.config import GatewayConfig
from gateway.core.trainers import TrainerLost
from gateway.server import Gateway
from gateway.trainer_client import GrpcTrainerConnector
from tests.fakes.waiting import until
from tests.security_fixtures import Pki, mtls_trainer


def _credentials(pki: Pki) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(pki.ca_pem(), pki.client.private_key(), pki.client.chain())


@pytest.mark.parametrize("server_name", [None, "wrong.internal"])
async def test_the_connector_says_which_name_to_set(
    tmp_path: Path, server_name: str | None
) -> None:
    pki = Pki(tmp_path)
    with mtls_trainer(pki, pki.server_for("trainer.internal", label="named")) as (_, address):
        connector = GrpcTrainerConnector(_credentials(pki), server_name=server_name)
        try:
            with pytest.raises(TrainerLost) as info:
                await connector.capabilities(address, 5)
        finally:
            await connector.close()
    if server_name is None:
        hint = (
            f"its TLS certificate does not name {address.rsplit(':', 1)[0]}: start the gateway "
            "with --trainer-server-name set to a name the certificate carries"
        )
    else:
        hint = (
            f"its TLS certificate does not name {server_name} (--trainer-server-name): set it "
            "to a name the certificate carries"
        )
    assert str(info.value).startswith(f"trainer {address}: {hint} (UNAVAILABLE: ")
    assert str(info.value).endswith("Hostname Verification Check failed.)")


async def test_the_gateway_warns_with_the_flag_to_set(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pki = Pki(tmp_path)
    with mtls_trainer(pki, pki.server_for("trainer.internal", label="named")) as (_, address):
        gateway = Gateway(
            GatewayConfig(
                port=0,
                http_port=None,
                trainers=(address,),
                db=":memory:",
                schedule_poll_s=0.05,
                shutdown_grace_s=0.5,
                trainer_ca=str(pki.ca_file),
                trainer_cert=str(pki.client.cert),
                trainer_key=str(pki.client.key),
            )
        )
        caplog.set_level(logging.WARNING)
        await gateway.start()
        try:
            await until(
                lambda: [r for r in caplog.records if "unreachable" in r.getMessage()],
                "an unreachable-trainer warning",
            )
        finally:
            await gateway.stop()
    (warning,) = [r.getMessage() for r in caplog.records if "unreachable" in r.getMessage()]
    assert warning.startswith(
        f"trainer {address} unreachable: trainer {address}: its TLS certificate does not name "
        "127.0.0.1: start the gateway with --trainer-server-name set to a name the certificate "
        "carries (UNAVAILABLE: "
    )

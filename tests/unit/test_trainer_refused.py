"""A trainer whose address refuses connections is gone with its jobs (``TrainerUnreachable``);
any other failure to reach it (a reset, a closed socket, a deadline, a TLS failure) is only
``TrainerLost``: the trainer may still run its jobs. Checked on gRPC's own words and on a real
refused connection."""

from __future__ import annotations

import asyncio
import socket

import grpc
import pytest

from gateway.core.trainers import TrainerLost, TrainerUnreachable
from gateway.trainer_client import GrpcTrainerConnector, classify
from tests.fakes.core_harness import imitation_task
from trainwire.v1 import episode_pb2

# gRPC 1.85's details of a call to an address nothing listens on.
REFUSED = (
    "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:37917: Failed to "
    "connect to remote host: Connection refused"
)
NOT_REFUSED = (
    "failed to connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:1: Socket closed",
    "Connection reset by peer",
    "recvmsg:Connection reset by peer",
)


def _error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


def test_a_refused_connection_is_unreachable() -> None:
    error = classify(_error(grpc.StatusCode.UNAVAILABLE, REFUSED), "127.0.0.1:37917")
    assert isinstance(error, TrainerUnreachable)
    assert "Connection refused" in str(error)


@pytest.mark.parametrize("details", NOT_REFUSED)
def test_other_unavailable_failures_are_only_lost(details: str) -> None:
    error = classify(_error(grpc.StatusCode.UNAVAILABLE, details), "t:1")
    assert isinstance(error, TrainerLost) and not isinstance(error, TrainerUnreachable)


def test_a_deadline_that_names_a_refusal_is_not_unreachable() -> None:
    # Only gRPC's own UNAVAILABLE before any answer says nothing listens.
    error = classify(_error(grpc.StatusCode.DEADLINE_EXCEEDED, REFUSED), "t:1")
    assert not isinstance(error, TrainerUnreachable)


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_a_real_refused_connection_is_unreachable_for_every_call() -> None:
    address = f"127.0.0.1:{_closed_port()}"
    connector = GrpcTrainerConnector()
    try:
        stream = connector.train(
            address, "r1", imitation_task(), episode_pb2.TrainConfig(max_episodes=3), 1, 0
        )
        with pytest.raises(TrainerUnreachable):
            async with asyncio.timeout(10):
                await stream.__anext__()
        with pytest.raises(TrainerUnreachable):
            await connector.capabilities(address, timeout=10)
        with pytest.raises(TrainerUnreachable):
            await connector.grant(address, "r1", 5, timeout=10)
    finally:
        await connector.close()

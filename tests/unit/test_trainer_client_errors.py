"""The gateway's words for a trainer it cannot reach over TLS: a certificate that does not carry
the name checked says to set ``--trainer-server-name`` (or to fix it), ahead of gRPC's text;
every other failure keeps the status as it is."""

from __future__ import annotations

import grpc

from gateway.core.scheduler import _short_reason
from gateway.core.trainers import TrainerLost
from gateway.trainer_client import classify, failure_detail

# gRPC 1.85's details for a trainer certificate without the name checked (a real handshake:
# tests/integration/test_trainer_server_name.py).
MISMATCH = (
    "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:50052: Custom "
    "verification check failed with error: UNAUTHENTICATED: Hostname Verification Check failed."
)
UNKNOWN_CA = (
    "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:50052: Tls "
    "handshake failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: error:1000007d:SSL routines:"
    "OPENSSL_internal:CERTIFICATE_VERIFY_FAILED: unable to get local issuer certificate: OK"
)


def _unavailable(details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(
        grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details
    )


def test_a_name_mismatch_without_a_server_name_suggests_the_flag() -> None:
    text = failure_detail(_unavailable(MISMATCH), "127.0.0.1:50052", None)
    assert text == (
        "trainer 127.0.0.1:50052: its TLS certificate does not name 127.0.0.1: start the gateway "
        "with --trainer-server-name set to a name the certificate carries "
        f"(UNAVAILABLE: {MISMATCH})"
    )


def test_a_name_mismatch_with_a_server_name_names_it() -> None:
    text = failure_detail(_unavailable(MISMATCH), "[::1]:50052", "trainer.internal")
    assert text == (
        "trainer [::1]:50052: its TLS certificate does not name trainer.internal "
        "(--trainer-server-name): set it to a name the certificate carries "
        f"(UNAVAILABLE: {MISMATCH})"
    )


def test_other_failures_keep_the_status_as_it_is() -> None:
    for details in (UNKNOWN_CA, "failed to connect to all addresses; Connection refused"):
        text = failure_detail(_unavailable(details), "t:1", None)
        assert text == f"trainer t:1: UNAVAILABLE: {details}"
        assert "--trainer-server-name" not in text


def test_a_train_stream_that_meets_a_name_mismatch_is_lost_with_the_hint() -> None:
    error = classify(_unavailable(MISMATCH), "10.0.0.7:50052")
    assert isinstance(error, TrainerLost)
    assert str(error).startswith(
        "trainer 10.0.0.7:50052: its TLS certificate does not name 10.0.0.7: start the gateway "
        "with --trainer-server-name"
    )


def test_a_run_waiting_for_a_trainer_with_a_name_mismatch_says_why_in_its_detail() -> None:
    # The scheduler's pending_detail keeps the hint, not just "unavailable".
    text = failure_detail(_unavailable(MISMATCH), "127.0.0.1:50052", None)
    assert _short_reason(text) == (
        "its TLS certificate does not name 127.0.0.1: start the gateway with "
        "--trainer-server-name set to a name the certificate carries"
    )
    assert _short_reason(f"trainer t:1: UNAVAILABLE: {UNKNOWN_CA}") == "unavailable"

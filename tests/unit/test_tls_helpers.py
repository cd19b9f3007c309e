"""The safe-bind rule, certificate checks and the client's one-line TLS errors."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from pathlib import Path

import pytest

from tests.fakes.waiting import TIMEOUT
from tests.security_fixtures import CertFiles, Pki
from trainwire.tls import describe_connection_failure
from trainwire_ops.tls import (
    PlaintextRefused,
    ServerTls,
    TlsFileError,
    check_plaintext_bind,
    is_loopback,
)


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.1.2.3", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("::", False),
        ("10.0.0.5", False),
        ("trainer.example", False),
    ],
)
def test_loopback_addresses(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_plaintext_on_a_reachable_address_needs_tls_or_insecure() -> None:
    with pytest.raises(PlaintextRefused) as refused:
        check_plaintext_bind("0.0.0.0", tls=False, insecure=False)
    text = str(refused.value)
    assert "\n" not in text and "--tls-cert" in text and "--insecure" in text
    check_plaintext_bind("0.0.0.0", tls=True, insecure=False)
    check_plaintext_bind("0.0.0.0", tls=False, insecure=True)
    check_plaintext_bind("127.0.0.1", tls=False, insecure=False)


def test_bad_certificate_files_are_named_never_shown(tmp_path: Path) -> None:
    pki = Pki(tmp_path)
    other = Pki(tmp_path / "other", "other")
    with pytest.raises(TlsFileError, match="cannot read the certificate"):
        ServerTls(tmp_path / "missing.pem", pki.server.key)
    with pytest.raises(TlsFileError, match="not a usable pair") as mismatch:
        ServerTls(pki.server.cert, other.server.key)
    assert "PRIVATE KEY" not in str(mismatch.value) and "\n" not in str(mismatch.value)
    notpem = tmp_path / "notpem"
    notpem.write_text("hello")
    with pytest.raises(TlsFileError, match="not PEM"):
        ServerTls(pki.server.cert, pki.server.key, notpem)


def test_reload_keeps_the_old_certificate_when_the_new_files_are_bad(tmp_path: Path) -> None:
    pki = Pki(tmp_path)
    tls = ServerTls(pki.server.cert, pki.server.key)
    pki.server.key.write_text("-----BEGIN PRIVATE KEY-----\nbroken\n-----END PRIVATE KEY-----\n")
    assert tls.reload() is False


DETAILS = {
    "unknown CA": "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: "
    "Tls handshake failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: error:1000007d:SSL routines:"
    "OPENSSL_internal:CERTIFICATE_VERIFY_FAILED: unable to get local issuer certificate: OK",
    "expired": "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: Tls "
    "handshake failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: error:1000007d:SSL routines:"
    "OPENSSL_internal:CERTIFICATE_VERIFY_FAILED: certificate has expired: OK",
    "name mismatch": "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: "
    "Custom verification check failed with error: UNAUTHENTICATED: Hostname Verification Check "
    "failed.",
}


@pytest.mark.parametrize("what", sorted(DETAILS))
def test_tls_failures_read_as_one_line_that_says_what_failed(what: str) -> None:
    text = describe_connection_failure(
        DETAILS[what], "gw.example:50051", tls=True, client_certificate=False
    )
    assert text is not None and "\n" not in text and "SSL_ERROR" not in text
    assert what.split()[0] in text or (what == "expired" and "expired" in text)


def test_a_closed_handshake_suggests_a_client_certificate() -> None:
    details = (
        "failed to connect to all addresses; last error: UNAVAILABLE: ipv4:1.2.3.4:1: Socket closed"
    )
    text = describe_connection_failure(details, "gw:1", tls=True, client_certificate=False)
    assert text is not None and "client certificate" in text
    plain = describe_connection_failure(details, "gw:1", tls=False, client_certificate=False)
    assert plain is not None and "--ca" in plain
    assert (
        describe_connection_failure(
            "Connection refused", "gw:1", tls=True, client_certificate=False
        )
        is None
    )


async def _handshake(port: int, pki: Pki, client: CertFiles) -> str:
    """Opens a TLS connection with ``client``'s certificate; "ok" or the error's class."""
    context = ssl.create_default_context(cafile=pki.ca_file)
    context.load_cert_chain(client.cert, client.key)
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection("127.0.0.1", port, ssl=context), 10
        )
        # TLS 1.3 reports a refused client certificate on the first read, not the handshake.
        answer = await asyncio.wait_for(reader.read(2), TIMEOUT)
        writer.close()
        return answer.decode() or "closed"
    except (ssl.SSLError, ConnectionError) as exc:
        return type(exc).__name__


async def test_a_reload_replaces_the_http_side_client_cas_not_only_adds(tmp_path: Path) -> None:
    pki = Pki(tmp_path)
    other = Pki(tmp_path / "other", "other")
    client_ca = tmp_path / "clients.pem"
    client_ca.write_bytes(pki.ca_pem())
    tls = ServerTls(pki.server.cert, pki.server.key, client_ca)

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"ok")
        with contextlib.suppress(ConnectionError, ssl.SSLError):
            await writer.drain()
            writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0, ssl=tls.ssl_context())
    port = server.sockets[0].getsockname()[1]
    try:
        assert await _handshake(port, pki, pki.client) == "ok"
        assert await _handshake(port, pki, other.client) != "ok"
        client_ca.write_bytes(other.ca_pem())  # the old CA taken out, a new one in
        assert tls.reload() is True
        assert await _handshake(port, pki, other.client) == "ok"
        assert await _handshake(port, pki, pki.client) != "ok", "the removed CA is still trusted"
    finally:
        server.close()
        await server.wait_closed()

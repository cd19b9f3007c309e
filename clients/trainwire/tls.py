"""The client side of TLS and tokens: channel credentials, and one line for people when a
connection fails.

gRPC reports a failed handshake as a paragraph of core internals (``failed to connect to all
addresses; last error: UNKNOWN: ipv4:...: Tls handshake failed (TSI_PROTOCOL_FAILURE):
SSL_ERROR_SSL: error:1000007d:SSL routines:OPENSSL_internal:CERTIFICATE_VERIFY_FAILED: ...``).
``describe_connection_failure`` says instead what failed (an unknown CA, a name mismatch, an
expired certificate, a server that does not speak TLS or wants a client certificate) and what
to do, in one line. ``is_certificate_failure`` and ``is_name_mismatch`` classify the same
details for callers that say it in their own words (the gateway, about its trainers).
Certificates and keys are never part of a message.
"""

from __future__ import annotations

import ipaddress

import grpc

# What gRPC's details say when the certificate does not carry the name the channel checks.
_NAME_MISMATCH_NEEDLES = ("Hostname Verification Check failed", "Peer name")
_NAME_MISMATCH = (
    "its certificate does not name {host} (name mismatch): dial a name it carries, or check one "
    "with grpc.ssl_target_name_override (trainwire --server-name)"
)
# (substring of gRPC's details, what it means); the first match wins.
_VERIFY_FAILURES = (
    ("certificate has expired", "its certificate has expired (or is not valid yet)"),
    ("certificate is not yet valid", "its certificate is not valid yet (check the clocks)"),
    *((needle, _NAME_MISMATCH) for needle in _NAME_MISMATCH_NEEDLES),
    (
        "unable to get local issuer certificate",
        "its certificate is signed by an unknown CA: trust the CA that signed it "
        "(root_certificates, trainwire --ca)",
    ),
    (
        "self signed certificate",
        "its certificate is signed by an unknown CA (self-signed): trust the CA that signed it "
        "(root_certificates, trainwire --ca)",
    ),
    (
        "CERTIFICATE_VERIFY_FAILED",
        "its certificate could not be verified against the CA you trust "
        "(root_certificates, trainwire --ca)",
    ),
    (
        "WRONG_VERSION_NUMBER",
        "it does not speak TLS (a plaintext server?): connect without root_certificates "
        "(trainwire: without --ca)",
    ),
)
_CLOSED = ("Socket closed", "Connection reset", "connection reset", "Broken pipe")


def channel_credentials(
    root_certificates: bytes | None,
    certificate_chain: bytes | None,
    private_key: bytes | None,
) -> grpc.ChannelCredentials:
    """TLS channel credentials (``root_certificates`` ``None``: the system's roots).

    Raises:
        ValueError: a certificate chain without its key, or a key without its chain.
    """
    if (certificate_chain is None) != (private_key is None):
        raise ValueError("a client certificate_chain needs its private_key, and the other way")
    return grpc.ssl_channel_credentials(
        root_certificates=root_certificates,
        private_key=private_key,
        certificate_chain=certificate_chain,
    )


def target_host(target: str) -> str:
    """The host of a ``host:port`` target (IPv6 without its brackets)."""
    host = target.rsplit(":", 1)[0] if target.count(":") == 1 or "]" in target else target
    return host.strip("[]") or target


def describe_connection_failure(
    details: str, target: str, *, tls: bool, client_certificate: bool
) -> str | None:
    """One line for people about a connection that failed, or ``None`` when ``details`` (a
    status's details) do not show a TLS problem.

    Args:
        details: The ``UNAVAILABLE`` status's details.
        target: The address dialled.
        tls: Whether the channel used TLS.
        client_certificate: Whether it presented a client certificate.
    """
    if tls:
        for needle, meaning in _VERIFY_FAILURES:
            if needle in details:
                host = target_host(target)
                return f"TLS handshake with {target} failed: " + meaning.format(host=host)
        if any(closed in details for closed in _CLOSED) or "handshake" in details.lower():
            if client_certificate:
                return (
                    f"TLS handshake with {target} failed: it closed the connection; it may not "
                    "accept your client certificate (signed by a CA it does not trust, or "
                    "expired)"
                )
            return (
                f"TLS handshake with {target} failed: it closed the connection; it may require a "
                "client certificate (certificate_chain and private_key; trainwire --cert and "
                "--key)"
            )
        return None
    if any(closed in details for closed in _CLOSED):
        return (
            f"{target} closed the connection at once; if it serves TLS, pass its CA "
            "(root_certificates; trainwire --ca)"
        )
    return None


def is_certificate_failure(details: str) -> bool:
    """Whether a status's details show a certificate that failed verification (retrying will
    not help, unlike a connection that was closed or refused)."""
    return any(needle in details for needle, _ in _VERIFY_FAILURES)


def is_name_mismatch(details: str) -> bool:
    """Whether a status's details show a TLS certificate that does not carry the name the
    channel checked (the target's host, or its ``grpc.ssl_target_name_override``)."""
    return any(needle in details for needle in _NAME_MISMATCH_NEEDLES)


def is_loopback_target(target: str) -> bool:
    """Whether ``target`` (``host:port``) is this machine (a token may go there in
    plaintext)."""
    host = target_host(target)
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False

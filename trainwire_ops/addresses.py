"""Network addresses as both services print and bind them: ``HOST:PORT`` with IPv6 hosts in
brackets (``[::1]:50051``), the form gRPC targets, grpcurl and browsers understand."""

from __future__ import annotations


def bracketed(host: str) -> str:
    """``host`` with brackets if it is an IPv6 address."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def host_port(host: str, port: int) -> str:
    """``HOST:PORT`` (IPv6 hosts bracketed)."""
    return f"{bracketed(host)}:{port}"

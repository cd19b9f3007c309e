"""Network addresses as both services print and bind them: ``HOST:PORT`` with IPv6 hosts in
brackets (``[::1]:50051``), the form gRPC targets, grpcurl and browsers understand."""

from __future__ import annotations

import socket


def bracketed(host: str) -> str:
    """``host`` with brackets if it is an IPv6 address."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def host_port(host: str, port: int) -> str:
    """``HOST:PORT`` (IPv6 hosts bracketed)."""
    return f"{bracketed(host)}:{port}"


def port_problem(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be listened on (``None``: it can), found by binding it a moment
    before the server does: gRPC's own failure is a core log line and a bare error, this is
    one sentence ("address already in use")."""
    if port == 0:
        return None
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        # As gRPC does: a port in TIME_WAIT is free, one with a listener is not.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host.strip("[]"), port))
        except OSError as exc:
            return exc.strerror.lower() if exc.strerror else str(exc)
    return None

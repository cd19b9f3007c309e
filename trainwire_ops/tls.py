"""TLS for both services: the safe-bind rule, certificate files read and checked once, server
credentials that re-read them on SIGHUP without dropping a connection, and client credentials.

- ``check_plaintext_bind``: plaintext only on loopback unless the operator says ``--insecure``.
- ``ServerTls``: a certificate, its key and, for mutual TLS, the CA that signs client
  certificates. ``grpc_credentials`` are dynamic (``grpc.dynamic_ssl_server_credentials``):
  gRPC asks for the current configuration before each new handshake, so ``reload`` changes what
  new connections see while connections already open, and their streams, go on untouched.
  ``ssl_context`` is the same material for the gateway's HTTP side.
- ``ClientTls``: what a caller trusts (a CA) and presents (a client certificate), for channels
  to trainers; ``reload`` re-reads it too.

Nothing here logs or raises the content of a key or certificate: messages name files only.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import ssl
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc

_LOGGER = logging.getLogger(__name__)


class PlaintextRefused(ValueError):
    """A service was asked to serve plaintext on an address other hosts can reach."""


class TlsFileError(ValueError):
    """A certificate, key or CA file that cannot be used (the message names the file, never its
    content)."""


def is_loopback(host: str) -> bool:
    """Whether ``host`` is reachable from this machine only (``127.0.0.0/8``, ``::1``,
    ``localhost``). Wildcards (``0.0.0.0``, ``::``) and other names are not."""
    bare = host.strip().strip("[]")
    if bare.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(bare).is_loopback
    except ValueError:
        return False


def check_plaintext_bind(host: str, *, tls: bool, insecure: bool) -> None:
    """The safe default: plaintext is served on loopback only, unless ``insecure``.

    Raises:
        PlaintextRefused: one line that says why and what to do.
    """
    if tls or insecure or is_loopback(host):
        return
    raise PlaintextRefused(
        f"refusing to serve plaintext on {host}, which other machines can reach: give "
        "--tls-cert FILE --tls-key FILE to serve TLS, or --insecure to serve plaintext knowingly"
    )


def _read(path: Path, what: str) -> bytes:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise TlsFileError(f"cannot read the {what} {path}: {exc.strerror or exc}") from None
    if b"-----BEGIN " not in data:
        raise TlsFileError(f"the {what} {path} is not PEM (no -----BEGIN line)")
    return data


def _ssl_reason(exc: ssl.SSLError) -> str:
    return str(exc.reason or exc.strerror or "not usable").replace("_", " ").lower()


@dataclass(frozen=True, repr=False)
class _Material:
    """The bytes of a certificate chain, its key and a CA (``repr`` shows none of them)."""

    chain: bytes | None
    key: bytes | None
    ca: bytes | None

    def __repr__(self) -> str:
        return "<TLS material>"


def _check_pair(cert: Path, key: Path) -> None:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(cert, key)
    except ssl.SSLError as exc:
        raise TlsFileError(
            f"the certificate {cert} and the key {key} are not a usable pair: {_ssl_reason(exc)}"
        ) from None
    except OSError as exc:
        raise TlsFileError(f"cannot read {cert} or {key}: {exc.strerror or exc}") from None


def _check_ca(ca: bytes, path: Path) -> None:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        context.load_verify_locations(cadata=ca.decode("ascii", "replace"))
    except (ssl.SSLError, ValueError) as exc:
        reason = _ssl_reason(exc) if isinstance(exc, ssl.SSLError) else "no certificate in it"
        raise TlsFileError(f"the CA file {path} is not usable: {reason}") from None


def _load(cert: Path | None, key: Path | None, ca: Path | None) -> _Material:
    chain = _read(cert, "certificate") if cert is not None else None
    private = _read(key, "private key") if key is not None else None
    if cert is not None and key is not None:
        _check_pair(cert, key)
    authority = _read(ca, "CA file") if ca is not None else None
    if authority is not None and ca is not None:
        _check_ca(authority, ca)
    return _Material(chain, private, authority)


class ServerTls:
    """A server's certificate and key and, with ``client_ca``, mutual TLS; re-read by
    ``reload`` (SIGHUP).

    Args:
        cert: PEM certificate chain, the server's certificate first.
        key: Its PEM private key.
        client_ca: PEM CA(s) whose client certificates are accepted; ``None``: clients need no
            certificate.

    Raises:
        TlsFileError: a file is missing, not PEM, or the key does not match the certificate.
    """

    def __init__(self, cert: Path, key: Path, client_ca: Path | None = None) -> None:
        self.cert = Path(cert)
        self.key = Path(key)
        self.client_ca = Path(client_ca) if client_ca is not None else None
        self._lock = threading.Lock()
        self._generation = 0
        self._material = _load(self.cert, self.key, self.client_ca)
        self._config = self._grpc_config(self._material)
        self._http: ssl.SSLContext | None = None  # what new HTTP connections use

    @property
    def mutual(self) -> bool:
        """Whether clients must present a certificate."""
        return self.client_ca is not None

    @staticmethod
    def _grpc_config(material: _Material) -> grpc.ServerCertificateConfiguration:
        assert material.chain is not None and material.key is not None
        return grpc.ssl_server_certificate_configuration(
            [(material.key, material.chain)], root_certificates=material.ca
        )

    def grpc_credentials(self) -> grpc.ServerCredentials:
        """Credentials for ``add_secure_port`` that follow ``reload``: gRPC calls the fetcher
        before every new handshake; it answers the new configuration once after a reload, and
        ``None`` (keep the current one) otherwise."""
        with self._lock:
            seen = self._generation
            initial = self._config

        def fetch() -> grpc.ServerCertificateConfiguration | None:
            nonlocal seen
            with self._lock:
                if seen == self._generation:
                    return None
                seen = self._generation
                return self._config

        return grpc.dynamic_ssl_server_credentials(
            initial, fetch, require_client_authentication=self.mutual
        )

    def _build_ssl_context(self) -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(self.cert, self.key)
        if self.client_ca is not None:
            context.load_verify_locations(cafile=self.client_ca)
            context.verify_mode = ssl.CERT_REQUIRED
        return context

    def ssl_context(self) -> ssl.SSLContext:
        """An ``ssl`` server context of the same files (the gateway's HTTP side) that follows
        ``reload``: each new connection is moved, as its handshake starts (the server-name
        callback, which runs with or without SNI), onto a context built from the files as
        last loaded, so a reload replaces the certificate and the client CAs alike. Open
        connections keep theirs."""
        with self._lock:
            if self._http is None:
                self._http = self._build_ssl_context()
        front = self._build_ssl_context()
        front.sni_callback = self._to_current
        return front

    def _to_current(
        self, connection: ssl.SSLObject, server_name: str | None, context: ssl.SSLContext
    ) -> None:
        current = self._http
        if current is not None:
            connection.context = current

    def reload(self) -> bool:
        """Re-reads the files. New connections get the new certificate (and client CA); open
        ones keep theirs. A bad file is logged and changes nothing.

        Returns:
            Whether the new files are in use.
        """
        try:
            material = _load(self.cert, self.key, self.client_ca)
            config = self._grpc_config(material)
            http = self._build_ssl_context() if self._http is not None else None
        except (TlsFileError, ssl.SSLError, OSError) as exc:
            _LOGGER.error("TLS reload failed; still serving the previous certificate: %s", exc)
            return False
        with self._lock:
            self._material, self._config = material, config
            self._generation += 1
            if http is not None:
                self._http = http
        _LOGGER.info("TLS certificate reloaded from %s (new connections use it)", self.cert)
        return True


@dataclass(frozen=True)
class ClientTlsFiles:
    """What a caller trusts and presents.

    Attributes:
        ca: PEM CA(s) that sign the servers' certificates; ``None``: the system's roots.
        cert: PEM client certificate chain (mutual TLS); ``None``: none.
        key: Its PEM private key.
    """

    ca: Path | None = None
    cert: Path | None = None
    key: Path | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError("a client certificate needs its key, and a key its certificate")

    def credentials(self) -> grpc.ChannelCredentials:
        """Channel credentials of the files as they are now.

        Raises:
            TlsFileError: a file is missing, not PEM, or its key does not match.
        """
        material = _load(self.cert, self.key, self.ca)
        return grpc.ssl_channel_credentials(
            root_certificates=material.ca,
            private_key=material.key,
            certificate_chain=material.chain,
        )


@dataclass
class ClientTls:
    """Channel credentials that ``reload`` re-reads; ``on_change`` hears of new ones (the
    gateway's trainer connector opens new channels with them)."""

    files: ClientTlsFiles
    on_change: list[Callable[[grpc.ChannelCredentials], None]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.current = self.files.credentials()

    def reload(self) -> bool:
        """Re-reads the files; a bad file is logged and changes nothing."""
        try:
            credentials = self.files.credentials()
        except TlsFileError as exc:
            _LOGGER.error("TLS reload failed; keeping the previous client certificate: %s", exc)
            return False
        self.current = credentials
        for callback in self.on_change:
            callback(credentials)
        _LOGGER.info("client TLS files reloaded (%s)", self.files.cert or self.files.ca or "roots")
        return True


def private_file_problem(path: Path) -> str | None:
    """Why a secrets file must not be used as it is (others may read or write it), or
    ``None``."""
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        return f"cannot read {path}: {exc.strerror or exc}"
    if mode & 0o006:
        return (
            f"{path} is readable or writable by every user (mode {mode & 0o777:o}); "
            f"run chmod 600 {path}"
        )
    return None

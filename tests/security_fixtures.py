"""Certificates (made by ``trustme``) and token files for the TLS and auth tests.

``Pki`` writes a CA, a server certificate for ``localhost`` / ``127.0.0.1`` and a client
certificate to a directory, as the files an operator would have; ``Tokens`` makes one token per
role with the real ``add_token`` tool.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import trustme

from gateway.auth import Role
from gateway.tools.add_token import add_token
from tests.fakes.trainer_harness import running_trainer
from tests.fakes.waiting import TIMEOUT
from trainer_service.server import TrainerServer
from trainer_service.testing import FakeProvider
from trainwire_ops.tls import ServerTls

SERVER_NAMES = ("localhost", "127.0.0.1")


@dataclass
class CertFiles:
    """A certificate chain and its key on disk."""

    cert: Path
    key: Path

    def chain(self) -> bytes:
        return self.cert.read_bytes()

    def private_key(self) -> bytes:
        return self.key.read_bytes()


def write_cert(cert: trustme.LeafCert, directory: Path, name: str) -> CertFiles:
    """Writes a leaf certificate's chain and key (mode 600) as ``NAME.pem`` / ``NAME.key``."""
    files = CertFiles(directory / f"{name}.pem", directory / f"{name}.key")
    cert.cert_chain_pems[0].write_to_path(str(files.cert))
    for extra in cert.cert_chain_pems[1:]:
        extra.write_to_path(str(files.cert), append=True)
    cert.private_key_pem.write_to_path(str(files.key))
    files.key.chmod(0o600)
    return files


class Pki:
    """A CA, a server certificate and a client certificate, written under ``directory``.

    Attributes:
        ca: The CA (``ca.issue_cert`` makes more).
        ca_file: Its certificate (PEM).
        server: The server's certificate and key (``localhost``, ``127.0.0.1``).
        client: A client certificate and key (``trainwire-gateway``), for mutual TLS.
    """

    def __init__(self, directory: Path, name: str = "ca") -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.ca = trustme.CA(organization_name=f"Trainwire test {name}")
        self.ca_file = directory / f"{name}.pem"
        self.ca.cert_pem.write_to_path(str(self.ca_file))
        self.server = write_cert(self.ca.issue_cert(*SERVER_NAMES), directory, f"{name}-server")
        self.client = write_cert(
            self.ca.issue_cert("trainwire-gateway"), directory, f"{name}-client"
        )

    def ca_pem(self) -> bytes:
        return self.ca_file.read_bytes()

    def expired_server(self) -> CertFiles:
        """A server certificate that expired in 2020."""
        cert = self.ca.issue_cert(
            *SERVER_NAMES,
            not_before=datetime.datetime(2019, 1, 1, tzinfo=datetime.UTC),
            not_after=datetime.datetime(2020, 1, 1, tzinfo=datetime.UTC),
        )
        return write_cert(cert, self.directory, "expired-server")

    def server_for(self, *names: str, label: str) -> CertFiles:
        """A server certificate for other names (a name mismatch for ``127.0.0.1``)."""
        return write_cert(self.ca.issue_cert(*names), self.directory, label)


@dataclass
class Tokens:
    """A tokens file with one token per role (names ``viewer-v``, ``operator-o``,
    ``admin-a``)."""

    path: Path
    by_role: dict[str, str]

    @classmethod
    def make(cls, path: Path) -> Tokens:
        by_role = {
            role.label: add_token(path, f"{role.label}-{role.label[0]}", role) for role in Role
        }
        return cls(path, by_role)

    def name(self, role: str) -> str:
        return f"{role}-{role[0]}"

    def metadata(self, role: str | None) -> tuple[tuple[str, str], ...] | None:
        """The call metadata of a role's token (``None``: no token)."""
        if role is None:
            return None
        return (("authorization", f"Bearer {self.by_role[role]}"),)

    def all(self) -> list[str]:
        return list(self.by_role.values())


@contextlib.contextmanager
def mtls_trainer(pki: Pki, server: CertFiles | None = None) -> Iterator[tuple[TrainerServer, str]]:
    """A trainer (fake imitation provider) that wants client certificates from ``pki``'s CA;
    it shows ``server`` (default ``pki.server``)."""
    server = server or pki.server
    tls = ServerTls(server.cert, server.key, client_ca=pki.ca_file)
    with running_trainer(
        {"imitation": FakeProvider()},
        slots=2,
        tls=tls,
        warm_up=False,
        wait_idle=False,
        stop_wait=TIMEOUT,
        heartbeat_s=1.0,
    ) as running:
        yield running.server, running.address

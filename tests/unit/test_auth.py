"""Tokens, roles and the add_token tool (``gateway.auth``, ``gateway.tools.add_token``)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from gateway.auth import (
    RPC_ROLES,
    Authenticator,
    Role,
    TokenFileError,
    TokenTable,
    bearer_token,
    required_role,
)
from gateway.core.errors import PermissionDenied, Unauthenticated
from gateway.tools.add_token import main as add_token_main
from trainwire.v1 import gateway_service_pb2

GATEWAY = "trainwire.v1.GatewayService"


def test_every_gateway_rpc_has_a_role_and_the_table_is_the_issues() -> None:
    rpcs = set(gateway_service_pb2.DESCRIPTOR.services_by_name["GatewayService"].methods_by_name)
    assert set(RPC_ROLES) == rpcs
    assert {r for r, role in RPC_ROLES.items() if role is Role.VIEWER} == {
        "GetRun",
        "ListRuns",
        "WatchRun",
        "ListCheckpoints",
        "DownloadCheckpoint",
        "GetRunCurve",
    }
    assert {r for r, role in RPC_ROLES.items() if role is Role.ADMIN} == {"DeleteRun"}
    assert required_role(f"/{GATEWAY}/NewRpcNobodyListed") is Role.ADMIN  # fails safe


def test_health_is_open_and_reflection_needs_a_viewer() -> None:
    assert required_role("/grpc.health.v1.Health/Check") is None
    assert required_role("/grpc.health.v1.Health/Watch") is None
    for version in ("v1alpha", "v1"):
        method = f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo"
        assert required_role(method) is Role.VIEWER


def test_add_token_prints_the_token_once_and_stores_only_its_hash(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "tokens"
    assert add_token_main(["alice", "operator", "--tokens", str(path)]) == 0
    out, err = capsys.readouterr()
    token = out.strip()
    assert token.startswith("tw_") and len(token) > 40 and token not in err
    assert path.stat().st_mode & 0o777 == 0o600
    text = path.read_text()
    assert token not in text
    assert text == f"{hashlib.sha256(token.encode()).hexdigest()} operator alice\n"
    auth = Authenticator(path)
    principal = auth.check(f"Bearer {token}", "m", Role.VIEWER, "peer")
    assert principal.name == "alice" and principal.role is Role.OPERATOR


def test_a_tokens_file_others_can_read_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "tokens"
    assert add_token_main(["alice", "viewer", "--tokens", str(path)]) == 0
    path.chmod(0o644)
    with pytest.raises(TokenFileError, match="chmod 600"):
        Authenticator(path)
    capsys.readouterr()
    assert add_token_main(["bob", "viewer", "--tokens", str(path)]) == 2
    assert "readable or writable by every user" in capsys.readouterr().err
    assert len(path.read_text().splitlines()) == 1


@pytest.mark.parametrize(
    ("text", "complaint"),
    [
        ("abc viewer bob\n", "SHA-256"),
        (f"{'a' * 64} root bob\n", "unknown role"),
        (f"{'a' * 64} viewer\n", "want 'TOKEN_SHA256 ROLE NAME'"),
        (f"{'a' * 64} viewer b\u00f6b\n", "name"),
        (f"{'a' * 64} viewer bob\n{'a' * 64} admin eve\n", "twice"),
    ],
)
def test_malformed_lines_are_refused_by_number(text: str, complaint: str) -> None:
    with pytest.raises(TokenFileError, match=complaint) as refused:
        TokenTable.parse(text)
    assert "line" in str(refused.value) and "a" * 64 not in str(refused.value)


def test_comments_and_blank_lines_are_skipped() -> None:
    table = TokenTable.parse(f"# ops tokens\n\n{'b' * 64} admin root\n")
    assert len(table) == 1


def test_check_refuses_with_the_right_error(tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    add_token_main(["vic", "viewer", "--tokens", str(path)])
    token = next(line for line in path.read_text().splitlines())  # a hash is not a token
    auth = Authenticator(path)
    with pytest.raises(Unauthenticated, match="needs a token"):
        auth.check(None, "ListRuns", Role.VIEWER, "peer")
    with pytest.raises(Unauthenticated, match="not known"):
        auth.check(f"Bearer {token.split()[0]}", "ListRuns", Role.VIEWER, "peer")


def test_permission_denied_names_the_role_needed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "tokens"
    add_token_main(["vic", "viewer", "--tokens", str(path)])
    token = capsys.readouterr().out.strip()
    auth = Authenticator(path)
    with pytest.raises(PermissionDenied, match="needs role operator; token 'vic' has viewer") as e:
        auth.check(f"bearer {token}", "CreateRun", Role.OPERATOR, "peer")
    assert e.value.metadata == {"required_role": "operator"}
    assert token not in str(e.value)


@pytest.mark.parametrize(
    ("header", "token"),
    [(None, None), ("", None), ("Bearer abc", "abc"), ("bearer  abc ", "abc"), ("Basic abc", None)],
)
def test_bearer_token_parsing(header: str | None, token: str | None) -> None:
    assert bearer_token(header) == token

"""The grpcurl lines of the deployment guide (docs/guides/deployment.md), run as written with
the real grpcurl against a TLS + token gateway and a trainer that wants client certificates
(host names and file names replaced by the test's own)."""

from __future__ import annotations

import asyncio
import json
import re
import shlex
import subprocess
from pathlib import Path

from gateway.config import GatewayConfig
from gateway.server import Gateway
from tests.grpcurl_helpers import grpcurl_path
from tests.security_fixtures import Pki, Tokens, mtls_trainer

ROOT = Path(__file__).resolve().parents[2]


def guide_grpcurl_lines() -> list[str]:
    """The grpcurl commands of the guide, continuation lines joined."""
    text = (ROOT / "docs" / "guides" / "deployment.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    commands = []
    for block in blocks:
        for command in block.replace("\\\n", " ").splitlines():
            if command.strip().startswith("grpcurl "):
                commands.append(command.strip())
    return commands


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=60, check=False, stdin=subprocess.DEVNULL
    )


async def test_the_guide_grpcurl_lines_work_against_tls_and_tokens(tmp_path: Path) -> None:
    lines = guide_grpcurl_lines()
    assert len(lines) == 4 and all("-cacert" in line for line in lines)
    assert any("-cert" in line and "-key" in line for line in lines)
    assert any("authorization: Bearer" in line for line in lines)
    pki = Pki(tmp_path)
    tokens = Tokens.make(tmp_path / "tokens")
    with mtls_trainer(pki) as (_, trainer):
        gateway = Gateway(
            GatewayConfig(
                port=0,
                trainers=(trainer,),
                db=":memory:",
                shutdown_grace_s=0.5,
                tls_cert=str(pki.server.cert),
                tls_key=str(pki.server.key),
                trainer_ca=str(pki.ca_file),
                trainer_cert=str(pki.client.cert),
                trainer_key=str(pki.client.key),
                auth_tokens=str(tokens.path),
            )
        )
        port = await gateway.start()
        replace = {
            "ca.pem": str(pki.ca_file),
            "gateway-client.pem": str(pki.client.cert),
            "gateway-client.key": str(pki.client.key),
            "gateway.example:50051": f"127.0.0.1:{port}",
            "trainer.example:50052": trainer,
        }
        token = tokens.by_role["viewer"]
        try:
            for line in lines:
                argv = [
                    replace.get(word, word.replace("$TOKEN", token)) for word in shlex.split(line)
                ]
                argv[0] = grpcurl_path()
                done = await asyncio.to_thread(_run, [*argv[:1], "-max-time", "20", *argv[1:]])
                assert done.returncode == 0, (line, done.stderr)
                if line.endswith(" list"):
                    assert "trainwire.v1.GatewayService" in done.stdout.split()
                elif "ListRuns" in line:
                    assert json.loads(done.stdout or "{}") == {}
                elif "GetCapabilities" in line:
                    assert "imitation" in json.loads(done.stdout)["providers"]
                else:
                    assert "status" in json.loads(done.stdout)
            # Reflection needs a viewer's token; without one grpcurl is turned away.
            anonymous = [grpcurl_path(), "-max-time", "20", "-cacert", str(pki.ca_file),
                         f"127.0.0.1:{port}", "list"]  # fmt: skip
            done = await asyncio.to_thread(_run, anonymous)
            assert done.returncode != 0 and "Unauthenticated" in done.stderr
            assert token not in done.stderr
        finally:
            await gateway.stop()

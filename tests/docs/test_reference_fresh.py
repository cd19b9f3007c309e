"""docs/reference is exactly what `make docs` (scripts/gen_docs.py) renders from the code today,
whatever the environment, and its tables cover every flag, variable and RPC."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "docs" / "reference"


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "scripts" / "gen_docs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gen_docs", module)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def rendered() -> dict[str, str]:
    return dict(_generator().render())


def test_reference_docs_are_fresh(rendered: dict[str, str]) -> None:
    assert set(rendered) == {
        "cli.md",
        "gateway-config.md",
        "trainer-config.md",
        "protocol.md",
        "roles.md",
    }
    missing = [name for name in rendered if not (REFERENCE / name).is_file()]
    assert not missing, f"missing {missing} in docs/reference: run `make docs` and commit"
    stale = [name for name, text in rendered.items() if (REFERENCE / name).read_text() != text]
    assert not stale, f"stale docs/reference/{stale}: run `make docs` and commit; never hand-edit"


def test_rendering_ignores_the_environment(
    rendered: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in {
        "TRAINWIRE_GATEWAY": "elsewhere:1",
        "TRAINWIRE_TOKEN": "secret",
        "TRAINWIRE_GATEWAY_PORT": "1234",
        "TRAINWIRE_TRAINER_DATA_ROOT": "/a:/b",
        "TRAINWIRE_IMAGE_CACHE_DIR": "/cache",
        "COLUMNS": "40",
    }.items():
        monkeypatch.setenv(name, value)
    again = _generator().render()
    assert again == rendered
    assert "secret" not in "".join(again.values())


def test_the_service_references_list_every_flag_with_its_variable(
    rendered: dict[str, str],
) -> None:
    from gateway.__main__ import build_parser as gateway_parser
    from trainer_service.__main__ import build_parser as trainer_parser

    for name, parser, prefix in (
        ("gateway-config.md", gateway_parser({}), "TRAINWIRE_GATEWAY_"),
        ("trainer-config.md", trainer_parser({}), "TRAINWIRE_TRAINER_"),
    ):
        text = rendered[name]
        flags = [a for a in parser._actions if a.option_strings and a.dest != "help"]
        assert len(flags) > 10, name
        for action in flags:
            (flag,) = action.option_strings
            variable = prefix + flag.lstrip("-").replace("-", "_").upper()
            rows = [row for row in text.splitlines() if re.match(rf"\| `{flag}[ `]", row)]
            assert len(rows) == 1, (name, flag)
            assert f"`{variable}`" in rows[0], (name, flag, variable)
            # The default the service's own --help states is the one the table states.
            assert action.help is not None
            default = action.help.rsplit("(default: ", 1)[1].split("; env ")[0]
            cell = f"`{default}`" if default else "none"  # an empty list: none
            assert f"| {cell} |" in rows[0], (name, flag, default)


def test_the_roles_table_has_every_gateway_rpc_with_the_role_auth_requires(
    rendered: dict[str, str],
) -> None:
    from gateway.auth import GATEWAY_SERVICE, RPC_ROLES, required_role
    from trainwire.v1 import gateway_service_pb2

    methods = gateway_service_pb2.DESCRIPTOR.services_by_name["GatewayService"].methods
    names = [m.name for m in methods]
    assert {
        "ListCheckpoints",
        "DownloadCheckpoint",
        "GetRunCurve",
        "UpdateRun",
        "SetRunHyperparameters",
    } <= set(names)
    assert set(RPC_ROLES) == set(names), "an RPC without an explicit role in gateway/auth.py"
    rows = {
        line.split("`")[1]: line
        for line in rendered["roles.md"].splitlines()
        if line.startswith("| `")
    }
    assert list(rows) == names
    for name in names:
        role = required_role(f"/{GATEWAY_SERVICE}/{name}")
        assert role is not None
        cells = [cell.strip() for cell in rows[name].split(" | ")]
        assert cells[1] == role.label, name
        assert cells[2:5] == ["yes" if level >= role else "no" for level in type(role)], name


def test_the_protocol_reference_documents_every_rpc_and_message(
    rendered: dict[str, str],
) -> None:
    from trainwire.v1 import episode_pb2, gateway_service_pb2, trainer_service_pb2

    text = rendered["protocol.md"]
    for module in (episode_pb2, gateway_service_pb2, trainer_service_pb2):
        for service in module.DESCRIPTOR.services_by_name.values():
            for method in service.methods:
                assert f"#### {service.name}.{method.name}\n" in text
        for message in module.DESCRIPTOR.message_types_by_name.values():
            assert f"### message {message.name}\n" in text
    assert "episode.proto" not in rendered["cli.md"]

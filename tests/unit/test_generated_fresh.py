"""The committed generated code is exactly what `make gen` produces from protos/ today."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _load_generator():
    spec = importlib.util.spec_from_file_location("gen_protos", ROOT / "scripts" / "gen_protos.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gen_protos", module)
    spec.loader.exec_module(module)
    return module


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    gen = _load_generator()
    fresh = gen.generate(tmp_path)
    committed_dir = ROOT / "clients" / "trainwire" / "v1"
    committed = sorted(
        p for p in committed_dir.iterdir() if p.name.endswith(gen.GENERATED_SUFFIXES)
    )
    assert [p.name for p in fresh] == [p.name for p in committed], (
        "generated file set differs from clients/trainwire/v1: run `make gen` and commit"
    )
    stale = [p.name for p in fresh if p.read_bytes() != (committed_dir / p.name).read_bytes()]
    assert not stale, f"stale generated files {stale}: run `make gen` and commit; never hand-edit"


def test_every_proto_is_generated() -> None:
    gen = _load_generator()
    names = {p.stem for p in gen.proto_files()}
    assert names == {"episode", "trainer_service", "gateway_service"}


def _client_requirements() -> dict[str, str]:
    import tomllib

    project = tomllib.loads((ROOT / "clients" / "pyproject.toml").read_text())["project"]
    found = {}
    for spec in project["dependencies"]:
        name, _, rest = spec.partition(">=")
        found[name.strip()] = rest.split(",")[0].strip()
    return found


def test_the_client_range_starts_where_the_generated_code_does() -> None:
    """The lower bounds of clients/pyproject.toml are the generator's versions: a newer
    generator without a new floor would publish code that refuses the floor at import."""
    gen = _load_generator()
    floors = _client_requirements()
    v1 = ROOT / "clients" / "trainwire" / "v1"
    grpc_code = (v1 / "gateway_service_pb2_grpc.py").read_text()
    assert f"GRPC_GENERATED_VERSION = '{gen.pinned('grpcio-tools')}'" in grpc_code
    assert floors["grpcio"] == floors["grpcio-status"] == gen.pinned("grpcio-tools")
    pb2 = (v1 / "gateway_service_pb2.py").read_text()
    assert f"# Protobuf Python Version: {floors['protobuf']}\n" in pb2

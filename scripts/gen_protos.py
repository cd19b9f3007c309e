"""Regenerates the Python code of the contract from protos/ (``make gen``).

The generated ``*_pb2.py``, ``*_pb2_grpc.py`` and their ``.pyi`` stubs (mypy-protobuf, the gRPC
stubs' too) are committed under ``clients/trainwire/v1``; ``tests/unit/test_generated_fresh.py``
regenerates them into a temporary directory with this same function and asserts byte-identical
output.

The generator runs in its own pinned venv (``.venv/gen``, from ``scripts/gen-requirements.txt``,
built by ``make install``): the client package supports a range of grpcio and protobuf, so its
code comes from the oldest toolchain of that range, which the services' venv cannot hold. Nothing
here needs the network.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
PROTO_PACKAGE = Path("trainwire/v1")
OUT_ROOT = ROOT / "clients"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi")
REQUIREMENTS = ROOT / "scripts" / "gen-requirements.txt"
#: The generator's python; ``TRAINWIRE_GEN_PYTHON`` overrides it (``make gen`` sets it).
DEFAULT_GEN_PYTHON = ROOT / ".venv" / "gen" / "bin" / "python"


class ToolchainMissing(RuntimeError):
    """The generator venv is missing or does not hold the pinned toolchain."""


def gen_python() -> Path:
    """The python of the generator venv."""
    return Path(os.environ.get("TRAINWIRE_GEN_PYTHON", DEFAULT_GEN_PYTHON))


def pinned(name: str) -> str:
    """The version ``scripts/gen-requirements.txt`` pins ``name`` to."""
    for line in REQUIREMENTS.read_text().splitlines():
        spec = line.split("#", 1)[0].strip()
        if spec.lower().startswith(f"{name.lower()}=="):
            return spec.split("==", 1)[1]
    raise KeyError(name)


def check_toolchain(python: Path) -> None:
    """Raises ``ToolchainMissing`` unless ``python`` has the pinned grpcio-tools and
    mypy-protobuf."""
    if not python.exists():
        raise ToolchainMissing(f"no generator venv at {python.parent.parent}: run `make install`")
    probe = (
        "from importlib.metadata import version; "
        "print(version('grpcio-tools'), version('mypy-protobuf'))"
    )
    found = subprocess.run(
        [str(python), "-c", probe], capture_output=True, text=True, timeout=60, check=False
    )
    want = f"{pinned('grpcio-tools')} {pinned('mypy-protobuf')}"
    if found.returncode != 0 or found.stdout.split() != want.split():
        raise ToolchainMissing(
            f"{python} holds grpcio-tools/mypy-protobuf {found.stdout.strip() or '?'}, "
            f"not {want}: run `make install`"
        )


def proto_files(proto_root: Path = PROTO_ROOT) -> list[Path]:
    """Returns the contract's .proto files, relative to the proto root, sorted."""
    return sorted(p.relative_to(proto_root) for p in (proto_root / PROTO_PACKAGE).glob("*.proto"))


def generate(out_root: Path, proto_root: Path = PROTO_ROOT) -> list[Path]:
    """Generates the contract's Python modules under ``out_root/trainwire/v1``.

    Old generated files there are deleted first, so a removed .proto leaves nothing behind.

    Returns:
        The generated files, sorted.
    """
    python = gen_python()
    check_toolchain(python)
    bin_dir = python.parent
    out_dir = out_root / PROTO_PACKAGE
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.iterdir():
        if old.name.endswith(GENERATED_SUFFIXES):
            old.unlink()
    well_known = subprocess.run(
        [
            str(python),
            "-c",
            "import grpc_tools, os; print(os.path.join(os.path.dirname(grpc_tools.__file__), "
            "'_proto'))",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.strip()
    args = [
        str(python),
        "-m",
        "grpc_tools.protoc",
        f"-I{proto_root}",
        f"-I{well_known}",
        f"--plugin=protoc-gen-mypy={bin_dir / 'protoc-gen-mypy'}",
        f"--plugin=protoc-gen-mypy_grpc={bin_dir / 'protoc-gen-mypy_grpc'}",
        f"--python_out={out_root}",
        f"--grpc_python_out={out_root}",
        f"--mypy_out={out_root}",
        f"--mypy_grpc_out={out_root}",
        *(str(p) for p in proto_files(proto_root)),
    ]
    done = subprocess.run(args, capture_output=True, text=True, timeout=300, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}\n{done.stderr}")
    return sorted(p for p in out_dir.iterdir() if p.name.endswith(GENERATED_SUFFIXES))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--out", type=Path, default=OUT_ROOT, help="root to generate under (default: clients/)"
    )
    parser.add_argument(
        "--protos", type=Path, default=PROTO_ROOT, help="proto root (default: protos/)"
    )
    args = parser.parse_args(argv)
    try:
        files = generate(args.out, args.protos)
    except ToolchainMissing as exc:
        print(f"gen_protos: {exc}", file=sys.stderr)
        return 2
    for f in files:
        print(f.relative_to(args.out))
    if shutil.which("buf") is None:
        print("note: buf not on PATH; run `make lint` for buf lint", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

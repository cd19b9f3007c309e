"""Regenerates the Python code of the contract from protos/ (``make gen``).

The generated ``*_pb2.py``, ``*_pb2.pyi`` and ``*_pb2_grpc.py`` files are committed under
``clients/trainwire/v1``; ``tests/unit/test_generated_fresh.py`` regenerates them into a temporary
directory with this same function and asserts byte-identical output.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
PROTO_PACKAGE = Path("trainwire/v1")
OUT_ROOT = ROOT / "clients"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def proto_files() -> list[Path]:
    """Returns the contract's .proto files, relative to the proto root, sorted."""
    return sorted(p.relative_to(PROTO_ROOT) for p in (PROTO_ROOT / PROTO_PACKAGE).glob("*.proto"))


def generate(out_root: Path) -> list[Path]:
    """Generates the contract's Python modules under ``out_root/trainwire/v1``.

    Old generated files there are deleted first, so a removed .proto leaves nothing behind.

    Returns:
        The generated files, sorted.
    """
    from grpc_tools import protoc  # imported lazily: only the generator needs grpcio-tools

    out_dir = out_root / PROTO_PACKAGE
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.iterdir():
        if old.name.endswith(GENERATED_SUFFIXES):
            old.unlink()
    well_known = Path(protoc.__file__).resolve().parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *(str(p) for p in proto_files()),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    return sorted(p for p in out_dir.iterdir() if p.name.endswith(GENERATED_SUFFIXES))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--out", type=Path, default=OUT_ROOT, help="root to generate under (default: clients/)"
    )
    args = parser.parse_args(argv)
    files = generate(args.out)
    for f in files:
        print(f.relative_to(args.out))
    if shutil.which("buf") is None:
        print("note: buf not on PATH; run `make lint` for buf lint", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

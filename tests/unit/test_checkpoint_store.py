"""The checkpoint store over a local directory: round trips, the canonical tar and its digest,
what is invisible (directories without a commit marker), corruption and an unusable store."""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
from pathlib import Path

import pytest

from trainwire_ops.checkpoints import (
    CheckpointCorrupt,
    CheckpointError,
    CheckpointMissing,
    CheckpointStore,
    CheckpointStoreProblem,
    CheckpointWriteFailed,
)

LONG_NAME = "deep/" + "x" * 120 + "/" + "y" * 90 + ".bin"


def make_checkpoint(directory: Path, seed: int = 0) -> dict[str, bytes]:
    """Writes a few files (nested, empty, long-named, larger than a chunk) and returns them."""
    files = {
        "model.safetensors": bytes((seed + i) % 251 for i in range(3 * 1024 + 7)),
        "checkpoint.json": b'{"episode": 5}',
        "state/optimizer.pt": os.urandom(2500) if seed < 0 else b"o" * 2500,
        "state/empty": b"",
        LONG_NAME: b"long path",
    }
    for name, data in files.items():
        path = directory / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return files


def read_tree(directory: Path) -> dict[str, bytes]:
    return {
        path.relative_to(directory).as_posix(): path.read_bytes()
        for path in directory.rglob("*")
        if path.is_file()
    }


@pytest.fixture
def store(tmp_path: Path) -> CheckpointStore:
    return CheckpointStore(str(tmp_path / "store"))


def test_round_trip(store: CheckpointStore, tmp_path: Path) -> None:
    files = make_checkpoint(tmp_path / "local")
    info = store.put("run-1", 5, tmp_path / "local", {"best_reward": 0.75, "kind": "imitation"})
    assert info.episode == 5
    assert info.best_reward == 0.75
    assert store.info("run-1", 5) == info
    assert store.episodes("run-1") == [5]
    assert store.meta("run-1", 5)["kind"] == "imitation"  # type: ignore[index]
    assert read_tree(tmp_path / "local") == files  # put leaves the source as it was

    got = store.fetch("run-1", 5, tmp_path / "back", info.sha256)
    assert got == info
    assert read_tree(tmp_path / "back") == files


def test_digest_is_that_of_the_canonical_tar(store: CheckpointStore, tmp_path: Path) -> None:
    files = make_checkpoint(tmp_path / "local")
    info = store.put("run-1", 7, tmp_path / "local", {})
    chunks = list(store.tar_chunks("run-1", 7, chunk_size=1000))
    assert all(len(chunk) == 1000 for chunk in chunks[:-1])
    data = b"".join(chunks)
    assert hashlib.sha256(data).hexdigest() == info.sha256
    assert len(data) == info.size_bytes
    assert len(data) % tarfile.RECORDSIZE == 0

    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as archive:
        members = archive.getmembers()
        assert [m.name for m in members] == sorted(files)
        for member in members:
            assert member.isreg()
            assert (member.mode, member.uid, member.gid, member.mtime) == (0o644, 0, 0, 0)
            assert (member.uname, member.gname) == ("", "")
            extracted = archive.extractfile(member)
            assert extracted is not None
            assert extracted.read() == files[member.name]

    # tarfile writing the same members the same way gives the same bytes.
    again = io.BytesIO()
    with tarfile.open(fileobj=again, mode="w:", format=tarfile.PAX_FORMAT) as archive:
        for name in sorted(files):
            member = tarfile.TarInfo(name)
            member.size = len(files[name])
            member.mode = 0o644
            archive.addfile(member, io.BytesIO(files[name]))
    assert again.getvalue() == data


def test_same_files_same_digest(store: CheckpointStore, tmp_path: Path) -> None:
    make_checkpoint(tmp_path / "a")
    make_checkpoint(tmp_path / "b")
    os.utime(tmp_path / "b" / "model.safetensors", (1, 1))
    (tmp_path / "b" / "checkpoint.json").chmod(0o600)
    first = store.put("run-1", 1, tmp_path / "a", {})
    second = store.put("run-2", 1, tmp_path / "b", {})
    assert (first.sha256, first.size_bytes) == (second.sha256, second.size_bytes)
    (tmp_path / "b" / "checkpoint.json").write_bytes(b'{"episode": 6}')
    assert store.put("run-2", 2, tmp_path / "b", {}).sha256 != first.sha256


def test_replacing_a_checkpoint(store: CheckpointStore, tmp_path: Path) -> None:
    make_checkpoint(tmp_path / "a", seed=1)
    store.put("run-1", 3, tmp_path / "a", {})
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "only").write_bytes(b"new")
    info = store.put("run-1", 3, tmp_path / "b", {})
    store.fetch("run-1", 3, tmp_path / "back", info.sha256)
    assert read_tree(tmp_path / "back") == {"only": b"new"}


def test_directories_without_a_marker_are_invisible(store: CheckpointStore, tmp_path: Path) -> None:
    make_checkpoint(tmp_path / "local")
    info = store.put("run-1", 10, tmp_path / "local", {})
    store.put("run-1", 20, tmp_path / "local", {})
    root = tmp_path / "store" / "run-1"
    # A write that died before its marker (and a staging directory left by a crash).
    (root / f"{20:012d}.json").unlink()
    (root / f"{30:012d}").mkdir()
    (root / f"{30:012d}" / "model.safetensors").write_bytes(b"half")
    (root / ".staging-000000000040-abc").mkdir()

    assert store.episodes("run-1") == [10]
    assert store.info("run-1", 20) is None
    assert store.info("run-1", 30) is None
    with pytest.raises(CheckpointMissing, match="episode 20"):
        store.fetch("run-1", 20, tmp_path / "back", info.sha256)
    with pytest.raises(CheckpointMissing):
        next(store.tar_chunks("run-1", 30))
    assert store.episodes("nobody") == []


def test_corrupt_file_is_detected(store: CheckpointStore, tmp_path: Path) -> None:
    make_checkpoint(tmp_path / "local")
    info = store.put("run-1", 4, tmp_path / "local", {})
    stored = tmp_path / "store" / "run-1" / f"{4:012d}" / "model.safetensors"
    data = bytearray(stored.read_bytes())
    data[100] ^= 0xFF  # bit rot, same size
    stored.write_bytes(bytes(data))

    with pytest.raises(CheckpointCorrupt, match="digest mismatch") as caught:
        store.fetch("run-1", 4, tmp_path / "back", info.sha256)
    assert isinstance(caught.value, CheckpointError)
    assert "run 'run-1' at episode 4" in str(caught.value)
    assert list((tmp_path / "back").iterdir()) == []  # nothing half-fetched is left

    stored.write_bytes(b"truncated")  # a partial upload: size differs
    with pytest.raises(CheckpointCorrupt):
        store.fetch("run-1", 4, tmp_path / "back2", info.sha256)


def test_fetch_checks_the_callers_digest(store: CheckpointStore, tmp_path: Path) -> None:
    make_checkpoint(tmp_path / "local")
    store.put("run-1", 4, tmp_path / "local", {})
    with pytest.raises(CheckpointCorrupt, match="digest mismatch"):
        store.fetch("run-1", 4, tmp_path / "back", "0" * 64)


def test_missing_file_is_detected(store: CheckpointStore, tmp_path: Path) -> None:
    make_checkpoint(tmp_path / "local")
    info = store.put("run-1", 4, tmp_path / "local", {})
    (tmp_path / "store" / "run-1" / f"{4:012d}" / "checkpoint.json").unlink()
    with pytest.raises(CheckpointCorrupt):
        store.fetch("run-1", 4, tmp_path / "back", info.sha256)


def test_delete_and_delete_run(store: CheckpointStore, tmp_path: Path) -> None:
    make_checkpoint(tmp_path / "local")
    for episode in (1, 2, 3):
        store.put("run-1", episode, tmp_path / "local", {})
    store.put("run-2", 1, tmp_path / "local", {})
    store.delete("run-1", 2)
    store.delete("run-1", 2)  # idempotent
    assert store.episodes("run-1") == [1, 3]
    assert not (tmp_path / "store" / "run-1" / f"{2:012d}").exists()
    store.delete_run("run-1")
    store.delete_run("run-1")
    assert store.episodes("run-1") == []
    assert not (tmp_path / "store" / "run-1").exists()
    assert store.episodes("run-2") == [1]


def test_check_passes_and_leaves_nothing(tmp_path: Path) -> None:
    store = CheckpointStore(f"file://{tmp_path}/fresh/store")
    store.check()
    assert list((tmp_path / "fresh" / "store").iterdir()) == []


def test_unwritable_store_is_one_line(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    store = CheckpointStore(str(blocker / "checkpoints"))
    with pytest.raises(CheckpointStoreProblem) as caught:
        store.check()
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"checkpoint store {blocker / 'checkpoints'}: cannot ")


def test_put_failure_names_the_checkpoint(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    make_checkpoint(tmp_path / "local")
    store = CheckpointStore(str(blocker))
    with pytest.raises(CheckpointWriteFailed) as caught:
        store.put("run-1", 9, tmp_path / "local", {})
    assert "run 'run-1' at episode 9" in str(caught.value)
    assert "\n" not in str(caught.value)


def test_relative_default_resolves_against_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    store = CheckpointStore()
    (tmp_path / "local").mkdir()
    (tmp_path / "local" / "f").write_bytes(b"1")
    store.put("run-1", 1, tmp_path / "local", {})
    assert (tmp_path / "var" / "checkpoints" / "run-1" / f"{1:012d}.json").is_file()

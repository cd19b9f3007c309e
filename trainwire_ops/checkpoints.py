"""The checkpoint store: complete checkpoints of runs, in a local (or shared) directory or an
object store, shared by the trainers that write them and the gateway that lists, serves and
deletes them.

Layout under the store's root (``CheckpointStore(url)``)::

    {run_id}/{episode:012d}/<the checkpoint's files, as the provider wrote them>
    {run_id}/{episode:012d}.json      # the commit marker, written last

A checkpoint exists only once its marker does: a directory without one (a write that died, an
upload in progress) is never reported, listed or fetched. The marker holds the checkpoint's
record (``sha256``, ``size_bytes``, ``create_time_ns``) and what its writer added (the best
reward, the provider's kind, the task).

The record's digest and size are those of the checkpoint's *canonical tar*, the uncompressed
POSIX tar that ``DownloadCheckpoint`` streams: regular files only, members sorted by their
relative path, mode 0644, owner 0:0 with empty names, mtime 0, PAX format for long paths, the
end-of-archive blocks padded to a record as :mod:`tarfile` pads them. The same files give the
same digest wherever they are stored; one generator (:func:`_canonical_tar`) builds the tar
for :meth:`CheckpointStore.put` (the digest while uploading), :meth:`CheckpointStore.tar_chunks`
(the download) and :meth:`CheckpointStore.fetch` (the check while downloading).

Everything streams in bounded chunks: memory stays flat in checkpoint size. The API blocks;
callers on an event loop run it in a thread. URLs: a directory path (relative to the working
directory), ``file://...`` or ``s3://bucket/prefix`` (through ``s3fs``; the endpoint comes from
``AWS_ENDPOINT_URL`` when set, credentials from the usual AWS variables). Writes to a local
directory are atomic (a staging directory renamed into place); on an object store the marker
written last is what makes a checkpoint appear.

This module imports fsspec (and s3fs for ``s3://``), never grpc, torch or either service.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import tarfile
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO, Any, Protocol

import fsspec

__all__ = [
    "DEFAULT_STORE",
    "CheckpointCorrupt",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointMissing",
    "CheckpointStore",
    "CheckpointStoreProblem",
    "CheckpointWriteFailed",
    "canonical_tar",
    "canonical_tar_digest",
]

#: The store both services use unless told otherwise (relative to the working directory).
DEFAULT_STORE = "var/checkpoints"

_CHUNK = 1 << 20
_MARKER = re.compile(r"^(\d{12})\.json$")
_MARKER_FORMAT = 1


class CheckpointStoreProblem(Exception):
    """The store cannot be used at all (unreachable, unwritable); ``str()`` is one line naming
    the store and the problem, fit for a service's exit message."""


class CheckpointError(Exception):
    """A checkpoint could not be read or written; ``str()`` names it and says why.

    Attributes:
        run_id: The run the checkpoint belongs to.
        episode: Its episode.
    """

    def __init__(self, run_id: str, episode: int, why: str) -> None:
        super().__init__(f"checkpoint of run {run_id!r} at episode {episode}: {why}")
        self.run_id = run_id
        self.episode = episode
        self.why = why


class CheckpointMissing(CheckpointError):
    """The checkpoint is not in the store (no marker, or files gone)."""


class CheckpointCorrupt(CheckpointError):
    """The checkpoint's bytes do not match its record (bit rot, a partial upload)."""


class CheckpointWriteFailed(CheckpointError):
    """Writing the checkpoint failed (disk full, store unreachable); nothing was recorded."""


@dataclass(frozen=True)
class CheckpointInfo:
    """A complete checkpoint's record, as its commit marker holds it.

    Attributes:
        episode: The episode it was taken after.
        create_time_ns: When it was complete, nanoseconds since the epoch.
        size_bytes: Size of its canonical tar.
        sha256: Hex SHA-256 of its canonical tar.
        best_reward: The running maximum of the reward through ``episode``, when the writer
            recorded it.
    """

    episode: int
    create_time_ns: int
    size_bytes: int
    sha256: str
    best_reward: float | None = None


class _Readable(Protocol):
    def read(self, size: int = -1, /) -> bytes: ...


@dataclass(frozen=True)
class _Member:
    """One file of a checkpoint: its path relative to the checkpoint (posix) and size."""

    path: str
    size: int


def _header(member: _Member) -> bytes:
    info = tarfile.TarInfo(member.path)
    info.size = member.size
    info.mode = 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.mtime = 0
    info.type = tarfile.REGTYPE
    return info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")


def _end_of_archive(size: int) -> bytes:
    """Two zero blocks, then zeros up to the next record boundary (as ``tarfile`` closes)."""
    size += 2 * tarfile.BLOCKSIZE
    tail = 2 * tarfile.BLOCKSIZE
    remainder = size % tarfile.RECORDSIZE
    if remainder:
        tail += tarfile.RECORDSIZE - remainder
    return bytes(tail)


def _canonical_tar(
    members: Sequence[_Member],
    open_member: Callable[[str], contextlib.AbstractContextManager[_Readable]],
    chunk_size: int = _CHUNK,
) -> Iterator[bytes]:
    """The canonical tar of ``members`` (sorted by the caller), read through ``open_member``.

    Raises:
        OSError: A member's bytes are not ``member.size`` long (it changed while read).
    """
    offset = 0
    for member in members:
        header = _header(member)
        offset += len(header)
        yield header
        with open_member(member.path) as source:
            left = member.size
            while left:
                chunk = source.read(min(chunk_size, left))
                if not chunk:
                    raise OSError(f"{member.path} is shorter than its {member.size} bytes")
                left -= len(chunk)
                offset += len(chunk)
                yield chunk
        pad = -member.size % tarfile.BLOCKSIZE
        if pad:
            offset += pad
            yield bytes(pad)
    yield _end_of_archive(offset)


def _rechunk(pieces: Iterator[bytes], chunk_size: int) -> Iterator[bytes]:
    """Regroups ``pieces`` into chunks of ``chunk_size`` bytes (the last may be shorter)."""
    buffer = bytearray()
    for piece in pieces:
        buffer += piece
        while len(buffer) >= chunk_size:
            yield bytes(buffer[:chunk_size])
            del buffer[:chunk_size]
    if buffer:
        yield bytes(buffer)


class _Tee:
    """A readable file that copies what is read from ``source`` into ``sink``."""

    def __init__(self, source: IO[bytes], sink: IO[bytes]) -> None:
        self._source = source
        self._sink = sink

    def read(self, size: int = -1) -> bytes:
        data = self._source.read(size)
        if data:
            self._sink.write(data)
        return data


def _one_line(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return " ".join(text.split())


def _local_members(directory: Path) -> list[_Member]:
    """The regular files under ``directory`` (symlinks and special files left out), sorted."""
    members = []
    for dirpath, dirnames, filenames in os.walk(directory):
        dirnames.sort()
        for name in filenames:
            path = Path(dirpath, name)
            if path.is_symlink() or not path.is_file():
                continue
            relative = path.relative_to(directory).as_posix()
            members.append(_Member(relative, path.stat().st_size))
    members.sort(key=lambda member: member.path)
    return members


def canonical_tar(directory: Path, chunk_size: int = _CHUNK) -> Iterator[bytes]:
    """The canonical tar of the regular files under a local ``directory`` (what a checkpoint of
    those files would be recorded and downloaded as), in ``chunk_size`` chunks.

    Raises:
        OSError: A file changed size while read.
    """
    members = _local_members(Path(directory))

    def open_member(relative: str) -> contextlib.AbstractContextManager[IO[bytes]]:
        return open(Path(directory) / relative, "rb")

    yield from _rechunk(_canonical_tar(members, open_member, chunk_size), chunk_size)


def canonical_tar_digest(directory: Path) -> tuple[str, int]:
    """The hex SHA-256 and size of :func:`canonical_tar` of ``directory``."""
    digest = hashlib.sha256()
    size = 0
    for chunk in canonical_tar(directory):
        digest.update(chunk)
        size += len(chunk)
    return digest.hexdigest(), size


class CheckpointStore:
    """Checkpoints of runs in a directory or an object store (see the module docstring).

    Args:
        url: A directory path (relative to the working directory), ``file://...`` or
            ``s3://bucket/prefix``.

    Attributes:
        location: The store as given, for messages.
    """

    def __init__(self, url: str = DEFAULT_STORE) -> None:
        self.location = url
        options: dict[str, Any] = {}
        if url.startswith("s3://"):
            # Listings are not cached: another process (a trainer, a replica) writes the store.
            options["use_listings_cache"] = False
            options["skip_instance_cache"] = True
            endpoint = os.environ.get("AWS_ENDPOINT_URL")
            if endpoint:
                options["client_kwargs"] = {"endpoint_url": endpoint}
        fs, root = fsspec.core.url_to_fs(url, **options)
        self._fs: fsspec.AbstractFileSystem = fs
        self._local = "file" in _protocols(fs)
        if self._local:
            root = str(Path(root).resolve())
        self._root = root.rstrip("/") or "/"

    def __repr__(self) -> str:
        return f"CheckpointStore({self.location!r})"

    # -- paths -------------------------------------------------------------------------------

    def _run_path(self, run_id: str) -> str:
        if not run_id or "/" in run_id or run_id in {".", ".."}:
            raise ValueError(f"not a run id for a checkpoint path: {run_id!r}")
        return f"{self._root}/{run_id}"

    def _dir(self, run_id: str, episode: int) -> str:
        return f"{self._run_path(run_id)}/{episode:012d}"

    def _marker(self, run_id: str, episode: int) -> str:
        return f"{self._dir(run_id, episode)}.json"

    # -- start-up ----------------------------------------------------------------------------

    def check(self) -> None:
        """Writes, reads back and deletes a probe object.

        Raises:
            CheckpointStoreProblem: The store cannot be written or read (one line).
        """
        probe = f"{self._root}/.probe-{uuid.uuid4().hex}"
        payload = f"trainwire checkpoint store probe {time.time_ns()}".encode()
        step = "create"
        try:
            if self._local:
                self._fs.makedirs(self._root, exist_ok=True)
            step = "write"
            self._fs.pipe_file(probe, payload)
            step = "read"
            back = self._fs.cat_file(probe)
            if back != payload:
                raise OSError(f"read back {len(back)} bytes that differ from the probe written")
            step = "delete"
            self._fs.rm_file(probe)
        except Exception as exc:
            raise CheckpointStoreProblem(
                f"checkpoint store {self.location}: cannot {step} {probe}: {_one_line(exc)}"
            ) from exc

    # -- writing -----------------------------------------------------------------------------

    def put(
        self, run_id: str, episode: int, local_dir: Path, meta: Mapping[str, Any] | None = None
    ) -> CheckpointInfo:
        """Stores every regular file under ``local_dir`` as the checkpoint of ``run_id`` after
        ``episode`` and commits it (writes its marker last). A checkpoint already stored at that
        episode is replaced. ``local_dir`` is left as it was.

        Args:
            run_id: The run.
            episode: The episode the checkpoint was taken after (>= 1).
            local_dir: The checkpoint's files.
            meta: Recorded in the marker beside the record (JSON-serialisable), e.g.
                ``best_reward``.

        Raises:
            CheckpointWriteFailed: Nothing was committed (one line says why).
        """
        if episode < 1:
            raise ValueError(f"episode must be >= 1, got {episode}")
        try:
            members = _local_members(Path(local_dir))
            if self._local:
                info = self._put_local(run_id, episode, Path(local_dir), members, meta or {})
            else:
                info = self._put_remote(run_id, episode, Path(local_dir), members, meta or {})
        except CheckpointError:
            raise
        except Exception as exc:
            raise CheckpointWriteFailed(
                run_id, episode, f"cannot write it to {self.location}: {_one_line(exc)}"
            ) from exc
        return info

    def _upload(self, local_dir: Path, members: Sequence[_Member], target: str) -> tuple[str, int]:
        """Copies the members under ``target`` while digesting their canonical tar."""
        digest = hashlib.sha256()
        size = 0

        @contextlib.contextmanager
        def open_member(relative: str) -> Iterator[_Readable]:
            destination = f"{target}/{relative}"
            if self._local:
                Path(destination).parent.mkdir(parents=True, exist_ok=True)
            with (
                open(local_dir / relative, "rb") as source,
                self._fs.open(destination, "wb") as sink,
            ):
                yield _Tee(source, sink)

        for piece in _canonical_tar(members, open_member):
            digest.update(piece)
            size += len(piece)
        return digest.hexdigest(), size

    def _marker_bytes(
        self,
        run_id: str,
        episode: int,
        sha256: str,
        size: int,
        files: int,
        meta: Mapping[str, Any],
    ) -> tuple[bytes, CheckpointInfo]:
        created = time.time_ns()
        best = meta.get("best_reward")
        record = {
            **meta,
            "format": _MARKER_FORMAT,
            "run_id": run_id,
            "episode": episode,
            "sha256": sha256,
            "size_bytes": size,
            "create_time_ns": created,
            "files": files,
        }
        info = CheckpointInfo(episode, created, size, sha256, None if best is None else float(best))
        return json.dumps(record, sort_keys=True).encode(), info

    def _put_local(
        self,
        run_id: str,
        episode: int,
        local_dir: Path,
        members: Sequence[_Member],
        meta: Mapping[str, Any],
    ) -> CheckpointInfo:
        run_dir = Path(self._run_path(run_id))
        run_dir.mkdir(parents=True, exist_ok=True)
        staging = run_dir / f".staging-{episode:012d}-{uuid.uuid4().hex}"
        final = Path(self._dir(run_id, episode))
        marker = Path(self._marker(run_id, episode))
        try:
            staging.mkdir()
            sha256, size = self._upload(local_dir, members, str(staging))
            _fsync_tree(staging)
            # Replacing a checkpoint: it stops existing (marker gone) before its files change.
            marker.unlink(missing_ok=True)
            if final.exists():
                shutil.rmtree(final)
            os.rename(staging, final)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        data, info = self._marker_bytes(run_id, episode, sha256, size, len(members), meta)
        partial = run_dir / f".{marker.name}.{uuid.uuid4().hex}.partial"
        try:
            with open(partial, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(partial, marker)
        except BaseException:
            partial.unlink(missing_ok=True)
            raise
        _fsync_dir(run_dir)
        return info

    def _put_remote(
        self,
        run_id: str,
        episode: int,
        local_dir: Path,
        members: Sequence[_Member],
        meta: Mapping[str, Any],
    ) -> CheckpointInfo:
        target = self._dir(run_id, episode)
        marker = self._marker(run_id, episode)
        # Replacing a checkpoint: it stops existing (marker gone) before its files change.
        with contextlib.suppress(FileNotFoundError):
            self._fs.rm_file(marker)
        self._remove_tree(target)
        sha256, size = self._upload(local_dir, members, target)
        data, info = self._marker_bytes(run_id, episode, sha256, size, len(members), meta)
        self._fs.pipe_file(marker, data)
        return info

    # -- reading -----------------------------------------------------------------------------

    def _read_marker(self, run_id: str, episode: int) -> dict[str, Any] | None:
        try:
            data = self._fs.cat_file(self._marker(run_id, episode))
        except FileNotFoundError:
            return None
        record = json.loads(data)
        if not isinstance(record, dict):
            raise ValueError("the marker is not a JSON object")
        return record

    def info(self, run_id: str, episode: int) -> CheckpointInfo | None:
        """The record of the complete checkpoint of ``run_id`` after ``episode``, if any.

        Raises:
            CheckpointCorrupt: Its marker does not parse.
        """
        try:
            record = self._read_marker(run_id, episode)
            if record is None:
                return None
            best = record.get("best_reward")
            return CheckpointInfo(
                episode=int(record["episode"]),
                create_time_ns=int(record["create_time_ns"]),
                size_bytes=int(record["size_bytes"]),
                sha256=str(record["sha256"]),
                best_reward=None if best is None else float(best),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointCorrupt(
                run_id, episode, f"its marker does not parse: {_one_line(exc)}"
            ) from exc

    def meta(self, run_id: str, episode: int) -> dict[str, Any] | None:
        """Everything the marker of that checkpoint holds (its record and its writer's meta)."""
        return self._read_marker(run_id, episode)

    def episodes(self, run_id: str) -> list[int]:
        """The episodes of the run's complete checkpoints, oldest first."""
        try:
            names = self._fs.ls(self._run_path(run_id), detail=False)
        except FileNotFoundError:
            return []
        found = []
        for name in names:
            match = _MARKER.match(PurePosixPath(str(name)).name)
            if match:
                found.append(int(match.group(1)))
        return sorted(found)

    def _members(self, run_id: str, episode: int) -> list[_Member]:
        base = self._dir(run_id, episode)
        if self._local:
            if not Path(base).is_dir():
                raise CheckpointMissing(run_id, episode, f"its files are gone from {self.location}")
            return _local_members(Path(base))
        try:
            found = self._fs.find(base, detail=True)
        except FileNotFoundError:
            found = {}
        prefix = self._fs._strip_protocol(base).rstrip("/") + "/"
        members = []
        for name, entry in found.items():
            if entry.get("type", "file") != "file":
                continue
            path = self._fs._strip_protocol(str(name))
            if path.startswith(prefix):
                members.append(_Member(path[len(prefix) :], int(entry["size"])))
        if not members:
            raise CheckpointMissing(run_id, episode, f"its files are gone from {self.location}")
        members.sort(key=lambda member: member.path)
        return members

    def _require(self, run_id: str, episode: int) -> CheckpointInfo:
        info = self.info(run_id, episode)
        if info is None:
            raise CheckpointMissing(run_id, episode, f"it is not in {self.location}")
        return info

    def tar_chunks(self, run_id: str, episode: int, chunk_size: int = _CHUNK) -> Iterator[bytes]:
        """The checkpoint's canonical tar, streamed from the store in ``chunk_size`` chunks.

        Raises:
            CheckpointMissing: No complete checkpoint at that episode (raised by the first
                ``next``).
            CheckpointCorrupt: A file changed size under it.
        """
        self._require(run_id, episode)
        members = self._members(run_id, episode)
        base = self._dir(run_id, episode)

        def open_member(relative: str) -> contextlib.AbstractContextManager[IO[bytes]]:
            return self._fs.open(f"{base}/{relative}", "rb")  # type: ignore[no-any-return]

        try:
            yield from _rechunk(_canonical_tar(members, open_member, chunk_size), chunk_size)
        except FileNotFoundError as exc:
            raise CheckpointMissing(run_id, episode, f"a file is gone: {_one_line(exc)}") from exc
        except OSError as exc:
            raise CheckpointCorrupt(run_id, episode, _one_line(exc)) from exc

    def fetch(self, run_id: str, episode: int, dest: Path, sha256: str = "") -> CheckpointInfo:
        """Downloads the checkpoint's files into ``dest`` (created; it must be empty or absent)
        and checks their canonical tar against ``sha256`` (the caller's record; the marker's
        when empty) and the marker. On failure ``dest`` is left empty.

        Returns:
            The checkpoint's record (its ``best_reward`` among it).

        Raises:
            CheckpointMissing: No complete checkpoint at that episode, or files gone.
            CheckpointCorrupt: The bytes do not match the record.
        """
        info = self._require(run_id, episode)
        expected = sha256 or info.sha256
        dest = Path(dest)
        dest.mkdir(parents=True, exist_ok=True)
        base = self._dir(run_id, episode)
        digest = hashlib.sha256()
        size = 0

        @contextlib.contextmanager
        def open_member(relative: str) -> Iterator[_Readable]:
            target = dest / relative
            if dest.resolve() not in target.resolve().parents:
                raise OSError(f"{relative} lies outside the checkpoint")
            target.parent.mkdir(parents=True, exist_ok=True)
            with self._fs.open(f"{base}/{relative}", "rb") as source, open(target, "wb") as sink:
                yield _Tee(source, sink)

        try:
            for piece in _canonical_tar(self._members(run_id, episode), open_member):
                digest.update(piece)
                size += len(piece)
            got = digest.hexdigest()
            if got != expected:
                raise CheckpointCorrupt(
                    run_id,
                    episode,
                    f"digest mismatch: its files hash to {got} ({size} bytes), expected {expected}",
                )
            if got != info.sha256 or size != info.size_bytes:
                raise CheckpointCorrupt(
                    run_id, episode, "its files do not match its marker's record"
                )
        except BaseException as exc:
            _empty(dest)
            if isinstance(exc, CheckpointError):
                raise
            if isinstance(exc, FileNotFoundError):
                raise CheckpointMissing(
                    run_id, episode, f"a file is gone: {_one_line(exc)}"
                ) from exc
            if isinstance(exc, OSError):
                raise CheckpointCorrupt(run_id, episode, _one_line(exc)) from exc
            raise
        return info

    # -- deleting ----------------------------------------------------------------------------

    def _remove_tree(self, path: str) -> None:
        if self._local:
            shutil.rmtree(path, ignore_errors=True)
            return
        with contextlib.suppress(FileNotFoundError):
            if self._fs.find(path):
                self._fs.rm(path, recursive=True)

    def delete(self, run_id: str, episode: int) -> None:
        """Deletes one checkpoint (its marker first, so it never looks complete while half
        deleted); deleting one that is not there is a no-op."""
        with contextlib.suppress(FileNotFoundError):
            self._fs.rm_file(self._marker(run_id, episode))
        self._remove_tree(self._dir(run_id, episode))

    def delete_run(self, run_id: str) -> None:
        """Deletes every checkpoint of a run (markers first); a no-op when it has none."""
        for episode in self.episodes(run_id):
            with contextlib.suppress(FileNotFoundError):
                self._fs.rm_file(self._marker(run_id, episode))
        self._remove_tree(self._run_path(run_id))


def _protocols(fs: fsspec.AbstractFileSystem) -> tuple[str, ...]:
    protocol = fs.protocol
    return (protocol,) if isinstance(protocol, str) else tuple(protocol)


def _empty(directory: Path) -> None:
    """Removes what is inside ``directory``."""
    if not directory.is_dir():
        return
    for child in directory.iterdir():
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child, ignore_errors=True)
        else:
            child.unlink(missing_ok=True)


def _fsync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _fsync_tree(directory: Path) -> None:
    """Flushes a staged checkpoint's files and directories before it is renamed into place."""
    for dirpath, _dirnames, filenames in os.walk(directory):
        for name in filenames:
            with contextlib.suppress(OSError):
                fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        _fsync_dir(Path(dirpath))

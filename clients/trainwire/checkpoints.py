"""Receiving a checkpoint download (``DownloadCheckpoint``): the chunks go to a temporary tar
file beside the destination while their SHA-256 is computed, so memory stays flat whatever the
checkpoint's size; only a tar whose digest and size match the checkpoint's record is extracted,
into a fresh directory that then takes the destination's name. A failed download leaves nothing
at the destination.

Used by ``GatewayClient.download_checkpoint``, its asyncio twin and ``trainwire runs download``.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tarfile
import tempfile
from pathlib import Path

from trainwire.errors import CheckpointCorrupt
from trainwire.v1 import episode_pb2, gateway_service_pb2

__all__ = ["TarDownload"]


class TarDownload:
    """One download in progress (see the module docstring).

    Args:
        run_id: The run (for messages).
        out_dir: Where the checkpoint's files go: a directory that does not exist yet or is
            empty.

    Raises:
        FileExistsError: ``out_dir`` exists and is not an empty directory.
    """

    def __init__(self, run_id: str, out_dir: Path | str) -> None:
        self.run_id = run_id
        self.out_dir = Path(out_dir)
        if self.out_dir.exists() and (not self.out_dir.is_dir() or any(self.out_dir.iterdir())):
            raise FileExistsError(f"{self.out_dir} exists and is not an empty directory")
        self.out_dir.parent.mkdir(parents=True, exist_ok=True)
        self.checkpoint: episode_pb2.Checkpoint | None = None
        self._digest = hashlib.sha256()
        self._size = 0
        handle, name = tempfile.mkstemp(
            prefix=f".{self.out_dir.name}.", suffix=".tar.partial", dir=self.out_dir.parent
        )
        self._tar_path = Path(name)
        self._file = os.fdopen(handle, "wb")

    def receive(self, response: gateway_service_pb2.DownloadCheckpointResponse) -> None:
        """One message of the stream: the checkpoint (first), then the tar's bytes.

        Raises:
            CheckpointCorrupt: bytes came before the checkpoint.
        """
        if response.WhichOneof("content") == "chunk":
            if self.checkpoint is None:
                raise CheckpointCorrupt(
                    f"run {self.run_id!r}: the download did not start with its checkpoint"
                )
            self.write(response.chunk)
        else:
            self.checkpoint = response.checkpoint

    def write(self, chunk: bytes) -> None:
        """The next bytes of the tar."""
        self._digest.update(chunk)
        self._size += len(chunk)
        self._file.write(chunk)

    def finish(self) -> episode_pb2.Checkpoint:
        """Checks the tar against the record and extracts it; returns the record.

        Raises:
            CheckpointCorrupt: the bytes do not match the record (or no record came).
        """
        self._file.close()
        record = self.checkpoint
        try:
            if record is None:
                raise CheckpointCorrupt(f"run {self.run_id!r}: the download sent no checkpoint")
            digest = self._digest.hexdigest()
            if (digest, self._size) != (record.sha256, record.size_bytes):
                raise CheckpointCorrupt(
                    f"run {self.run_id!r}: the checkpoint at episode {record.episode} arrived "
                    f"damaged: {self._size} bytes with SHA-256 {digest}, expected "
                    f"{record.size_bytes} bytes with {record.sha256}"
                )
            partial = Path(
                tempfile.mkdtemp(prefix=f".{self.out_dir.name}.", dir=self.out_dir.parent)
            )
            try:
                with tarfile.open(self._tar_path, "r:") as tar:
                    # "data": no absolute paths, no links out of the directory, no devices.
                    tar.extractall(partial, filter="data")
                if self.out_dir.exists():
                    self.out_dir.rmdir()  # empty (checked at the start)
                partial.rename(self.out_dir)
            except BaseException:
                shutil.rmtree(partial, ignore_errors=True)
                raise
            return record
        finally:
            self._tar_path.unlink(missing_ok=True)

    def abort(self) -> None:
        """Drops what arrived (the call failed)."""
        with contextlib.suppress(OSError):
            self._file.close()
        self._tar_path.unlink(missing_ok=True)

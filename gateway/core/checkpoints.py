"""What the gateway core knows of checkpoints: the files behind the records (``CheckpointFiles``,
the shared checkpoint store the edge opens), the retention default, and which recorded
checkpoints a run may continue from.

A trainer writes a checkpoint into the store and reports it on its stream after the episode it
was taken after; the driver records it in the gateway's store (``Store.add_checkpoint``), which
keeps the latest ``keep_checkpoints`` and returns the older ones for ``CheckpointFiles.delete``.
A run continues (park, restart) from a checkpoint only if the gateway has received every episode
up to it, so nothing it skips is lost.

A LoRA run's checkpoint can also be downloaded merged into its base model: the gateway has no
torch and may not see the trainers' data roots, so a trainer that offers grpo merges it
(``CheckpointMerger``; the run's own trainer first, then the others in configured order, past
any that cannot be reached or lacks the base model) and the gateway relays its tar, checking the
digest the trainer announced as it does a stored checkpoint's.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from typing import Any, Protocol

from gateway.core.errors import (
    CheckpointCorrupt,
    CheckpointNotFound,
    CheckpointStoreUnavailable,
    IllegalTransition,
    TrainerUnavailable,
)
from gateway.core.runs import TrainingRun
from gateway.core.store import CheckpointRecord, Store
from gateway.core.trainers import (
    CheckpointMerger,
    CheckpointSaved,
    MergedCheckpoint,
    ResumePoint,
    TrainerError,
    TrainerMergeFailed,
)
from trainwire.v1 import episode_pb2
from trainwire_ops.checkpoints import CheckpointError

_LOGGER = logging.getLogger(__name__)

#: Checkpoints kept per run when its config leaves ``keep_checkpoints`` at 0.
DEFAULT_KEEP = 3
#: Bytes per ``DownloadCheckpoint`` chunk.
CHUNK_BYTES = 1 << 20
#: The longest a trainer may take to merge a checkpoint and send it.
MERGE_TIMEOUT_S = 3600.0


class CheckpointFiles(Protocol):
    """The checkpoint store's files, as the gateway reads and deletes them (blocking calls: the
    core runs them in threads)."""

    location: str

    def tar_chunks(self, run_id: str, episode: int, chunk_size: int) -> Iterator[bytes]:
        """The canonical tar of a checkpoint, streamed."""
        ...

    def delete(self, run_id: str, episode: int) -> None:
        """Deletes one checkpoint's files (idempotent)."""
        ...

    def delete_run(self, run_id: str) -> None:
        """Deletes every checkpoint file of a run (idempotent)."""
        ...


def keep_of(config: episode_pb2.TrainConfig) -> int:
    """How many checkpoints a run keeps."""
    return config.keep_checkpoints or DEFAULT_KEEP


def record_of(run_id: str, saved: CheckpointSaved) -> CheckpointRecord:
    """The store's record of a checkpoint a trainer reported."""
    return CheckpointRecord(
        run_id=run_id,
        episode=saved.episode,
        create_time=saved.create_time,
        size_bytes=saved.size_bytes,
        sha256=saved.sha256,
    )


def resume_points(records: Sequence[CheckpointRecord], received: int) -> list[ResumePoint]:
    """The checkpoints a run may continue from, newest first: those taken after an episode it
    has received (``received``: its last received episode)."""
    return [
        ResumePoint(
            record.run_id,
            CheckpointSaved(record.episode, record.create_time, record.size_bytes, record.sha256),
        )
        for record in sorted(records, key=lambda r: r.episode, reverse=True)
        if record.episode <= received
    ]


def _next_hashed(chunks: Iterator[bytes], digest: Any) -> bytes | None:
    """The next chunk (None at the end), added to ``digest``."""
    chunk = next(chunks, None)
    if chunk is not None:
        digest.update(chunk)
    return chunk


async def _verified(
    run_id: str, episode: int, sha256: str, chunks: AsyncIterator[bytes]
) -> AsyncIterator[bytes]:
    """``chunks``, the last one held back until the digest of all of them is ``sha256``.

    Raises:
        CheckpointCorrupt: It is not.
    """
    digest = hashlib.sha256()
    held: bytes | None = None
    async for chunk in chunks:
        digest.update(chunk)
        if held is not None:
            yield held
        held = chunk
    if digest.hexdigest() != sha256:
        _LOGGER.error(
            "run %s: the merged checkpoint at episode %d does not match the digest its "
            "trainer announced",
            run_id,
            episode,
            extra={"run_id": run_id},
        )
        raise CheckpointCorrupt(
            f"run {run_id!r}: the merged checkpoint at episode {episode} arrived damaged", run_id
        )
    if held is not None:
        yield held


def is_lora(run: TrainingRun) -> bool:
    """Whether the run trains LoRA adapters (its checkpoints can be merged)."""
    return run.task.WhichOneof("kind") == "grpo" and run.task.grpo.HasField("lora")


class CheckpointReads:
    """Lists a run's checkpoints and streams one, verifying its digest on the way.

    Args:
        store: Where the records are.
        get_run: The run (raises ``RunNotFound``).
        files: The checkpoint store (None: downloads are unavailable).
        merger: Asks trainers for merged checkpoints (None: merged downloads are unavailable).
        merge_trainers: The trainers that may merge, in the order to ask them (those that
            offer grpo, or have not answered yet); the run's own are asked first.
    """

    def __init__(
        self,
        store: Store,
        get_run: Callable[[str], Awaitable[TrainingRun]],
        files: CheckpointFiles | None,
        merger: CheckpointMerger | None = None,
        merge_trainers: Callable[[], Sequence[str]] = tuple,
    ) -> None:
        self._store = store
        self._get_run = get_run
        self._files = files
        self._merger = merger
        self._merge_trainers = merge_trainers

    async def list(self, run_id: str) -> list[CheckpointRecord]:
        """The run's checkpoints, oldest first.

        Raises:
            RunNotFound: no such run.
        """
        await self._get_run(run_id)
        return await self._store.list_checkpoints(run_id)

    async def open(
        self, run_id: str, episode: int, merged: bool = False
    ) -> tuple[CheckpointRecord, AsyncIterator[bytes]]:
        """One checkpoint (``episode`` 0: the latest) and its canonical tar, in chunks; with
        ``merged``, a LoRA checkpoint merged into its base model by a trainer (the record's
        size and digest are then the merged tar's).

        The last chunk is held back until the digest of everything read matches the record,
        so a corrupt checkpoint is never delivered whole.

        Raises:
            RunNotFound: no such run.
            CheckpointNotFound: no checkpoint at that episode (the message lists the ones
                there are).
            CheckpointStoreUnavailable: the gateway has no checkpoint store.
            IllegalTransition: ``merged`` for a run without LoRA adapters, or no trainer has
                the run's base model.
            TrainerUnavailable: ``merged`` and no trainer that can merge answers.
            CheckpointCorrupt: ``merged`` and the stored checkpoint is damaged.
        """
        if merged and not is_lora(await self._get_run(run_id)):
            raise IllegalTransition(
                f"run {run_id!r}: merged: the run trains every weight (no LoRA adapters); its "
                "checkpoints hold the whole model already, download them without merged",
                run_id,
            )
        records = await self.list(run_id)
        if not records:
            raise CheckpointNotFound(f"run {run_id!r} has no checkpoint yet", run_id)
        if episode == 0:
            record = records[-1]
        else:
            found = [r for r in records if r.episode == episode]
            if not found:
                have = ", ".join(str(r.episode) for r in records)
                raise CheckpointNotFound(
                    f"run {run_id!r} has no checkpoint at episode {episode}; it has {have}",
                    run_id,
                )
            record = found[0]
        if merged:
            return await self._merged(await self._get_run(run_id), record)
        if self._files is None:
            raise CheckpointStoreUnavailable(
                f"run {run_id!r}: this gateway has no checkpoint store", run_id
            )
        return record, self._chunks(self._files, record)

    async def _merged(
        self, run: TrainingRun, record: CheckpointRecord
    ) -> tuple[CheckpointRecord, AsyncIterator[bytes]]:
        """Asks the trainers, the run's own first, to merge ``record``; the first that does
        streams it."""
        run_id = run.id
        own = [address for address in (run.trainer, *run.trainers) if address]
        order = list(dict.fromkeys([*own, *self._merge_trainers()]))
        if self._merger is None or not order:
            raise TrainerUnavailable(
                f"run {run_id!r}: merged: no trainer that can merge a checkpoint is configured",
                run_id,
            )
        saved = CheckpointSaved(
            record.episode, record.create_time, record.size_bytes, record.sha256
        )
        refusals: list[str] = []
        for address in order:
            try:
                found = await self._merger.merge_checkpoint(address, run_id, saved, MERGE_TIMEOUT_S)
            except TrainerMergeFailed as exc:
                if exc.code == "NOT_FOUND":
                    raise CheckpointNotFound(
                        f"run {run_id!r}: the checkpoint at episode {record.episode} is gone "
                        "from the checkpoint store",
                        run_id,
                    ) from None
                if exc.code == "DATA_LOSS":
                    raise CheckpointCorrupt(
                        f"run {run_id!r}: the checkpoint at episode {record.episode} is damaged",
                        run_id,
                    ) from None
                _LOGGER.warning(
                    "run %s: trainer %s could not merge the checkpoint at episode %d: %s",
                    run_id,
                    address,
                    record.episode,
                    exc,
                    extra={"run_id": run_id},
                )
                if exc.code == "FAILED_PRECONDITION":
                    refusals.append(exc.user_message)
                continue
            except TrainerError as exc:
                _LOGGER.warning(
                    "run %s: trainer %s cannot merge: %s",
                    run_id,
                    address,
                    exc,
                    extra={"run_id": run_id},
                )
                continue
            merged = CheckpointRecord(
                run_id=run_id,
                episode=record.episode,
                create_time=found.record.create_time,
                size_bytes=found.record.size_bytes,
                sha256=found.record.sha256,
            )
            return merged, self._relay(run_id, merged, found)
        if refusals:
            raise IllegalTransition(f"run {run_id!r}: merged: {refusals[0]}", run_id)
        raise TrainerUnavailable(
            f"run {run_id!r}: merged: no trainer that can merge a checkpoint answers; try "
            "again later",
            run_id,
        )

    async def _relay(
        self, run_id: str, record: CheckpointRecord, found: MergedCheckpoint
    ) -> AsyncIterator[bytes]:
        """The merged tar's chunks, checked against its record; the trainer's call is ended
        however the relay ends."""
        try:
            async for chunk in _verified(run_id, record.episode, record.sha256, found.chunks):
                yield chunk
        except TrainerError as exc:
            _LOGGER.warning(
                "run %s: the merged checkpoint's stream broke: %s",
                run_id,
                exc,
                extra={"run_id": run_id},
            )
            raise TrainerUnavailable(
                f"run {run_id!r}: the trainer stopped sending the merged checkpoint; try again",
                run_id,
            ) from None
        finally:
            found.cancel()

    async def _chunks(
        self, files: CheckpointFiles, record: CheckpointRecord
    ) -> AsyncIterator[bytes]:
        run_id, episode = record.run_id, record.episode
        digest = hashlib.sha256()
        chunks = files.tar_chunks(run_id, episode, CHUNK_BYTES)
        held: bytes | None = None
        try:
            while True:
                try:
                    # Read and hashed in a thread: hashing a MiB is a millisecond of the loop.
                    chunk = await asyncio.to_thread(_next_hashed, chunks, digest)
                except (CheckpointError, FileNotFoundError) as exc:
                    _LOGGER.error(
                        "run %s: its checkpoint at episode %d in %s cannot be read: %s",
                        run_id,
                        episode,
                        files.location,
                        exc,
                        extra={"run_id": run_id},
                    )
                    raise CheckpointCorrupt(
                        f"run {run_id!r}: the checkpoint at episode {episode} is damaged or "
                        "gone from the checkpoint store",
                        run_id,
                    ) from None
                except Exception as exc:
                    _LOGGER.error(
                        "run %s: reading its checkpoint at episode %d from %s failed: %s",
                        run_id,
                        episode,
                        files.location,
                        exc,
                        extra={"run_id": run_id},
                    )
                    raise CheckpointStoreUnavailable(
                        f"run {run_id!r}: the checkpoint store cannot be read; try again later",
                        run_id,
                    ) from None
                if chunk is None:
                    break
                if held is not None:
                    yield held
                held = chunk
        finally:
            close = getattr(chunks, "close", None)
            if close is not None:
                close()
        if digest.hexdigest() != record.sha256:
            _LOGGER.error(
                "run %s: its checkpoint at episode %d does not match its digest",
                run_id,
                episode,
                extra={"run_id": run_id},
            )
            raise CheckpointCorrupt(
                f"run {run_id!r}: the checkpoint at episode {episode} does not match its "
                "digest; it is damaged",
                run_id,
            )
        if held is not None:
            yield held

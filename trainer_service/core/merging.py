"""Merged models for downloads (``MergeCheckpoint``): a checkpoint of LoRA adapters merged into
its base model by the provider that wrote it, as one canonical tar.

:meth:`CheckpointMerges.merge` fetches the checkpoint from the shared store into a scratch
directory of its own (its digest checked against the gateway's record), asks the provider of the
checkpoint's kind (its marker says which) to merge it, and returns the result as a
:class:`MergedModel`: a local directory and the record of its canonical tar (the checkpoint's
episode and time, the tar's size and SHA-256), whose :meth:`MergedModel.chunks` stream it.
Closing it removes the directory. A provider that merges exposes ``merge_checkpoint(
checkpoint_dir, out_dir, data_roots, stop)``: it writes the merged files into ``out_dir`` and
raises ``ProviderError`` with a message for users when it cannot (not a LoRA checkpoint, a base
model missing). Merges run one at a time (each holds a whole model in memory); they take no job
slot. ``stop`` ends a merge that waits or runs (the call was cancelled).

This module imports neither grpc nor torch.
"""

from __future__ import annotations

import logging
import pathlib
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from trainer_service.core.admission import ProviderLookup
from trainer_service.core.errors import (
    CheckpointCorrupt,
    CheckpointNotFound,
    CheckpointStoreUnavailable,
    InvalidRequest,
)
from trainer_service.core.provider import ProviderError
from trainer_service.core.runner_settings import default_scratch_base
from trainwire import contract
from trainwire_ops.checkpoints import (
    CheckpointCorrupt as StoredCheckpointCorrupt,
)
from trainwire_ops.checkpoints import (
    CheckpointError,
    CheckpointInfo,
    CheckpointMissing,
    CheckpointStore,
    canonical_tar,
    canonical_tar_digest,
)

_LOGGER = logging.getLogger(__name__)

#: Bytes per streamed chunk (what ``DownloadCheckpoint`` relays).
CHUNK_BYTES = 1 << 20
#: Merges run at once on one trainer.
MAX_MERGES = 1
_WAIT_S = 0.2


@dataclass(frozen=True)
class MergedModel:
    """A merged model on local disk, ready to stream.

    Attributes:
        directory: The merged files (removed by :meth:`close`).
        info: Its record: the checkpoint's episode and time, the size and SHA-256 of the
            canonical tar of ``directory``.
    """

    directory: pathlib.Path
    info: CheckpointInfo
    _cleanup: Callable[[], None]

    def chunks(self, chunk_size: int = CHUNK_BYTES) -> Iterator[bytes]:
        """The canonical tar of the merged files, in ``chunk_size`` chunks."""
        return canonical_tar(self.directory, chunk_size)

    def close(self) -> None:
        """Removes the merged files (idempotent)."""
        self._cleanup()


class CheckpointMerges:
    """Merges checkpoints for downloads, one at a time (see the module docstring).

    Args:
        providers: The provider registry (``get(kind)``).
        store: The checkpoint store shared with the gateway; None: nothing can be merged.
        data_roots: Where base models are (the trainer's ``--data-root``s).
        scratch_dir: Where fetched checkpoints and merged models go (a directory per merge,
            removed when its stream ends); None: the system's temporary directory.
    """

    def __init__(
        self,
        providers: ProviderLookup,
        store: CheckpointStore | None,
        data_roots: Sequence[pathlib.Path],
        scratch_dir: pathlib.Path | None = None,
    ) -> None:
        self._providers = providers
        self._store = store
        self._data_roots = tuple(data_roots)
        self._scratch = scratch_dir or default_scratch_base()
        self._slots = threading.BoundedSemaphore(MAX_MERGES)

    def merge(self, run_id: str, episode: int, sha256: str, stop: threading.Event) -> MergedModel:
        """Merges the checkpoint of ``run_id`` after ``episode`` (blocking: run it in a thread).

        Args:
            run_id: The run that wrote it.
            episode: Its episode (at least 1).
            sha256: The digest the gateway recorded ("" trusts the store's marker).
            stop: Set when the caller is gone: the merge stops and this raises
                ``ProviderError`` (``CANCELLED``).

        Raises:
            InvalidRequest: A bad run id or episode.
            CheckpointStoreUnavailable: No store, or it cannot be read.
            CheckpointNotFound: No such checkpoint in the store.
            CheckpointCorrupt: It does not match ``sha256``.
            ProviderError: Its provider cannot merge it (with a message for users), or it
                merges nothing.
        """
        violations = contract.check_run_id(run_id)
        if episode < 1:
            violations.append(
                contract.FieldViolation("checkpoint.episode", f"{episode}; need >= 1")
            )
        if violations:
            raise InvalidRequest(run_id, violations)
        store = self._store
        if store is None:
            raise CheckpointStoreUnavailable(run_id, "this trainer has no checkpoint store")
        merge = self._merger(run_id, store, episode)
        while not self._slots.acquire(timeout=_WAIT_S):
            if stop.is_set():
                raise ProviderError("The merge was cancelled.", code="CANCELLED")
        where = self._scratch / f"merge-{run_id}-{episode}-{uuid.uuid4().hex[:8]}"
        try:
            started = time.monotonic()
            fetched, merged = where / "checkpoint", where / "merged"
            merged.mkdir(parents=True)
            info = self._fetch(store, run_id, episode, sha256, fetched)
            merge(fetched, merged, self._data_roots, stop)
            shutil.rmtree(fetched, ignore_errors=True)
            digest, size = canonical_tar_digest(merged)
        except BaseException:
            shutil.rmtree(where, ignore_errors=True)
            self._slots.release()
            raise
        _LOGGER.info(
            "run %s: checkpoint at episode %d merged into its base model (%d bytes, %.1f s)",
            run_id,
            episode,
            size,
            time.monotonic() - started,
            extra={"run_id": run_id, "episode": episode},
        )
        released = threading.Event()

        def cleanup() -> None:
            shutil.rmtree(where, ignore_errors=True)
            if not released.is_set():
                released.set()
                self._slots.release()

        record = CheckpointInfo(episode, info.create_time_ns, size, digest, info.best_reward)
        # The slot is held until the stream ends: the merged files are on disk until then.
        return MergedModel(merged, record, cleanup)

    def _merger(self, run_id: str, store: CheckpointStore, episode: int) -> Callable[..., None]:
        """The ``merge_checkpoint`` of the provider of the checkpoint's kind."""
        try:
            meta = store.meta(run_id, episode)
        except Exception as exc:
            raise CheckpointStoreUnavailable(
                run_id, f"the checkpoint store cannot be read: {exc}"
            ) from exc
        if meta is None:
            raise CheckpointNotFound(
                run_id, f"no checkpoint at episode {episode} in {store.location}"
            )
        kind = str(meta.get("kind") or "")
        provider = self._providers.get(kind) if kind else None
        merge = getattr(provider, "merge_checkpoint", None)
        if not callable(merge):
            raise ProviderError(
                f"This trainer cannot merge a checkpoint of a {kind or 'unknown'} run.",
                code="UNAVAILABLE",
                reason="PROVIDER_UNAVAILABLE",
            )
        return merge  # type: ignore[no-any-return]

    def _fetch(
        self,
        store: CheckpointStore,
        run_id: str,
        episode: int,
        sha256: str,
        dest: pathlib.Path,
    ) -> CheckpointInfo:
        try:
            return store.fetch(run_id, episode, dest, sha256)
        except CheckpointMissing as exc:
            raise CheckpointNotFound(run_id, str(exc)) from exc
        except StoredCheckpointCorrupt as exc:
            raise CheckpointCorrupt(run_id, str(exc)) from exc
        except CheckpointError as exc:
            raise CheckpointStoreUnavailable(run_id, str(exc)) from exc
        except OSError as exc:
            raise CheckpointStoreUnavailable(
                run_id, f"the checkpoint store cannot be read: {exc}"
            ) from exc

"""What the trainer knows of each rank of a GRPO job, and what it makes of their failure.

:class:`Rank` is the trainer's record of one rank process (its rank in the job, what it said
over its channel, how it exited); :mod:`.process` fills it in. :func:`exit_of` reads a rank's
exit as the launcher reported it.
:func:`diagnose` turns the records of a failed job into the one :class:`ProviderError` the user
reads: a rank killed by a signal first (for ``SIGKILL``, the out-of-memory advice), then the
earliest ``ERROR`` report (a ``ProviderError`` of a rank as the rank raised it, a checkpoint
that did not load as :class:`CheckpointUnusable`, another exception by its type), then an exit
code or silence.

This module imports neither torch nor grpc.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from typing import Any

from trainer_service.core.provider import CheckpointUnusable, ProviderError
from trainer_service.providers.grpo import wire


@dataclass
class Rank:
    """What the trainer knows of one rank (``rank``: its rank in the whole job)."""

    rank: int
    process: BaseProcess
    channel: wire.ChannelEnd
    last_heard: float = field(default_factory=time.monotonic)
    phase: str = "starting"
    ended: bool = False  #: sent END
    last_step: int | None = None  #: the last step it finished, as its END said
    closed: bool = False  #: its channel reached end of file
    error: dict[str, Any] | None = None  #: its ERROR report
    exit_status: int | None = None  #: how it exited (negative: the signal that killed it)
    failed_at: float | None = None  #: when the trainer first saw it fail

    @property
    def pid(self) -> int:
        assert self.process.pid is not None  # started
        return self.process.pid


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def exit_of(process: BaseProcess, wait_s: float = 0.0) -> int | None:
    """How a rank exited, waiting up to ``wait_s`` for it: the exit code, or minus the signal
    that killed it; ``None`` while it runs."""
    if wait_s > 0:
        process.join(wait_s)
    return process.exitcode


def diagnose(
    ranks: Sequence[Rank], world_size: int | None = None
) -> ProviderError | CheckpointUnusable:
    """What went wrong, as the user should read it (call once a rank failed).

    Args:
        ranks: This trainer's ranks of the job (their ``rank`` is the job's).
        world_size: The job's ranks in all, when they span trainers (default: ``ranks``).
    """
    n = world_size or len(ranks)

    def who(rank: Rank) -> str:
        return "The training process" if n == 1 else f"Training process rank {rank.rank} of {n}"

    killed = [r for r in ranks if r.exit_status is not None and r.exit_status < 0]
    if killed:
        rank = min(killed, key=lambda r: r.failed_at or 0.0)
        assert rank.exit_status is not None
        name = _signal_name(-rank.exit_status)
        if -rank.exit_status == signal.SIGKILL:
            text = (
                f"{who(rank)} was killed ({name}). If the machine ran out of memory, try a "
                "smaller batch_size or max_completion_length."
            )
        else:
            text = f"{who(rank)} crashed ({name})."
        return ProviderError(text, detail=f"pid {rank.pid}", code="INTERNAL", reason="PROCESS_DIED")
    reported = [r for r in ranks if r.error is not None]
    if reported:
        rank = min(reported, key=lambda r: float((r.error or {}).get("at", 0.0)))
        error = rank.error or {}
        detail = f"rank {rank.rank}: {error.get('detail', '')}"
        if error.get("kind") == "checkpoint":
            return CheckpointUnusable(str(error.get("user_message", "")))
        if error.get("kind") == "provider":
            return ProviderError(
                str(error.get("user_message", "")),
                detail=detail,
                code=str(error.get("code", "FAILED_PRECONDITION")),
                reason=str(error.get("reason", "PROVIDER_FAILED")),
            )
        return ProviderError(
            f"{who(rank)} failed with {error.get('exception') or 'an error'}; the trainer's "
            "log has the details.",
            detail=detail,
            code="INTERNAL",
            reason="PROVIDER_FAILED",
        )
    failed = [r for r in ranks if r.failed_at is not None]
    rank = min(failed, key=lambda r: r.failed_at or 0.0) if failed else ranks[0]
    if rank.exit_status is not None:
        text = f"{who(rank)} exited unexpectedly (exit code {rank.exit_status})."
    else:
        text = f"{who(rank)} stopped responding."
    return ProviderError(text, detail=f"pid {rank.pid}", code="INTERNAL", reason="PROCESS_DIED")

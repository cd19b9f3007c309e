"""The declared set of ``google.rpc.ErrorInfo`` reasons of the Trainwire services.

Every non-OK status either service sends carries an ``ErrorInfo`` with domain ``trainwire``
(``ERROR_DOMAIN``) and one of these reasons; the gateway's trainer client and this package's
typed errors (``trainwire.errors``) decide by reason, never by parsing messages. Reasons are
UPPER_SNAKE_CASE, stable, and never renamed: other services match on them (like etcd's
``rpctypes`` sentinels or ``google.api.ErrorReason``).

This module imports nothing beyond the standard library, so both services' cores (which import
neither grpc nor torch) can attach reasons to their exceptions as class data.
"""

from __future__ import annotations

from enum import StrEnum

__all__ = ["ERROR_DOMAIN", "PROVIDER_REASONS", "ErrorReason"]

#: ``ErrorInfo.domain`` of every Trainwire status.
ERROR_DOMAIN = "trainwire"


class ErrorReason(StrEnum):
    """Why a call failed; the ``ErrorInfo.reason`` string is the member's value."""

    # -- both services -------------------------------------------------------------------------
    #: Bad request fields (``INVALID_ARGUMENT``, with ``google.rpc.BadRequest``).
    INVALID_REQUEST = "INVALID_REQUEST"
    #: The service is shutting down (``UNAVAILABLE``): retry, elsewhere or later.
    SHUTTING_DOWN = "SHUTTING_DOWN"
    #: A stream broke the episode contract (``INTERNAL``; metadata ``rule``).
    CONTRACT_VIOLATION = "CONTRACT_VIOLATION"
    #: An unexpected failure; the server logged it (``INTERNAL``).
    INTERNAL_ERROR = "INTERNAL_ERROR"

    # -- gateway -------------------------------------------------------------------------------
    #: No run has this id (``NOT_FOUND``; metadata ``run_id``).
    RUN_NOT_FOUND = "RUN_NOT_FOUND"
    #: A control that does not fit the run's state (``FAILED_PRECONDITION``).
    ILLEGAL_TRANSITION = "ILLEGAL_TRANSITION"
    #: No trainer could be reached (``UNAVAILABLE``).
    TRAINER_UNAVAILABLE = "TRAINER_UNAVAILABLE"
    #: The run store cannot be written (``UNAVAILABLE``).
    STORE_UNAVAILABLE = "STORE_UNAVAILABLE"
    #: The gateway holds its maximum of pending runs (``RESOURCE_EXHAUSTED``).
    TOO_MANY_PENDING = "TOO_MANY_PENDING"
    #: No token, or an unknown one (``UNAUTHENTICATED``).
    UNAUTHENTICATED = "UNAUTHENTICATED"
    #: The token's role is too low (``PERMISSION_DENIED``; metadata ``required_role``).
    PERMISSION_DENIED = "PERMISSION_DENIED"
    #: The run has no checkpoint at that episode (``NOT_FOUND``; metadata ``run_id``).
    CHECKPOINT_NOT_FOUND = "CHECKPOINT_NOT_FOUND"
    #: A stored checkpoint no longer matches its digest (``DATA_LOSS``).
    CHECKPOINT_CORRUPT = "CHECKPOINT_CORRUPT"
    #: The checkpoint store cannot be read (``UNAVAILABLE``).
    CHECKPOINT_STORE_UNAVAILABLE = "CHECKPOINT_STORE_UNAVAILABLE"

    # -- trainer -------------------------------------------------------------------------------
    #: Every slot is busy (``RESOURCE_EXHAUSTED``; metadata ``slots_total``). The only reason
    #: that means "busy, try again": RESOURCE_EXHAUSTED alone also means too large / no memory.
    SLOTS_BUSY = "SLOTS_BUSY"
    #: A job of this run is live and the call did not re-attach (``ALREADY_EXISTS``).
    JOB_EXISTS = "JOB_EXISTS"
    #: No live job has this run id (``NOT_FOUND``).
    JOB_NOT_FOUND = "JOB_NOT_FOUND"
    #: A re-attach asked for episodes the job no longer holds (``FAILED_PRECONDITION``).
    EPISODES_NOT_HELD = "EPISODES_NOT_HELD"
    #: Another ``Train`` call re-attached to this job; this stream ends (``ABORTED``).
    REATTACHED = "REATTACHED"
    #: The job was cancelled with ``CancelJob`` (``CANCELLED``).
    JOB_CANCELLED = "JOB_CANCELLED"
    #: The job has trained its last episode or stopped: nothing left to change
    #: (``FAILED_PRECONDITION``).
    JOB_FINISHED = "JOB_FINISHED"

    # -- trainer providers (with a LocalizedMessage for users) -------------------------------------
    PROVIDER_FAILED = "PROVIDER_FAILED"
    PROVIDER_UNAVAILABLE = "PROVIDER_UNAVAILABLE"
    BAD_TASK = "BAD_TASK"
    BAD_SETTINGS = "BAD_SETTINGS"
    BAD_DATASET = "BAD_DATASET"
    PATH_OUTSIDE_ROOT = "PATH_OUTSIDE_ROOT"
    DATASET_NOT_FOUND = "DATASET_NOT_FOUND"
    MODEL_NOT_FOUND = "MODEL_NOT_FOUND"
    MODEL_UNLOADABLE = "MODEL_UNLOADABLE"
    MODEL_NOT_MULTIMODAL = "MODEL_NOT_MULTIMODAL"
    ENDED_EARLY = "ENDED_EARLY"
    OUT_OF_MEMORY = "OUT_OF_MEMORY"
    #: A job's training process died (killed by a signal, crashed, or exited unexpectedly).
    PROCESS_DIED = "PROCESS_DIED"


#: Reasons a trainer provider's failure may carry (``ProviderError.reason``); the gateway shows
#: their ``LocalizedMessage`` to the run's user.
PROVIDER_REASONS: frozenset[ErrorReason] = frozenset(
    r for r in ErrorReason if r.name.startswith(("PROVIDER_", "BAD_", "MODEL_", "DATASET_"))
) | {
    ErrorReason.PATH_OUTSIDE_ROOT,
    ErrorReason.ENDED_EARLY,
    ErrorReason.OUT_OF_MEMORY,
    ErrorReason.PROCESS_DIED,
}

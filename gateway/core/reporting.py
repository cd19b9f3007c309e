"""The failure that ends a run, logged once and counted: what ``end_of`` says of it, with a
contract violation's rule and field, a trainer failure's label, or the traceback of a failure
nobody expected."""

from __future__ import annotations

import logging

from gateway.core.ending import Ending, end_of
from gateway.core.errors import StoreUnavailable
from gateway.core.observer import Observer
from gateway.core.store import StoreWriteFailed
from trainwire.contract import ContractViolation

_LOGGER = logging.getLogger(__name__)


def report_failure(observer: Observer, run_id: str, exc: BaseException, trainer: str) -> Ending:
    """Logs and counts the failure that ends run ``run_id`` on ``trainer``; returns its
    ``Ending``."""
    ending = end_of(exc)
    if isinstance(exc, ContractViolation):
        observer.contract_violation(run_id, exc.rule)
        _LOGGER.error(
            "CONTRACT VIOLATION run=%s rule=%s trainer=%s episode=%s field=%s: %s",
            run_id,
            exc.rule,
            trainer,
            exc.episode,
            exc.field,
            exc,
            extra={"run_id": run_id, "rule": exc.rule},
        )
    elif ending.line is not None:
        observer.trainer_failure(run_id, ending.label)
        _LOGGER.warning("run %s: " + ending.line, run_id, trainer, exc, extra={"run_id": run_id})
    elif not isinstance(exc, (StoreWriteFailed, StoreUnavailable)):
        # (A store failure was logged where the write failed.)
        _LOGGER.error(
            "run %s: unexpected failure driving trainer %s",
            run_id,
            trainer,
            exc_info=exc,
            extra={"run_id": run_id},
        )
    return ending

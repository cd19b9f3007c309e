"""What a driven run does after its job failed: the restart policy's decision, made with the
run's checkpoints when it depends on them, and a restart counted and said in the run's detail.
"""

from __future__ import annotations

import logging

from gateway.core.ledger import CheckpointLedger
from gateway.core.observer import Observer
from gateway.core.restarts import Action, Decision, RestartPolicy
from gateway.core.runs import RunState, TrainingRun
from gateway.core.trainers import ResumePoint

_LOGGER = logging.getLogger(__name__)


class Failures:
    """Decides on one run's failed jobs and counts its restarts.

    Args:
        run: The run (its state and restart count).
        policy: The restart policy.
        ledger: Its checkpoints.
        observer: Metrics hooks.
    """

    def __init__(
        self, run: TrainingRun, policy: RestartPolicy, ledger: CheckpointLedger, observer: Observer
    ) -> None:
        self._run = run
        self.policy = policy
        self._ledger = ledger
        self._observer = observer
        #: The last failure, its decision and the checkpoints it had.
        self.failure: BaseException | None = None
        self._points: list[ResumePoint] = []

    async def decide(self, failure: BaseException, trainer: str) -> Decision:
        """The decision on ``failure`` of the job on rank 0's ``trainer``."""
        run, policy = self._run, self.policy
        active = run.state in (RunState.RUNNING, RunState.PAUSED)
        points: list[ResumePoint] = []
        if policy.wants_checkpoints(failure, active):
            try:
                points = await self._ledger.resume_points()
            except Exception:
                _LOGGER.exception("run %s: cannot read its checkpoints", run.id)
        self.failure, self._points = failure, points
        decision = policy.decide(
            failure, trainer, active=active, restarts=run.restarts, has_checkpoint=bool(points)
        )
        if decision.action is Action.REQUEUE:
            _LOGGER.info(
                "run %s: %s; the job is cancelled and the run back in the queue",
                run.id,
                decision.culprit,
                extra={"run_id": run.id},
            )
            self._observer.trainer_failure(run.id, "busy")
        return decision

    def count_restart(self, decision: Decision) -> None:
        """Counts a ``RESTART`` decision as the run's restart, says why in its detail."""
        run = self._run
        assert self._points
        run.restarted(decision.number)
        self._observer.trainer_failure(run.id, decision.ending.label)
        limit = self.policy.max_restarts
        self._ledger.note = f"restart {run.restarts} of {limit} after {decision.culprit}"
        _LOGGER.warning(
            "run %s: %s (%s); restart %d of %d from the checkpoint at episode %d",
            run.id,
            decision.culprit,
            self.failure,
            run.restarts,
            limit,
            self._points[0].checkpoint.episode,
            extra={"run_id": run.id, "event": "restarting"},
        )

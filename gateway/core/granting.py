"""Credit grants to a run's trainer: when one is due (``CreditWindow``), sending it, and trying
again when the trainer did not take it.

At most one grant is in flight. A grant the trainer did not take is tried again at the next
commit, or after ``GRANT_RETRY_S`` for a trainer that waits at its grant (never back to back:
a trainer that refuses at once would get grants in a tight loop). Whether the trainer is gone is
for the stream to tell, not for a grant.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from gateway.core.credit import CreditWindow, lead_for
from gateway.core.pacing import Pacer
from gateway.core.runs import RunState, TrainingRun
from gateway.core.settings import CoreSettings
from gateway.core.trainers import TrainerConnector, TrainerError

_LOGGER = logging.getLogger(__name__)

#: Seconds before a grant the trainer did not take is tried again without a commit.
GRANT_RETRY_S = 1.0


class Grants:
    """Grants one run's trainer credit as its episodes commit (see the module docstring).

    Args:
        run: The run (its published episode, pace and state).
        pacer: Its pacing (whether the lead follows a rate).
        settings: The lead in seconds, the call timeout.
        connector: How to reach the trainer.
        spawn: Keeps a background task referenced until it is done.
        target: Rank 0's trainer, or "" while no job may take a grant.
    """

    def __init__(
        self,
        run: TrainingRun,
        pacer: Pacer,
        settings: CoreSettings,
        connector: TrainerConnector,
        spawn: Callable[[Awaitable[None], str], None],
        target: Callable[[], str],
    ) -> None:
        self._run = run
        self._pacer = pacer
        self._settings = settings
        self._connector = connector
        self._spawn = spawn
        self._target = target
        self.window = CreditWindow(run.config.max_episodes)

    def lead(self) -> int:
        """The credit the trainer may hold beyond the published episode."""
        run = self._run
        rate = run.episodes_per_second * run.speed if self._pacer.paced else None
        return lead_for(rate, self._settings.lead_s)

    def opening(self, floor: int = 0) -> int:
        """The grant a ``Train`` call opens with (at least ``floor``, counted as granted)."""
        paused = self._run.state is RunState.PAUSED
        grant = max(self.window.opening(self._run.episode, self.lead(), paused), floor)
        self.window.granted = max(self.window.granted, grant)
        return grant

    def maybe(self) -> None:
        """Sends a grant when one is due (at most one in flight)."""
        if not self._target() or self._run.state is not RunState.RUNNING:
            return
        target = self.window.due(self._run.episode, self.lead())
        if target is not None:
            self._spawn(self._send(target), f"gateway-grant-{self._run.id}")

    async def _send(self, target: int) -> None:
        run_id = self._run.id
        delivered = False
        try:
            trainer = self._target()
            if trainer:
                await self._connector.grant(
                    trainer, run_id, target, self._settings.trainer_call_timeout_s
                )
                delivered = True
        except TrainerError as exc:
            _LOGGER.debug(
                "run %s: grant through %d failed: %s",
                run_id,
                target,
                exc,
                extra={"run_id": run_id},
            )
        finally:
            self.window.sent(target, delivered)
        if delivered:
            self.maybe()  # commits that came meanwhile may make another one due
        else:
            asyncio.get_running_loop().call_later(GRANT_RETRY_S, self.maybe)

"""``GetRunCurve`` in the core: checks a curve request and answers it from the store's curve
blocks (``gateway.core.curve``), for any run, driven here, elsewhere or finished."""

from __future__ import annotations

import functools
import re
from collections.abc import Awaitable, Callable, Sequence

from gateway.core.catalog import require_run_id
from gateway.core.curve import DEFAULT_BUCKETS, MAX_BUCKETS, Bucket, read_curve
from gateway.core.errors import InvalidRequest, RunNotFound
from gateway.core.runs import TrainingRun
from gateway.core.store import Store
from trainwire.contract import FieldViolation

#: The most metrics one curve request may ask for, and what a metric's name looks like.
MAX_METRICS = 16
_METRIC_NAME = re.compile(r"[A-Za-z0-9_.:/-]{1,64}")


class RunCurves:
    """Answers curve requests.

    Args:
        store: Where the blocks and episodes are.
        get_run: The run as ``GetRun`` sees it (its ``episode``: the last committed).
    """

    def __init__(self, store: Store, get_run: Callable[[str], Awaitable[TrainingRun]]) -> None:
        self._store = store
        self._get_run = get_run

    async def curve(
        self,
        run_id: str,
        buckets: int,
        metrics: Sequence[str],
        first_episode: int = 0,
        last_episode: int = 0,
    ) -> tuple[list[Bucket], int]:
        """The buckets covering ``first_episode..last_episode`` of a run (0: its first, its
        last committed episode), and its last committed episode.

        Raises:
            InvalidRequest: a bad run id, bucket count, range or metric name.
            RunNotFound: no such run (or deleted meanwhile).
        """
        require_run_id(run_id)
        violations = _check(buckets, metrics, first_episode, last_episode)
        if violations:
            raise InvalidRequest(
                f"curve of run {run_id!r}: {violations[0].field} {violations[0].description}",
                violations,
                run_id,
            )
        run = await self._get_run(run_id)
        last = run.episode if last_episode == 0 else min(last_episode, run.episode)
        # A fork's curve starts after its fork episode (the parent's curve has the rest).
        first = max(1, first_episode, run.fork_episode + 1)
        try:
            got = await read_curve(
                run_id,
                first,
                last,
                buckets or DEFAULT_BUCKETS,
                list(dict.fromkeys(metrics)),
                self._store.read_curve_blocks,
                functools.partial(self._store.read_episodes, scalars=True),
            )
        except LookupError:
            if await self._store.get_run(run_id) is None:
                raise RunNotFound(run_id) from None
            raise
        return got, run.episode


def _check(buckets: int, metrics: Sequence[str], first: int, last: int) -> list[FieldViolation]:
    violations = []
    if not 0 <= buckets <= MAX_BUCKETS:
        violations.append(
            FieldViolation("buckets", f"{buckets}; need 0 (the default, 500) .. {MAX_BUCKETS}")
        )
    if first < 0:
        violations.append(FieldViolation("first_episode", f"{first}; need >= 0"))
    if last < 0:
        violations.append(FieldViolation("last_episode", f"{last}; need >= 0"))
    elif last and first > last:
        violations.append(FieldViolation("first_episode", f"{first} is after last_episode {last}"))
    if len(metrics) > MAX_METRICS:
        violations.append(FieldViolation("metrics", f"{len(metrics)}; need at most {MAX_METRICS}"))
    for i, name in enumerate(metrics):
        if not _METRIC_NAME.fullmatch(name):
            violations.append(
                FieldViolation(
                    f"metrics[{i}]",
                    f"{name[:70]!r} is not a metric name (1-64 of A-Z a-z 0-9 _.:/-)",
                )
            )
    return violations

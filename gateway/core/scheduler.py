"""Placement of PENDING runs on trainers: the queue, background probes and placement.

Each configured trainer has a probe loop of its own that asks ``GetCapabilities`` (with a
deadline) every ``schedule_poll_s`` while runs wait, and every ``IDLE_PROBE_S`` otherwise, and
at once when something changed on it (a run placed there started, ended, or was refused as
busy). Placement reads only the cached answers, so a hung or dead trainer delays nothing but its
own probe. A trainer whose answer is older than a change on it is *stale* and gets no run until
its next answer.

The bookkeeping counts slots: a run needs ``slots_needed`` of them (a GRPO job one per process,
any other one), and a trainer's free slots are its reported ``slots_free`` less the slots
reserved for runs dispatched to it that it has not answered yet. A run goes to the first
trainer, in configured order, that offers its kind (and every reward function of a trainer's
``--reward-module`` that its task names: ``GetCapabilitiesResponse.reward_functions``) and has
the slots free. A run that fits on no
single trainer but on the free slots of the trainers offering its kind together is placed on
several, all or none: its slots are reserved on each before anything starts, the trainers with
the most free slots first (ties in configured order) so that it spans as few as it can, and the
first is rank 0's (``gateway.core.placement``). Placement is first in, first out per task kind
and set of such reward functions: a run waits behind earlier runs that need what it needs, and
a run no trainer offers a provider (or a reward) for waits without blocking the others.
Every waiting run is told what it waits for (``waiting``), with the slots it
needs and those free.

``provider_defaults`` says what a provider trains with where a task leaves a field at 0, as a
trainer advertised it (``GetCapabilitiesResponse.provider_defaults``): the detail retention reads
a run's checkpoint interval from it.

``capacity`` tells ``CreateRun`` how many slots the answering trainers that offer a kind have
in all, so that a job bigger than all of them together is refused instead of waiting forever,
and ``reward_functions`` which reward functions the trainers that offer it have ever offered,
so that a reward none of them knows is refused too.

The gateway is healthy while at least one trainer answers (``on_health``).
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from gateway.core.observer import Observer
from gateway.core.placement import Placement
from gateway.core.settings import CoreSettings
from gateway.core.trainers import Capabilities, TrainerConnector, TrainerError
from trainwire.v1 import trainer_service_pb2

_LOGGER = logging.getLogger(__name__)

#: Seconds between probes of a trainer while no run waits.
IDLE_PROBE_S = 5.0


class Placeable(Protocol):
    """A run waiting for a trainer (``gateway.core.driver.RunDriver``)."""

    @property
    def seq(self) -> int:
        """Creation order."""
        ...

    @property
    def kind(self) -> str:
        """Task kind (``imitation``, ``grpo``)."""
        ...

    @property
    def placeable(self) -> bool:
        """False once it was stopped or started."""
        ...

    @property
    def slots(self) -> int:
        """Trainer slots its job takes (``gateway.core.placement.slots_needed``)."""
        ...

    @property
    def rewards(self) -> tuple[str, ...]:
        """Reward functions its trainers must offer beyond the built-in ones
        (``gateway.core.placement.rewards_needed``)."""
        ...

    def waiting(self, why: str) -> None:
        """Says what it waits for (its ``pending_detail``)."""
        ...

    def dispatch(self, placement: Placement) -> None:
        """Starts it on the trainers of ``placement`` (their slots are reserved)."""
        ...


@dataclass
class TrainerState:
    """What the gateway knows of one trainer.

    Attributes:
        address: ``HOST:PORT``.
        caps: Its last answer; ``None`` while it does not answer.
        error: Why it does not answer (for people).
        starting: Slots of runs dispatched to it that it has not answered yet.
        started: Slots of runs that started on it after it was last asked (its answer lacks
            them).
        stale: Something changed on it since its last answer.
        probe_now: Probe it at once (with ``wake`` set).
        wake: Set to end its probe loop's wait: a probe now, or a new due time (runs began
            to wait, so it is due after the poll interval instead of the idle one).
        asked_at: When it was last asked (monotonic seconds).
        known_rewards: The reward functions it offered when it last answered (kept while it
            does not answer); None before its first answer.
        known_defaults: Its providers' defaults as it last advertised them (kept while it does
            not answer); empty before its first answer, or when it advertises none.
    """

    address: str
    caps: Capabilities | None = None
    error: str = "not asked yet"
    starting: int = 0
    started: int = 0
    stale: bool = False
    probe_now: bool = False
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    asked_at: float = -math.inf
    known_rewards: frozenset[str] | None = None
    known_defaults: Mapping[str, trainer_service_pb2.ProviderDefaults] = field(default_factory=dict)

    @property
    def free(self) -> int:
        """Slots it can take a run in now (0 while it does not answer or is stale)."""
        if self.caps is None or self.stale:
            return 0
        return max(0, self.caps.slots_free - self.starting)

    def offers(self, kind: str, rewards: Sequence[str] = ()) -> bool:
        """Whether it answers and offers ``kind`` and each of ``rewards``."""
        caps = self.caps
        if caps is None or kind not in caps.providers:
            return False
        return all(name in caps.reward_functions for name in rewards)


@dataclass(frozen=True)
class TrainerReport:
    """A trainer as the gateway last saw it, for people: its address, its last answer (None
    while it does not answer) and why it does not (empty while it does)."""

    address: str
    capabilities: Capabilities | None
    error: str


class Scheduler:
    """Places queued runs on trainers (see the module docstring).

    Args:
        config: Trainers, poll interval, call deadline.
        connector: How to reach trainers.
        observer: Metrics hooks (probes).
        on_health: Called with True/False when the first trainer answers / the last one stops.
        clock: Monotonic seconds.
    """

    def __init__(
        self,
        config: CoreSettings,
        connector: TrainerConnector,
        observer: Observer,
        on_health: Callable[[bool], None] = lambda healthy: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._config = config
        self._clock = clock
        self._connector = connector
        self._observer = observer
        self._on_health = on_health
        self._healthy: bool | None = None
        self.trainers = {a: TrainerState(a) for a in config.trainers}
        self._queue: list[tuple[int, int, Placeable]] = []  # (seq, tiebreak, run)
        self._tiebreak = 0
        self._tasks: list[asyncio.Task[None]] = []
        self._answered = asyncio.Event()  # every trainer was asked once

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Starts the probe loops."""
        self._tasks = [
            asyncio.create_task(self._probe_loop(state), name=f"gateway-probe-{address}")
            for address, state in self.trainers.items()
        ]

    async def first_round(self, timeout: float) -> None:
        """Waits (at most ``timeout`` seconds) until every trainer was asked once."""
        try:
            async with asyncio.timeout(timeout):
                await self._answered.wait()
        except TimeoutError:
            pass

    async def stop(self) -> None:
        """Stops the probe loops."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    def reports(self) -> list[TrainerReport]:
        """Every configured trainer as of its last probe, in configured order."""
        return [TrainerReport(s.address, s.caps, s.error) for s in self.trainers.values()]

    @property
    def healthy(self) -> bool:
        """Whether at least one trainer answers."""
        return any(s.caps is not None for s in self.trainers.values())

    # -- the queue ---------------------------------------------------------------------------

    def enqueue(self, run: Placeable) -> None:
        """Adds a run at its place (by creation order) and places what it can."""
        self._tiebreak += 1
        bisect.insort(self._queue, (run.seq, self._tiebreak, run), key=lambda q: q[:2])
        self.place()
        if self._queue:
            # Runs wait: trainers asked longer ago than the poll interval are asked now, the
            # others once the poll interval since their last probe is over (their loops were
            # waiting for the idle interval).
            due = self._clock() - self._config.schedule_poll_s
            for state in self.trainers.values():
                if state.asked_at < due:
                    state.probe_now = True
                state.wake.set()

    requeue = enqueue

    def dequeue(self, run: Placeable) -> None:
        """Removes a run from the queue (it was stopped)."""
        self._queue = [q for q in self._queue if q[2] is not run]

    @property
    def waiting(self) -> int:
        """Runs in the queue."""
        return len(self._queue)

    def reward_functions(self, kind: str) -> frozenset[str] | None:
        """Every reward function the trainers that offer ``kind`` offered when they last
        answered (those that do not answer now included); None while none of them has
        answered."""
        known = [
            s.known_rewards
            for s in self.trainers.values()
            if s.known_rewards is not None and (s.caps is None or kind in s.caps.providers)
        ]
        return frozenset().union(*known) if known else None

    def provider_defaults(
        self, kind: str, address: str = ""
    ) -> trainer_service_pb2.ProviderDefaults | None:
        """What provider ``kind`` trains with where a task leaves a field at 0: as the trainer at
        ``address`` last advertised it (a run's trainer, whether it answers now or not). Where
        that trainer advertised none (it is older than ``provider_defaults``, or ``address`` is
        empty or not configured), as the first configured trainer that advertised them for
        ``kind`` did: trainers of one deployment run the same providers. None while no trainer
        has advertised them for ``kind``."""
        state = self.trainers.get(address)
        if state is not None and kind in state.known_defaults:
            return state.known_defaults[kind]
        for other in self.trainers.values():
            if kind in other.known_defaults:
                return other.known_defaults[kind]
        return None

    def capacity(self, kind: str) -> tuple[int, str] | None:
        """The slots of every answering trainer that offers ``kind`` together, and each one's
        (for people: ``A 2, B 1``); None while no trainer that offers it has answered."""
        totals = [
            (s.address, s.caps.slots_total)
            for s in self.trainers.values()
            if s.caps is not None and kind in s.caps.providers
        ]
        if not totals:
            return None
        return sum(t for _, t in totals), ", ".join(f"{a} {t}" for a, t in totals)

    # -- hooks from drivers ------------------------------------------------------------------

    def started(self, trainer: str, slots: int = 1) -> None:
        """A run's share of ``slots`` dispatched to ``trainer`` got its first answer (or failed
        before it)."""
        state = self.trainers.get(trainer)
        if state is not None and state.starting > 0:
            taken = min(slots, state.starting)
            state.starting -= taken
            state.started += taken
            self._refresh(state)

    def run_ended(self, trainer: str) -> None:
        """A run on ``trainer`` ended: ask it again for its free slots."""
        state = self.trainers.get(trainer)
        if state is not None:
            self._refresh(state)

    def _refresh(self, state: TrainerState) -> None:
        state.stale = True
        state.probe_now = True
        state.wake.set()

    # -- probing -----------------------------------------------------------------------------

    async def _probe_loop(self, state: TrainerState) -> None:
        while True:
            await self._probe(state)
            if all(s.error != "not asked yet" for s in self.trainers.values()):
                self._answered.set()
            await self._until_due(state)

    async def _until_due(self, state: TrainerState) -> None:
        """Waits until the trainer is due for a probe: the poll interval after its last one
        while runs wait, the idle interval otherwise, or at once when asked to."""
        while not state.probe_now:
            interval = self._config.schedule_poll_s if self._queue else IDLE_PROBE_S
            left = state.asked_at + interval - self._clock()
            if left <= 0:
                return
            state.wake.clear()
            try:
                async with asyncio.timeout(left):
                    await state.wake.wait()
            except TimeoutError:
                return

    async def _probe(self, state: TrainerState) -> None:
        state.wake.clear()
        state.probe_now = False
        state.asked_at = self._clock()
        started = state.started
        was_stale = state.stale
        address = state.address
        try:
            caps = await self._connector.capabilities(address, self._config.trainer_call_timeout_s)
        except TrainerError as exc:
            self._observer.trainer_probed(address, None)
            if state.caps is not None or state.error == "not asked yet":
                _LOGGER.warning("trainer %s unreachable: %s", address, exc)
            state.caps = None
            state.error = _short_reason(str(exc))
        except Exception as exc:  # the probe loop must survive anything
            _LOGGER.exception("probing trainer %s failed", address)
            state.caps = None
            state.error = f"probe failed: {exc}"
        else:
            self._observer.trainer_probed(address, caps)
            if state.caps is None and state.error != "not asked yet":
                _LOGGER.info("trainer %s reachable again", address)
            state.caps = caps
            state.known_rewards = frozenset(caps.reward_functions)
            state.known_defaults = caps.provider_defaults
            state.error = ""
            state.started -= started  # those are in its answer
            if was_stale and not state.probe_now:
                state.stale = False  # nothing changed on it while it was asked
        self._health_changed()
        self.place()

    def _health_changed(self) -> None:
        healthy = self.healthy
        if healthy != self._healthy:
            self._healthy = healthy
            self._on_health(healthy)

    # -- placement ---------------------------------------------------------------------------

    def place(self) -> None:
        """Places queued runs on trainers with free slots, FIFO per kind; says why the others
        wait."""
        # (kind, reward functions beyond the built-in ones) -> why its runs wait
        blocked: dict[tuple[str, frozenset[str]], str] = {}
        ahead: dict[tuple[str, frozenset[str]], int] = {}
        keep: list[tuple[int, int, Placeable]] = []
        for item in self._queue:
            run = item[2]
            if not run.placeable:
                continue
            kind, rewards = run.kind, run.rewards
            need = (kind, frozenset(rewards))
            if need in blocked:
                ahead[need] = ahead.get(need, 0) + 1
                run.waiting(f"{blocked[need]}; {ahead[need]} run(s) ahead in the queue")
                keep.append(item)
                continue
            placement = self._fit(kind, run.slots, rewards)
            if placement is None:
                blocked[need] = self._why_waiting(kind, run.slots, rewards)
                run.waiting(blocked[need])
                keep.append(item)
                continue
            for share in placement.shares:
                self.trainers[share.address].starting += share.processes
            run.dispatch(placement)
        self._queue = keep

    def _fit(self, kind: str, slots: int, rewards: Sequence[str] = ()) -> Placement | None:
        """Where a job of ``slots`` slots of ``kind`` that needs ``rewards`` goes now: the first
        trainer (configured order) with that many free, else several with the most free first,
        all or none."""
        offering = [s for s in self.trainers.values() if s.offers(kind, rewards) and s.free > 0]
        alone = next((s for s in offering if s.free >= slots), None)
        if alone is not None:
            return Placement.of([(alone.address, slots)])
        if sum(s.free for s in offering) < slots:
            return None
        order = sorted(range(len(offering)), key=lambda i: (-offering[i].free, i))
        parts: list[tuple[str, int]] = []
        left = slots
        for i in order:
            take = min(offering[i].free, left)
            parts.append((offering[i].address, take))
            left -= take
            if not left:
                break
        return Placement.of(parts)

    def _why_waiting(self, kind: str, slots: int, rewards: Sequence[str] = ()) -> str:
        states = list(self.trainers.values())
        reachable = [s for s in states if s.caps is not None]
        if not reachable:
            return "no trainer reachable: " + ", ".join(f"{s.address} ({s.error})" for s in states)
        offering = [s for s in reachable if s.offers(kind)]
        if not offering:
            offers = ", ".join(
                f"{s.address} offers {', '.join(s.caps.providers) or 'nothing'}"  # type: ignore[union-attr]
                for s in reachable
            )
            return f"no trainer offers {kind}: {offers}"
        if rewards and not any(s.offers(kind, rewards) for s in offering):
            offers = ", ".join(
                f"{s.address} has "
                + (", ".join(n for n in s.caps.reward_functions if ":" in n) or "none")  # type: ignore[union-attr]
                for s in offering
            )
            return (
                f"no reachable trainer offers the reward functions {', '.join(rewards)} "
                f"(reward modules: {offers})"
            )
        offering = [s for s in offering if s.offers(kind, rewards)]
        if slots > 1:
            totals = [(s, s.caps.slots_total if s.caps is not None else 0) for s in offering]
            free = ", ".join(f"{s.address} {s.free}/{total}" for s, total in totals)
            total = sum(t for _, t in totals)
            if total < slots:
                return (
                    f"needs {slots} slots; the trainers that offer {kind} have {total} in all "
                    f"(free: {free})"
                )
            return f"needs {slots} slots; free: {free}"
        parts = []
        for s in offering:
            caps = s.caps
            assert caps is not None
            busy = caps.slots_total - caps.slots_free + s.starting + s.started
            parts.append(f"{s.address} has {min(busy, caps.slots_total)}/{caps.slots_total} busy")
        return "waiting for a free slot: " + ", ".join(parts)


def _short_reason(detail: str) -> str:
    """A few words of why a trainer does not answer, from a gRPC error's text."""
    if "--trainer-server-name" in detail:  # the TLS name check failed: the hint is the reason
        return detail.split(" (UNAVAILABLE", 1)[0].split(": ", 1)[-1][:300]
    lowered = detail.lower()
    if "connection refused" in lowered:
        return "connection refused"
    if "deadline" in lowered or "timed out" in lowered:
        return "not answering (timed out)"
    if "unavailable" in lowered:
        return "unavailable"
    return detail[:200]

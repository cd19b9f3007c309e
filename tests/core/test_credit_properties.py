"""The credit invariants under any schedule of controls (hypothesis, in virtual time): at every
moment ``episode <= trainer_episode <= granted`` (granted as the trainer was told), the trainer
never trains past its grant, it leads the published episode by at most the lead of the speed its
last grant was computed with, no grant goes out while the run is paused, and the run still ends
with every episode exactly once."""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.core.errors import IllegalTransition
from gateway.core.runs import RunState
from tests.fakes.core_harness import TEST_SETTINGS, Core, running_core
from tests.fakes.memory_trainer import GrantCall, JobScript, MemoryTrainer, TrainCall
from tests.fakes.virtual_time import virtual_loop
from tests.fakes.waiting import until

MAX_EPISODES = 80
RATE = 10.0
#: Seconds between two looks at the invariants while time passes.
SAMPLE_S = 0.02

advance = st.tuples(st.just("advance"), st.floats(min_value=0.05, max_value=3.0))
pause = st.tuples(st.just("pause"), st.just(0.0))
resume = st.tuples(st.just("resume"), st.just(0.0))
speed = st.tuples(st.just("speed"), st.sampled_from([0.1, 0.5, 1.0, 2.0, 5.0, 20.0]))
schedules = st.lists(st.one_of(advance, pause, resume, speed), min_size=1, max_size=12)


def lead(speed: float) -> int:
    """The lead of a paced run at this speed, from the settings."""
    return max(4, math.ceil(TEST_SETTINGS["lead_s"] * RATE * speed))


@dataclass
class Checker:
    """Looks at the invariants of one run as time passes."""

    core: Core
    run_id: str
    #: (loop time, speed) of every speed change, the first one at creation.
    speeds: list[tuple[float, float]] = field(default_factory=lambda: [(0.0, 1.0)])
    #: (from, to) loop times while the run was paused (to: None while it is).
    paused: list[tuple[float, float | None]] = field(default_factory=list)
    looks: int = 0

    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    def speed_changed(self, speed: float) -> None:
        self.speeds.append((self._now(), speed))

    def pause_began(self) -> None:
        if not self.paused or self.paused[-1][1] is not None:
            self.paused.append((self._now(), None))

    def pause_ended(self) -> None:
        if self.paused and self.paused[-1][1] is None:
            self.paused[-1] = (self.paused[-1][0], self._now())

    def _allowed_lead(self, granted_at: float) -> int:
        """The largest lead a grant at ``granted_at`` may have been computed with: that of the
        speed in effect just before it, or of any speed set since."""
        before = [s for at, s in self.speeds if at < granted_at][-1:]
        since = [s for at, s in self.speeds if at >= granted_at]
        return max(lead(s) for s in [*before, *since])

    async def look(self) -> None:
        run = await self.core.run(self.run_id)
        if not run.state.active:
            return
        self.looks += 1
        connector = self.core.connector
        granted = connector.granted(self.run_id)
        assert run.episode <= run.trainer_episode <= granted, (run, granted)
        job = connector.job(self.run_id)
        assert job.last_produced <= granted
        last_grant = [
            c
            for c in connector.calls
            if isinstance(c, GrantCall | TrainCall) and c.run_id == self.run_id
        ][-1]
        assert run.trainer_episode - run.episode <= self._allowed_lead(last_grant.at), (
            run,
            last_grant,
            self.speeds,
        )

    async def wait(self, seconds: float) -> None:
        """Lets ``seconds`` pass, looking every ``SAMPLE_S``."""
        end = self._now() + seconds
        while self._now() < end:
            await asyncio.sleep(min(SAMPLE_S, end - self._now()))
            await self.look()

    def grants_while_paused(self) -> list[GrantCall]:
        """Grants that went out strictly inside a pause."""
        return [
            c
            for c in self.core.connector.calls
            if isinstance(c, GrantCall)
            and any(start < c.at and (end is None or c.at < end) for start, end in self.paused)
        ]


async def scenario(
    schedule: list[tuple[str, float]], episode_s: float, grant_delay_s: float
) -> None:
    trainer = MemoryTrainer("t1", grant_delay_s=grant_delay_s)
    trainer.script(JobScript(episode_s=episode_s))
    async with running_core(trainer) as core:
        run = await core.create(max_episodes=MAX_EPISODES, episodes_per_second=RATE)
        watch = core.watch(run.id)
        checker = Checker(core, run.id)
        await core.wait_state(run.id, RunState.RUNNING)
        for action, value in schedule:
            state = (await core.run(run.id)).state
            if not state.active:
                break
            if action == "advance":
                await checker.wait(value)
            else:
                # A control takes effect during its call, and the call may take (virtual) time
                # while its state is written: a pause counts from when the call returned, a
                # resume and a speed from when it was made, so neither window is too wide.
                try:
                    if action == "pause":
                        await core.registry.pause(run.id)
                        checker.pause_began()
                    elif action == "resume" and state is RunState.PAUSED:
                        checker.pause_ended()
                        await core.registry.resume(run.id)
                    elif action == "speed":
                        checker.speed_changed(value)
                        await core.registry.set_speed(run.id, value)
                except IllegalTransition:
                    # It was finishing (its done episode on the way to the store): the control
                    # is answered for its end (test_controls pins that).
                    assert (await core.run(run.id)).state is RunState.DONE
                    break
            await checker.look()

        # To the end, fast.
        try:
            if (await core.run(run.id)).state is RunState.PAUSED:
                checker.pause_ended()
                await core.registry.resume(run.id)
            if (await core.run(run.id)).state.active:
                checker.speed_changed(20.0)
                await core.registry.set_speed(run.id, 20.0)
        except IllegalTransition:  # finishing (see above)
            pass

        async def finished() -> bool:
            await checker.look()
            return (await core.run(run.id)).state is RunState.DONE

        await until(finished, "the run's end", timeout=600.0)
        await watch.ended()
        assert watch.numbers() == list(range(1, MAX_EPISODES + 1))
        assert checker.grants_while_paused() == []
        assert checker.looks > 0


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    schedule=schedules,
    episode_s=st.sampled_from([0.0, 0.02, 0.3]),
    grant_delay_s=st.sampled_from([0.0, 0.15]),
)
def test_credit_invariants_hold_under_any_schedule_of_controls(
    schedule: list[tuple[str, float]], episode_s: float, grant_delay_s: float
) -> None:
    virtual_loop(lambda: scenario(schedule, episode_s, grant_delay_s))

"""Credit grants, in virtual time: the trainer may train ``lead`` episodes beyond what was
published (``min(max_episodes, episode + lead)``), grants follow commits, at most one is in
flight, and the trainer never trains past its grant."""

from __future__ import annotations

import itertools
import math

import pytest

from gateway.core.runs import RunState
from tests.fakes.core_harness import TEST_SETTINGS, running_core
from tests.fakes.memory_trainer import Call, GrantCall, MemoryTrainer
from tests.fakes.virtual_time import VIRTUAL_TIME
from tests.fakes.waiting import until

pytestmark = VIRTUAL_TIME


def lead_of(rate: float, speed: float) -> int:
    """The lead the settings give a run (``gateway.core.driver``'s rule, written out)."""
    if rate < 0:
        return 256
    return max(4, math.ceil(TEST_SETTINGS["lead_s"] * rate * speed))


@pytest.mark.parametrize(
    ("rate", "speed", "max_episodes", "first_grant"),
    [
        (10.0, 1.0, 100, 20),  # 2 s of 10 episodes/s
        (10.0, 3.0, 100, 60),
        (1.0, 1.0, 100, 4),  # at least 4
        (10.0, 0.1, 100, 4),
        (-1.0, 1.0, 1000, 256),  # unpaced: a fixed window
        (10.0, 1.0, 12, 12),  # never beyond the run's end
    ],
)
async def test_a_new_job_opens_with_a_lead_of_credit(
    rate: float, speed: float, max_episodes: int, first_grant: int
) -> None:
    assert first_grant == min(max_episodes, lead_of(rate, speed))
    async with running_core() as core:
        run = await core.create(max_episodes=max_episodes, episodes_per_second=rate, speed=speed)
        [train] = await until(lambda: core.connector.trains(run.id), "the run's Train call")
        assert (train.grant, train.attach_after) == (first_grant, None)
        # The trainer trains as far as it was granted at once, and no further.
        job = core.connector.job(run.id)
        assert job.last_produced == job.grant >= first_grant


async def test_each_grant_is_the_lead_beyond_the_episode_committed_when_it_went_out() -> None:
    async with running_core() as core:
        committed_at_grant: list[tuple[int, int]] = []

        def record(call: Call) -> None:
            if isinstance(call, GrantCall):
                committed_at_grant.append((call.through_episode, core.store.committed[call.run_id]))

        core.connector.on_call = record
        run = await core.create(max_episodes=100)  # lead 20, a grant per 5 episodes
        done = await core.wait_state(run.id, RunState.DONE)

        assert done.episode == 100
        grants = [through for through, _ in committed_at_grant]
        assert grants == [*range(25, 101, 5)]
        for through, committed in committed_at_grant:
            assert through == min(100, committed + 20)
        # The trainer never trained past what it was granted.
        assert core.connector.job(run.id).last_produced == 100


async def test_at_most_one_grant_is_in_flight_and_a_slow_one_does_not_lose_credit() -> None:
    # Unpaced: commits come much faster than a grant's answer.
    async with running_core(MemoryTrainer("t1", grant_delay_s=0.5)) as core:
        run = await core.create(max_episodes=2000, episodes_per_second=-1.0)
        done = await core.wait_state(run.id, RunState.DONE)

        assert done.episode == 2000
        assert core.connector.max_grants_in_flight == 1
        grants = core.connector.grants(run.id)
        assert grants == sorted(set(grants))  # each one moves the credit forward
        assert grants[-1] == 2000
        # The window is 256 episodes and a grant goes out once it moves by a quarter of it.
        first = core.connector.trains(run.id)[0].grant
        assert first == 256
        moves = itertools.pairwise([first, *grants])
        assert all(b - a >= 64 or b == 2000 for a, b in moves)

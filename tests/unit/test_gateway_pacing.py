"""Pacing with a fake clock: rate x speed, speed changes mid-interval, slow producers, resume."""

from __future__ import annotations

import itertools
import math

import pytest

from gateway.core.pacing import Pacer, clamp_speed


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def publish_when_due(pacer: Pacer, clock: FakeClock) -> None:
    clock.now += pacer.delay()
    pacer.published()


def test_interval_is_one_over_rate_times_speed() -> None:
    clock = FakeClock()
    pacer = Pacer(20.0, 2.0, clock)
    assert pacer.interval == pytest.approx(1 / 40)
    assert pacer.delay() == 0  # the first episode goes out at once
    times = []
    for _ in range(5):
        publish_when_due(pacer, clock)
        times.append(clock.now)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert gaps == pytest.approx([1 / 40] * 4)


def test_speed_change_applies_to_the_pending_wait() -> None:
    clock = FakeClock()
    pacer = Pacer(10.0, 1.0, clock)
    pacer.published()
    clock.now += 0.05
    assert pacer.delay() == pytest.approx(0.05)
    pacer.set_speed(4.0)  # interval 0.025, already overdue
    assert pacer.delay() == 0
    pacer.set_speed(0.5)  # interval 0.2, anchored on the last publication
    assert pacer.delay() == pytest.approx(0.15)


def test_unpaced_never_waits() -> None:
    clock = FakeClock()
    pacer = Pacer(-1.0, 1.0, clock)
    assert not pacer.paced
    for _ in range(3):
        pacer.published()
        assert pacer.delay() == 0


def test_slow_producer_is_published_on_arrival_and_does_not_burst_afterwards() -> None:
    clock = FakeClock()
    pacer = Pacer(10.0, 1.0, clock)
    pacer.published()
    clock.now += 5.0  # the trainer stalled for 50 intervals
    assert pacer.delay() == 0
    pacer.published()
    assert pacer.delay() == pytest.approx(0.1)  # no catch-up burst


def test_small_lateness_keeps_the_cadence() -> None:
    clock = FakeClock()
    pacer = Pacer(10.0, 1.0, clock)
    pacer.published()
    start = clock.now
    for i in range(1, 11):
        clock.now += pacer.delay() + 0.003  # every timer overshoots by 3 ms
        pacer.published()
        # anchored on the schedule: episode i is due at start + i/10, not drifting 3 ms each
        assert pacer.delay() == pytest.approx(max(0.0, start + (i + 1) / 10 - clock.now))


def test_restart_after_resume_publishes_at_once() -> None:
    clock = FakeClock()
    pacer = Pacer(1.0, 1.0, clock)
    pacer.published()
    assert pacer.delay() == pytest.approx(1.0)
    pacer.restart()
    assert pacer.delay() == 0


@pytest.mark.parametrize(
    ("given", "expected"), [(0, 0.1), (-5, 0.1), (0.05, 0.1), (25, 20.0), (1.5, 1.5)]
)
def test_clamp_speed(given: float, expected: float) -> None:
    assert clamp_speed(given) == expected


@pytest.mark.parametrize(("given", "expected"), [(0, 1.0), (-5, 0.1), (3, 3.0)])
def test_clamp_speed_of_a_new_run_reads_zero_as_unset(given: float, expected: float) -> None:
    assert clamp_speed(given, zero_is_default=True) == expected


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_clamp_speed_rejects_non_finite(bad: float) -> None:
    with pytest.raises(ValueError):
        clamp_speed(bad)

"""The trainer's side of a GRPO job whose ranks span trainers, with real rank processes whose
training is scripted (``tests.fakes.grpo_rank``: the real worker, its channel, lifeline and
rendezvous, around a trainer that loads no model): two ``process.run`` of one job, rank 0's
share and another trainer's, meet in rank 0's store over loopback. Rank 0 relays its controls,
so the share's rank runs and stops at rank 0's steps; a rank 0 that dies (or is gone before the
share starts) fails the share naming the rendezvous; a share that dies while rank 0 waits
between steps fails rank 0 once its heartbeat stops."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import pathlib
import re
import signal
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import psutil
import pytest

from tests.fakes.grpo_rank import scripted_ranks
from tests.fakes.waiting import TIMEOUT, wait_for
from tests.grpo_fixtures import make_job, rank_in_title, tiny_grpo_task
from trainer_service.core.placement import Placement
from trainer_service.core.provider import ProviderError, TrainJob
from trainer_service.providers.grpo import process, rendezvous
from trainwire.v1 import episode_pb2

pytestmark = pytest.mark.slow

__all__ = ["scripted_ranks"]  # the fixture, re-exported for pytest

#: The promise: every rank of a job stops this soon after any trainer of it dies.
STOPPED_S = 15.0


class PlacedJob:
    """One job of scripted ranks: rank 0's share (``here`` ranks) in this thread, the rest as
    another trainer's share."""

    def __init__(self, steps: int, world: int = 2, here: int = 1) -> None:
        task = tiny_grpo_task(model_path="scripted", num_processes=world)
        self.base = make_job(pathlib.Path("/nonexistent"), task, max_episodes=steps)
        self.world, self.here = world, here
        self.address = ""
        self.rank0 = dataclasses.replace(
            self.base, placement=Placement(world, 0, here), announce_rendezvous=self._announce
        )
        self.episodes = process.run(self.rank0)
        self.share: TrainJob | None = None
        self.share_error: BaseException | None = None
        self.share_yielded: list[episode_pb2.Episode] = []
        self.share_done = threading.Event()

    def _announce(self, address: str) -> None:
        # As the gateway does: the other trainer's share starts once the rendezvous is out.
        # (Each share runs in one thread throughout: a rank dies with the thread that
        # started it, see lifeline.)
        self.address = address
        others = Placement(self.world, self.here, self.world - self.here, address)
        self.share = dataclasses.replace(self.base, placement=others, stop_event=threading.Event())
        threading.Thread(target=self._run_share, daemon=True).start()

    def first_episode(self) -> episode_pb2.Episode:
        """Rank 0's first episode (the share starts meanwhile)."""
        return next(self.episodes)

    def _run_share(self) -> None:
        assert self.share is not None
        try:
            self.share_yielded.extend(process.run(self.share))
        except BaseException as exc:
            self.share_error = exc
        finally:
            self.share_done.set()

    def close(self) -> None:
        with contextlib.suppress(ProviderError):
            self.episodes.close()
        if self.share is not None:
            self.share.stop_event.set()
            assert self.share_done.wait(TIMEOUT)


@pytest.fixture
def placed(scripted_ranks: str) -> Iterator[Any]:
    jobs: list[PlacedJob] = []

    def make(steps: int, world: int = 2, here: int = 1) -> PlacedJob:
        jobs.append(PlacedJob(steps, world, here))
        return jobs[-1]

    yield make
    for job in jobs:
        job.close()
    assert not _ranks(scripted_ranks)


def _ranks(module: str) -> dict[int, psutil.Process]:
    """This process's scripted ranks by their rank in the job."""
    out = {}
    for child in psutil.Process().children(recursive=True):
        try:
            rank = rank_in_title(child)
            if rank is not None and module in " ".join(child.cmdline()):
                out[rank] = child
        except psutil.Error:
            continue
    return out


def _gone(process: psutil.Process) -> bool:
    """Whether a rank exited (its trainer reaps it later: never here)."""
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _last_steps(caplog: pytest.LogCaptureFixture) -> dict[int, int | None]:
    """Each rank's last step, as the two trainers logged them when their share ended."""
    out: dict[int, int | None] = {}
    for record in caplog.records:
        message = record.getMessage()
        if "last step of each rank" in message:
            for rank, step in re.findall(r"(\d+): (\d+|None)", message.split("each rank:")[1]):
                out[int(rank)] = None if step == "None" else int(step)
    return out


@pytest.mark.parametrize(("world", "here"), [(2, 1), (3, 2)])
def test_the_share_runs_rank_0s_steps_and_returns_when_the_job_is_done(
    placed: Any, caplog: pytest.LogCaptureFixture, world: int, here: int
) -> None:
    # (3, 2): rank 1 reads its pipe beside rank 0; rank 2 follows rank 0 from the store.
    caplog.set_level(logging.INFO, logger="trainer_service.providers.grpo.process")
    job = placed(5, world, here)
    first = job.first_episode()
    rest = list(job.episodes)
    assert [e.episode for e in [first, *rest]] == [1, 2, 3, 4, 5] and rest[-1].done
    assert job.share_done.wait(TIMEOUT)
    assert job.share_error is None and job.share_yielded == []
    wait_for(lambda: len(_last_steps(caplog)) == world, "both trainers' shares ended")
    assert _last_steps(caplog) == dict.fromkeys(range(world), 5)


def test_a_stop_of_rank_0s_job_stops_the_share_at_the_same_step(
    placed: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="trainer_service.providers.grpo.process")
    job = placed(500)
    job.first_episode()
    next(job.episodes)
    job.episodes.close()  # the trainer stops the job: STOP to rank 0, relayed to rank 1
    assert job.share_done.wait(TIMEOUT) and job.share_error is None
    wait_for(lambda: len(_last_steps(caplog)) == 2, "both trainers' shares ended")
    steps = _last_steps(caplog)
    assert steps[0] == steps[1] and steps[0] in (2, 3), steps


def test_the_share_fails_naming_the_rendezvous_when_rank_0_dies(
    placed: Any, scripted_ranks: str
) -> None:
    job = placed(500)
    job.first_episode()
    ranks = _ranks(scripted_ranks)
    os.kill(ranks[0].pid, signal.SIGKILL)  # as with rank 0's trainer (its lifeline)
    killed = time.monotonic()
    assert job.share_done.wait(STOPPED_S)
    took = time.monotonic() - killed
    error = job.share_error
    assert isinstance(error, ProviderError) and error.reason == "PROCESS_DIED", error
    assert error.user_message == (
        f"Training process rank 1 of 2 lost the job's rendezvous at {job.address}: rank 0 or "
        "its trainer is gone."
    )
    print(f"rank 0 killed: the share failed after {took:.2f} s")
    wait_for(lambda: _gone(ranks[1]), "rank 1 gone", STOPPED_S)


def test_a_rank_0_waiting_between_steps_fails_once_the_share_stops_responding(
    placed: Any, scripted_ranks: str
) -> None:
    job = placed(500)
    job.first_episode()  # rank 0 now waits for its next STEP: no collective will fail
    ranks = _ranks(scripted_ranks)
    os.kill(ranks[1].pid, signal.SIGKILL)
    killed = time.monotonic()
    assert job.share_done.wait(TIMEOUT)
    assert isinstance(job.share_error, ProviderError)
    assert job.share_error.reason == "PROCESS_DIED"
    # Rank 0 reports and exits by itself, before its trainer asks it for anything.
    wait_for(lambda: _gone(ranks[0]), "rank 0 gone", STOPPED_S)
    took = time.monotonic() - killed
    assert rendezvous.PEER_SILENT_S <= took < STOPPED_S, took
    with pytest.raises(ProviderError) as info:
        next(job.episodes)
    assert info.value.reason == "PROCESS_DIED"
    assert "rank 1 of 2 (on another trainer) stopped responding" in info.value.user_message
    print(f"share killed while rank 0 waited: rank 0 gone after {took:.2f} s")


def test_a_share_whose_rendezvous_is_gone_fails_at_once(scripted_ranks: str) -> None:
    # The gateway started it late: rank 0's trainer no longer listens at the address.
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{closed.getsockname()[1]}"
    task = tiny_grpo_task(model_path="scripted", num_processes=2)
    job = dataclasses.replace(
        make_job(pathlib.Path("/nonexistent"), task, max_episodes=3),
        placement=Placement(2, 1, 1, address),
    )
    started = time.monotonic()
    with pytest.raises(ProviderError) as info:
        list(process.run(job))
    assert info.value.reason == "PROCESS_DIED"
    assert f"lost the job's rendezvous at {address}" in info.value.user_message
    # At once: not after the store client's minute of retries (the time includes the rank's
    # start, seconds of imports on a loaded machine).
    assert time.monotonic() - started < rendezvous.STORE_TIMEOUT_S

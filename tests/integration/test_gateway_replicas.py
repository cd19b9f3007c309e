"""Gateway replicas on one PostgreSQL database (a real server, ``tests/postgres_fixtures.py``).

What must hold (issue: "Gateway replicas on PostgreSQL"): a run created on one replica and
watched on another streams every episode exactly once; a pause sent to a replica that does not
drive the run pauses it within a second; ``kill -9`` of the replica that drives a run makes
another take it over within the lease plus 5 s, and a watcher of the survivor sees every
episode once and the run end DONE; 100 concurrent CreateRun calls spread over two replicas with
two trainer slots make 100 runs, each started once, all DONE.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from tests.fakes.fake_trainer import FakeTrainer, Script
from tests.fakes.gateway_harness import (
    WatchResult,
    absorb,
    collect,
    create_request,
    gateway_process,
    get_run,
    running_gateway,
    trainer_process,
    wait_state,
)
from tests.fakes.waiting import JOB_TIMEOUT, TIMEOUT, until
from trainwire.v1 import gateway_service_pb2, gateway_service_pb2_grpc, trainer_service_pb2

pytestmark = pytest.mark.slow

pb = gateway_service_pb2
State = pb.Run.State
LEASE_S = 3.0
REPLICA = {"lease_s": LEASE_S, "keepalive_s": 0.5}


class StartCounter(FakeTrainer):
    """The fake trainer, counting the Train calls it accepted (started a job for) per run."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.started: collections.Counter[str] = collections.Counter()

    def Train(
        self, request: trainer_service_pb2.TrainRequest, context: grpc.ServicerContext
    ) -> Iterator[trainer_service_pb2.TrainResponse]:
        first = True
        for response in super().Train(request, context):
            if first:  # refused calls abort before their first message
                with self._cond:
                    self.started[request.run_id] += 1
                first = False
            yield response


async def _give_to_a_ghost(replica: Any, run_id: str) -> None:
    """Hands the run to a replica that is gone, its lease expired: the replica driving it has
    lost it, and a live replica takes it over."""
    store = replica.gateway.core._store
    async with store.pool.connection() as conn:
        await conn.execute(
            "UPDATE runs SET owner = 'ghost', lease_until = now() - interval '1 s' WHERE id = %s",
            (run_id,),
        )


async def test_a_run_created_on_one_replica_is_watched_and_paused_on_another(
    fake: FakeTrainer, postgres_url: str
) -> None:
    trainers = (fake.address,)
    async with running_gateway(trainers, db=postgres_url, **REPLICA) as a:
        run = await a.create(max_episodes=200, episodes_per_second=50)
        await wait_state(a.stub, run.id, State.STATE_RUNNING)  # A drives it: B is not up yet

        async def published_one() -> bool:
            return (await a.get(run.id)).episode >= 1

        # RUNNING is the trainer's first answer, not a committed episode: B's watcher starts
        # with history to replay (its caught_up is checked below).
        await until(published_one, "episode 1 committed")
        async with running_gateway(trainers, db=postgres_url, **REPLICA) as b:
            watch = asyncio.create_task(collect(b.stub, run.id, timeout=JOB_TIMEOUT))
            await asyncio.sleep(1.0)
            on_b = await b.get(run.id)
            assert on_b.state == State.STATE_RUNNING
            assert "driven by another gateway replica" in on_b.state_detail
            asked = time.monotonic()
            reply = await b.stub.PauseRun(pb.PauseRunRequest(run_id=run.id), timeout=TIMEOUT)
            on_a = await a.get(run.id)
            paused_s = time.monotonic() - asked
            assert reply.run.state == State.STATE_PAUSED
            assert on_a.state == State.STATE_PAUSED
            assert paused_s < 1.0, f"paused after {paused_s:.2f} s"
            held = on_a.episode
            await asyncio.sleep(1.0)
            assert (await a.get(run.id)).episode == held, "published while paused"
            with pytest.raises(grpc.aio.AioRpcError) as refused:  # the owner's rules, on B
                await b.stub.DeleteRun(pb.DeleteRunRequest(run_id=run.id), timeout=TIMEOUT)
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            speed = await b.stub.SetRunSpeed(
                pb.SetRunSpeedRequest(run_id=run.id, speed=4), timeout=TIMEOUT
            )
            assert speed.run.speed == 4 and (await a.get(run.id)).speed == 4
            await b.stub.ResumeRun(pb.ResumeRunRequest(run_id=run.id), timeout=TIMEOUT)
            result = await watch
            assert result.numbers == list(range(1, 201)), "every episode exactly once"
            assert result.caught_up is not None and result.caught_up >= 1
            assert result.finished is not None and result.finished.state == State.STATE_DONE
            with pytest.raises(grpc.aio.AioRpcError) as late:
                await b.stub.PauseRun(pb.PauseRunRequest(run_id=run.id), timeout=TIMEOUT)
            assert late.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "it is DONE" in (late.value.details() or "")
            replay = await collect(b.stub, run.id)
            assert replay.numbers == list(range(1, 201))


async def test_controls_of_pending_and_running_runs_work_from_either_replica(
    fake: FakeTrainer, postgres_url: str
) -> None:
    nowhere = ("127.0.0.1:9",)  # no trainer: the runs stay PENDING
    async with (
        running_gateway(nowhere, db=postgres_url, **REPLICA) as a,
        running_gateway(nowhere, db=postgres_url, **REPLICA) as b,
    ):
        run = await a.create(max_episodes=50)

        async def queued_on_b() -> bool:  # B heard of the run
            return (await b.get(run.id)).state_detail.startswith("no trainer reachable")

        await until(queued_on_b, "B queueing the run")
        faster = await b.stub.SetRunSpeed(
            pb.SetRunSpeedRequest(run_id=run.id, speed=3), timeout=TIMEOUT
        )
        assert faster.run.speed == 3 and (await a.get(run.id)).speed == 3
        with pytest.raises(grpc.aio.AioRpcError) as early:
            await a.stub.PauseRun(pb.PauseRunRequest(run_id=run.id), timeout=TIMEOUT)
        assert early.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        with pytest.raises(grpc.aio.AioRpcError) as bad:
            await a.stub.SetRunSpeed(
                pb.SetRunSpeedRequest(run_id=run.id, speed=float("nan")), timeout=TIMEOUT
            )
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        stopped = await a.stub.StopRun(pb.StopRunRequest(run_id=run.id), timeout=TIMEOUT)
        assert stopped.run.state == State.STATE_STOPPED
        assert (await b.get(run.id)).state == State.STATE_STOPPED
        with pytest.raises(grpc.aio.AioRpcError) as missing:
            await b.stub.StopRun(pb.StopRunRequest(run_id="nosuchrun"), timeout=TIMEOUT)
        assert missing.value.code() == grpc.StatusCode.NOT_FOUND
        await b.stub.DeleteRun(pb.DeleteRunRequest(run_id=run.id), timeout=TIMEOUT)
        with pytest.raises(grpc.aio.AioRpcError) as gone:
            await a.get(run.id)
        assert gone.value.code() == grpc.StatusCode.NOT_FOUND
    trainers = (fake.address,)
    async with running_gateway(trainers, db=postgres_url, **REPLICA) as a:
        run = await a.create(max_episodes=2000, episodes_per_second=20)
        await wait_state(a.stub, run.id, State.STATE_RUNNING)
        async with running_gateway(trainers, db=postgres_url, **REPLICA) as b:
            stopped = await b.stub.StopRun(pb.StopRunRequest(run_id=run.id), timeout=TIMEOUT)
            assert stopped.run.state == State.STATE_STOPPED
            assert (await a.get(run.id)).state == State.STATE_STOPPED
            # The owner cancelled the training.
            await until(lambda: run.id in fake.jobs_cancelled, "the job cancelled")


async def test_100_concurrent_creates_over_two_replicas_start_each_run_once(
    postgres_url: str,
) -> None:
    fake = StartCounter(slots=2)
    fake.start()
    try:
        trainers = (fake.address,)
        # Leases long enough that no load can let one lapse: this is about claims (each run
        # started once, counted per Train call), not takeovers (a re-attach is a second call).
        steady = {**REPLICA, "lease_s": 30.0}
        async with (
            running_gateway(trainers, db=postgres_url, **steady) as a,
            running_gateway(trainers, db=postgres_url, **steady) as b,
        ):
            replies = await asyncio.gather(
                *(
                    (a if i % 2 else b).stub.CreateRun(
                        create_request(max_episodes=3, request_id=f"load-{i}"), timeout=TIMEOUT
                    )
                    for i in range(100)
                )
            )
            ids = {reply.run.id for reply in replies}
            assert len(ids) == 100
            # A retry of one of them on the other replica is the same run.
            again = await a.stub.CreateRun(
                create_request(max_episodes=3, request_id="load-0"), timeout=TIMEOUT
            )
            assert again.run.id == replies[0].run.id

            async def all_done() -> pb.ListRunsResponse | None:
                done = await a.stub.ListRuns(
                    pb.ListRunsRequest(page_size=1000, state=State.STATE_DONE), timeout=TIMEOUT
                )
                return done if len(done.runs) == 100 else None

            done = await until(all_done, "100 runs DONE")
            assert {r.id for r in done.runs} == ids
            assert all(r.episode == 3 for r in done.runs)
        assert dict(fake.started) == dict.fromkeys(ids, 1), "each run started exactly once"
    finally:
        fake.kill()


@pytest.fixture(scope="module")
def trainer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real trainer process (imitation on the CPU): it keeps detached jobs for a re-attach."""
    log = tmp_path_factory.mktemp("trainer") / "trainer.log"
    with trainer_process(log, "--heartbeat", "0.5", "--detach-grace", "60", slots=1) as (
        _,
        address,
    ):
        yield address


async def test_a_replica_that_lost_its_lease_stops_driving_and_its_watchers_go_on(
    trainer: str, postgres_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="gateway")
    trainers = (trainer,)
    async with running_gateway(trainers, db=postgres_url, **REPLICA) as a:
        run = await a.create(max_episodes=300, episodes_per_second=30)
        await wait_state(a.stub, run.id, State.STATE_RUNNING)
        watch = asyncio.create_task(collect(a.stub, run.id, timeout=JOB_TIMEOUT))
        async with running_gateway(trainers, db=postgres_url, **REPLICA) as b:
            await asyncio.sleep(1.0)
            # A stalled past its lease and a replica that is gone now took the run: A finds it
            # lost and stops driving it; then a live replica takes it over from the "ghost".
            await _give_to_a_ghost(a, run.id)
            result = await watch
            assert result.numbers == list(range(1, 301)), "every episode exactly once"
            assert result.finished is not None and result.finished.state == State.STATE_DONE
            assert (await b.get(run.id)).state == State.STATE_DONE
    text = caplog.text
    # A learns it at its next commit (fenced: NotOwner) or renewal, whichever comes first.
    assert f"run {run.id}: another gateway replica drives it now" in text
    assert f"run {run.id}: taking it over" in text
    assert "Traceback" not in text


@pytest.mark.parametrize("a_learns_by", ["renewal", "its stream"])
async def test_a_lease_lost_before_the_first_episode_hands_the_run_and_its_watchers_over(
    fake: FakeTrainer, postgres_url: str, caplog: pytest.LogCaptureFixture, a_learns_by: str
) -> None:
    # The loaded-machine case of the test above: the lease goes before any episode arrived, so
    # A has nothing to commit that a fence could refuse. A learns it from its lease renewal,
    # or (a stalled A that never renews) from the trainer ending its stream when B re-attaches.
    # Either way A's watcher follows the run to its end on B, and A never cancels the job that
    # B drives now (it did, on a loaded machine: the run then failed on B).
    caplog.set_level(logging.INFO, logger="gateway")
    script = Script(hold_at=1)  # the job starts, then sends heartbeats only until released
    fake.push(script)
    trainers = (fake.address,)
    async with running_gateway(trainers, db=postgres_url, **REPLICA) as a:
        if a_learns_by == "its stream":

            async def still_held(run_ids: list[str]) -> set[str]:
                return set(run_ids)

            a.gateway.core.router._replicas._leases.renew = still_held  # type: ignore[attr-defined]
        run = await a.create(max_episodes=50, episodes_per_second=30)
        await wait_state(a.stub, run.id, State.STATE_RUNNING)
        watch = asyncio.create_task(collect(a.stub, run.id, timeout=JOB_TIMEOUT))
        await asyncio.sleep(0.5)  # the watcher is attached to A's live log
        await _give_to_a_ghost(a, run.id)
        async with running_gateway(trainers, db=postgres_url, **REPLICA) as b:
            lost = f"run {run.id}: another gateway replica drives it now"
            taken = f"run {run.id}: taking it over"
            await until(
                lambda: lost in caplog.text and taken in caplog.text, "A lost it, B took it"
            )
            script.release.set()
            result = await watch
            assert result.numbers == list(range(1, 51)), "every episode exactly once"
            assert result.finished is not None and result.finished.state == State.STATE_DONE
            assert (await b.get(run.id)).state == State.STATE_DONE
    assert run.id not in fake.jobs_cancelled
    assert "Traceback" not in caplog.text


async def test_a_stop_that_meets_a_lost_lease_is_applied_by_the_new_owner(
    trainer: str, postgres_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    # A stalled replica is asked to stop a run whose lease it lost without knowing: its end is
    # refused by the store. The stop must reach the run through whoever owns it now, and the
    # trainer job is not cancelled behind that owner's back (it was: the user read STOPPED,
    # and the new owner's re-attach then failed the run "Interrupted").
    caplog.set_level(logging.INFO, logger="gateway")
    async with running_gateway((trainer,), db=postgres_url, **REPLICA) as a:

        async def still_held(run_ids: list[str]) -> set[str]:
            return set(run_ids)

        a.gateway.core.router._replicas._leases.renew = still_held  # type: ignore[attr-defined]
        run = await a.create(max_episodes=300, episodes_per_second=30)
        await wait_state(a.stub, run.id, State.STATE_RUNNING)
        await a.stub.PauseRun(pb.PauseRunRequest(run_id=run.id), timeout=TIMEOUT)
        # Paused, the trainer stops at its grant: once everything granted has arrived, A has
        # nothing more to commit, so no fenced write tells it of the lost lease.

        async def held_at_grant() -> bool:
            held = await a.get(run.id)
            granted = re.search(r"granted through (\d+)", held.state_detail)
            return bool(granted and held.trainer_episode == int(granted.group(1)))

        await until(held_at_grant, "A holding the run at its grant")
        await asyncio.sleep(0.5)  # the last arrivals committed
        await _give_to_a_ghost(a, run.id)
        reply = await a.stub.StopRun(pb.StopRunRequest(run_id=run.id), timeout=TIMEOUT)
        assert reply.run.state == State.STATE_STOPPED
        final = await collect(a.stub, run.id, timeout=JOB_TIMEOUT)
        assert final.finished is not None
        assert final.finished.state == State.STATE_STOPPED, final.finished.error_message
        stored = await a.get(run.id)
        assert stored.state == State.STATE_STOPPED and stored.episode == len(final.numbers)
    assert f"run {run.id}: taking it over" in caplog.text
    assert "Traceback" not in caplog.text


async def _watch_until(
    stub: gateway_service_pb2_grpc.GatewayServiceStub, run_id: str, count: int
) -> WatchResult:
    seen = WatchResult()
    call = stub.WatchRun(pb.WatchRunRequest(run_id=run_id), timeout=JOB_TIMEOUT)
    async for message in call:
        absorb(seen, message)
        if len(seen.episodes) >= count:
            call.cancel()
            break
    return seen


async def test_sigterm_hands_a_run_over_and_kill_9_of_its_new_replica_moves_it_again(
    trainer: str, postgres_url: str, tmp_path: Path
) -> None:
    flags = ("--db", postgres_url, "--lease-seconds", str(LEASE_S), "--keepalive", "0.5")
    flags += ("--heartbeat-timeout", "10", "--schedule-poll", "0.2")
    logs = [tmp_path / f"{name}.log" for name in ("a", "b", "c")]
    async with gateway_process(trainer, logs[0], *flags) as (proc_a, address_a):
        async with grpc.aio.insecure_channel(address_a) as channel:
            stub_a = gateway_service_pb2_grpc.GatewayServiceStub(channel)
            reply = await stub_a.CreateRun(
                create_request(max_episodes=500, episodes_per_second=40), timeout=TIMEOUT
            )
            run_id = reply.run.id
            await _watch_until(stub_a, run_id, 20)  # A drives it: B is not up yet
        async with (
            gateway_process(trainer, logs[1], *flags) as (proc_b, address_b),
            grpc.aio.insecure_channel(address_b) as channel_b,
        ):
            stub_b = gateway_service_pb2_grpc.GatewayServiceStub(channel_b)
            # SIGTERM: A releases the run and B takes it over at once (no lease to wait for).
            proc_a.terminate()
            assert await asyncio.wait_for(proc_a.wait(), TIMEOUT) == 0
            stopped_at = time.monotonic()
            episode = (await get_run(stub_b, run_id)).episode
            await _watch_until(stub_b, run_id, episode + 5)
            handover_s = time.monotonic() - stopped_at
            assert "training on" in (await get_run(stub_b, run_id)).state_detail
            async with (
                gateway_process(trainer, logs[2], *flags) as (_, address_c),
                grpc.aio.insecure_channel(address_c) as channel_c,
            ):
                stub_c = gateway_service_pb2_grpc.GatewayServiceStub(channel_c)
                seen = WatchResult()
                arrivals: list[tuple[float, int]] = []
                killed_at, before_kill = 0.0, 0
                call = stub_c.WatchRun(pb.WatchRunRequest(run_id=run_id), timeout=JOB_TIMEOUT)
                async for message in call:
                    absorb(seen, message)
                    arrivals.append((time.monotonic(), len(seen.episodes)))
                    if not killed_at and len(seen.episodes) >= episode + 60:
                        proc_b.kill()  # SIGKILL: no release, the lease has to expire
                        await proc_b.wait()
                        killed_at, before_kill = time.monotonic(), len(seen.episodes)
                    if seen.finished is not None:
                        break
    assert seen.numbers == list(range(1, 501)), "every episode exactly once"
    assert seen.finished is not None and seen.finished.state == State.STATE_DONE
    resumed_at = next(t for t, count in arrivals if t > killed_at and count > before_kill)
    takeover_s = resumed_at - killed_at
    assert takeover_s < LEASE_S + 5, f"taken over after {takeover_s:.1f} s"
    assert handover_s < 5, f"handed over after {handover_s:.1f} s"
    print(f"\nSIGTERM handover {handover_s:.2f} s; kill -9 takeover {takeover_s:.2f} s")
    for log in logs[1:]:
        text = log.read_text()
        assert f"run {run_id}: taking it over" in text
        assert f"run {run_id}: re-attaching to its job on {trainer} after episode" in text
    assert "released 1 runs to the other replicas" in logs[0].read_text()
    assert not any("Traceback" in log.read_text() for log in logs)

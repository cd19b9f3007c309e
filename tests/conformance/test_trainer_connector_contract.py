"""The ``TrainerConnector`` contract, run against the fake the gateway core's tests trust
(``MemoryConnector``) and the real trainer core (``JobRunner`` behind the real servicer and
gRPC connector, the transport in process: ``CoreConnector``), so the fake is held to the real
thing: grants, cancellation with and without a final checkpoint, re-attach, resume candidates,
busy trainers, live hyperparameters and the errors of unknown runs.

Every read is bounded (``next_event`` with ``TIMEOUT``), waits are on conditions, and what is
compared is what the gateway core sees: event kinds and numbers, records and error kinds, never
episode contents that each implementation makes its own way.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from gateway.core.trainers import (
    Cancelled,
    CheckpointFailed,
    CheckpointSaved,
    JobPlacement,
    Rendezvous,
    Resumed,
    ResumePoint,
    StreamEvent,
    TrainerBusy,
    TrainerCrashed,
    TrainerFailed,
    TrainerJobExists,
    TrainerJobFinished,
    TrainerJobGone,
    TrainerLost,
    TrainerProcessDied,
    TrainerRefused,
    TrainerStream,
    next_event,
)
from tests.conformance.conftest import Trainers
from tests.fakes.episodes import reward_of
from tests.fakes.waiting import TIMEOUT, until
from trainer_service.providers.defaults import grpo_proto, imitation_proto
from trainwire.hyperparameters import Hyperparameters
from trainwire.v1 import episode_pb2

A = "trainer-a:50051"
B = "trainer-b:50051"


def task(learning_rate: float = 0.0) -> episode_pb2.TrainTask:
    return episode_pb2.TrainTask(
        imitation=episode_pb2.ImitationTask(
            rig_name="stickman", clip_name="wave", learning_rate=learning_rate
        )
    )


def grpo_task(num_processes: int = 1, lora: bool = False) -> episode_pb2.TrainTask:
    grpo = episode_pb2.GrpoTask(
        model_path="models/m", dataset_path="data/d.jsonl", num_processes=num_processes
    )
    if lora:
        grpo.lora.rank = 8
    return episode_pb2.TrainTask(grpo=grpo)


def config(max_episodes: int, checkpoint_every: int = 0) -> episode_pb2.TrainConfig:
    return episode_pb2.TrainConfig(
        max_episodes=max_episodes, seed=1, checkpoint_every=checkpoint_every
    )


def kind(event: StreamEvent) -> str:
    """``e3`` (episode), ``c3`` (checkpoint), ``f3`` (failed checkpoint), ``r3`` (resumed at
    3), ``z`` (rendezvous), ``h`` (heartbeat)."""
    if event is None:
        return "h"
    if isinstance(event, episode_pb2.Episode):
        return f"e{event.episode}"
    if isinstance(event, CheckpointSaved):
        return f"c{event.episode}"
    if isinstance(event, CheckpointFailed):
        return f"f{event.episode}"
    if isinstance(event, Resumed):
        return f"r{event.episode}"
    assert isinstance(event, Rendezvous)
    return "z"


def kinds(events: Sequence[StreamEvent]) -> list[str]:
    """The kinds of ``events``, heartbeats left out."""
    return [kind(e) for e in events if e is not None]


def first_event(events: Sequence[StreamEvent]) -> StreamEvent:
    """The first of ``events`` that is not a heartbeat (one may come first while a loaded
    machine starts the job)."""
    return next(e for e in events if e is not None)


async def read(stream: TrainerStream) -> StreamEvent:
    return await next_event(stream, TIMEOUT, "nothing from the trainer")


async def read_until(stream: TrainerStream, last: str) -> list[StreamEvent]:
    """The events through the first of kind ``last`` (heartbeats included)."""
    events: list[StreamEvent] = []
    while not events or kind(events[-1]) != last:
        events.append(await read(stream))
    return events


async def read_to_end(stream: TrainerStream) -> list[StreamEvent]:
    """Every event left, to the stream's normal end (raises what ends it otherwise)."""
    events: list[StreamEvent] = []
    while True:
        try:
            events.append(await read(stream))
        except StopAsyncIteration:
            return events


async def read_failure(stream: TrainerStream) -> tuple[list[StreamEvent], BaseException]:
    """Every event left and the error that ends the stream (fails if it ends normally)."""
    events: list[StreamEvent] = []
    while True:
        try:
            events.append(await read(stream))
        except StopAsyncIteration:
            raise AssertionError(f"the stream ended normally after {kinds(events)}") from None
        except Exception as exc:
            return events, exc


async def heartbeats(stream: TrainerStream, count: int) -> None:
    """The next ``count`` events are heartbeats: the job waits."""
    for _ in range(count):
        event = await read(stream)
        assert event is None, f"expected a heartbeat, got {kind(event)}"


def episodes(events: Sequence[StreamEvent]) -> list[episode_pb2.Episode]:
    return [e for e in events if isinstance(e, episode_pb2.Episode)]


def checkpoints(events: Sequence[StreamEvent]) -> dict[int, CheckpointSaved]:
    return {e.episode: e for e in events if isinstance(e, CheckpointSaved)}


async def slots_free(trainers: Trainers, address: str) -> int:
    return (await trainers.connector.capabilities(address, TIMEOUT)).slots_free


async def wait_slots_free(trainers: Trainers, address: str, count: int) -> None:
    async def free() -> bool:
        return await slots_free(trainers, address) == count

    await until(free, f"{count} free slot(s) on {address}")


def best_through(n: int) -> float:
    return max(reward_of(k) for k in range(1, n + 1))


# -- capabilities ------------------------------------------------------------------------------


async def test_capabilities_report_providers_and_slots(trainers: Trainers) -> None:
    trainers.add(A, 2)
    caps = await trainers.connector.capabilities(A, TIMEOUT)
    assert (caps.providers, caps.slots_total, caps.slots_free) == (("imitation",), 2, 2)
    # The real imitation provider's defaults, from their one source.
    assert dict(caps.provider_defaults) == {"imitation": imitation_proto()}
    trainers.add(B, 1, grpo=True)
    both = await trainers.connector.capabilities(B, TIMEOUT)
    assert dict(both.provider_defaults) == {"imitation": imitation_proto(), "grpo": grpo_proto()}
    with pytest.raises(TrainerLost):
        await trainers.connector.capabilities("trainer-c:50051", TIMEOUT)  # nobody there


# -- grants ------------------------------------------------------------------------------------


async def test_a_job_streams_only_up_to_its_grant_and_goes_on_with_a_later_one(
    trainers: Trainers,
) -> None:
    trainers.add(A, 2)
    connector = trainers.connector
    stream = connector.train(A, "run-1", task(), config(10), grant_through_episode=3)
    assert kinds(await read_until(stream, "e3")) == ["e1", "e2", "e3"]
    await heartbeats(stream, 2)
    assert await slots_free(trainers, A) == 1  # the waiting job holds its slot
    assert await connector.grant(A, "run-1", 3, TIMEOUT) == 3  # nothing produced past it
    assert await connector.grant(A, "run-1", 2, TIMEOUT) == 3  # never back

    assert await connector.grant(A, "run-1", 6, TIMEOUT) == 3
    assert kinds(await read_until(stream, "e6")) == ["e4", "e5", "e6"]
    await heartbeats(stream, 2)

    await connector.grant(A, "run-1", 10, TIMEOUT)
    rest = await read_to_end(stream)
    assert kinds(rest) == ["e7", "e8", "e9", "e10", "c10"]  # a checkpoint after the last
    last = episodes(rest)[-1]
    assert last.done and not any(e.done for e in episodes(rest)[:-1])
    assert last.best_reward == pytest.approx(best_through(10))
    assert await slots_free(trainers, A) == 2  # freed before the end went out


# -- cancellation ------------------------------------------------------------------------------


async def test_cancel_stops_the_job_and_ends_its_stream(trainers: Trainers) -> None:
    trainers.add(A, 1)
    connector = trainers.connector
    stream = connector.train(A, "run-1", task(), config(10), grant_through_episode=3)
    await read_until(stream, "e3")
    assert await connector.cancel_job(A, "run-1", TIMEOUT) == Cancelled(last_episode=3)
    events, error = await read_failure(stream)
    assert kinds(events) == []
    assert isinstance(error, TrainerLost)
    with pytest.raises(TrainerJobGone):
        await connector.grant(A, "run-1", 5, TIMEOUT)
    await wait_slots_free(trainers, A, 1)
    # The run may start again: its old job is gone.
    again = connector.train(A, "run-1", task(), config(2), grant_through_episode=2)
    assert kinds(await read_to_end(again)) == ["e1", "e2", "c2"]


async def test_cancel_with_a_final_checkpoint_reports_it(trainers: Trainers) -> None:
    trainers.add(A, 1)
    connector = trainers.connector
    stream = connector.train(A, "run-1", task(), config(20, 2), grant_through_episode=5)
    before = await read_until(stream, "e5")
    assert kinds(before) == ["e1", "e2", "c2", "e3", "e4", "c4", "e5"]
    cancelled = await connector.cancel_job(A, "run-1", TIMEOUT, checkpoint=True)
    assert cancelled.last_episode == 5
    assert cancelled.checkpoint is not None and cancelled.checkpoint.episode == 5
    assert cancelled.checkpoint_error == ""
    # The open stream gets that checkpoint, then the cancellation.
    events, error = await read_failure(stream)
    assert kinds(events) == ["c5"]
    assert checkpoints(events)[5] == cancelled.checkpoint
    assert isinstance(error, TrainerLost)
    await wait_slots_free(trainers, A, 1)


async def test_a_final_checkpoint_right_after_a_periodic_one_is_that_one(
    trainers: Trainers,
) -> None:
    trainers.add(A, 1)
    connector = trainers.connector
    stream = connector.train(A, "run-1", task(), config(20, 2), grant_through_episode=4)
    periodic = checkpoints(await read_until(stream, "c4"))[4]
    cancelled = await connector.cancel_job(A, "run-1", TIMEOUT, checkpoint=True)
    assert cancelled == Cancelled(4, periodic, "")
    events, error = await read_failure(stream)
    assert kinds(events) == []  # no second checkpoint of episode 4
    assert isinstance(error, TrainerLost)


# -- re-attach ---------------------------------------------------------------------------------


async def test_a_re_attach_streams_from_the_next_episode_without_duplicates(
    trainers: Trainers,
) -> None:
    trainers.add(A, 1)
    connector = trainers.connector
    first = connector.train(A, "run-1", task(), config(10, 2), grant_through_episode=4)
    assert kinds(await read_until(first, "c4")) == ["e1", "e2", "c2", "e3", "e4", "c4"]
    first.cancel()  # the stream broke; the job waits for a re-attach
    with pytest.raises(TrainerLost):
        await read(first)
    again = connector.train(
        A, "run-1", task(), config(10, 2), grant_through_episode=6, attach_after_episode=3
    )
    events = await read_until(again, "c6")
    # Checkpoint events again once their episode was sent; episodes from 4 on, each once.
    assert kinds(events) == ["c2", "e4", "c4", "e5", "e6", "c6"]
    await heartbeats(again, 2)
    await connector.grant(A, "run-1", 10, TIMEOUT)
    assert kinds(await read_to_end(again)) == ["e7", "e8", "c8", "e9", "e10", "c10"]


async def test_a_re_attach_after_the_last_sent_episode_sends_only_new_ones(
    trainers: Trainers,
) -> None:
    trainers.add(A, 1)
    connector = trainers.connector
    first = connector.train(A, "run-1", task(), config(6), grant_through_episode=6)
    sent = await read_until(first, "e4")
    first.cancel()
    again = connector.train(
        A, "run-1", task(), config(6), grant_through_episode=6, attach_after_episode=4
    )
    rest = await read_to_end(again)
    assert kinds(rest) == ["e5", "e6", "c6"]
    numbers = [e.episode for e in episodes(sent)] + [e.episode for e in episodes(rest)]
    assert numbers == [1, 2, 3, 4, 5, 6]


async def test_a_second_train_of_a_live_run_is_refused_as_existing(trainers: Trainers) -> None:
    trainers.add(A, 2)
    connector = trainers.connector
    stream = connector.train(A, "run-1", task(), config(10), grant_through_episode=2)
    await read_until(stream, "e2")
    with pytest.raises(TrainerJobExists):
        await read(connector.train(A, "run-1", task(), config(10), grant_through_episode=2))
    await connector.grant(A, "run-1", 3, TIMEOUT)
    assert kinds(await read_until(stream, "e3")) == ["e3"]  # the live job goes on


# -- resume candidates -------------------------------------------------------------------------


async def _checkpoints_of_a_finished_run(trainers: Trainers) -> dict[int, CheckpointSaved]:
    stream = trainers.connector.train(A, "run-1", task(), config(6, 2), grant_through_episode=6)
    events = await read_to_end(stream)
    assert kinds(events) == ["e1", "e2", "c2", "e3", "e4", "c4", "e5", "e6", "c6"]
    return checkpoints(events)


async def test_a_job_resumes_from_the_newest_usable_candidate(trainers: Trainers) -> None:
    trainers.add(A, 1)
    saved = await _checkpoints_of_a_finished_run(trainers)
    await wait_slots_free(trainers, A, 1)
    damaged = CheckpointSaved(6, saved[6].create_time, saved[6].size_bytes, "0" * 64)
    missing = CheckpointSaved(5, saved[4].create_time + 1, 1000, "ab" * 32)
    candidates = [
        ResumePoint("run-1", damaged),  # the gateway's record disagrees with the store
        ResumePoint("run-1", missing),  # never written
        ResumePoint("run-1", saved[4]),
        ResumePoint("run-1", saved[2]),
    ]
    stream = trainers.connector.train(
        A, "run-2", task(), config(10, 2), grant_through_episode=10, resume_from=candidates
    )
    events = await read_to_end(stream)
    assert kinds(events) == ["r4", "e5", "e6", "c6", "e7", "e8", "c8", "e9", "e10", "c10"]
    resumed = first_event(events)
    assert isinstance(resumed, Resumed)
    assert resumed.best_reward == pytest.approx(best_through(4))
    assert [(n, why.split(":")[0]) for n, why in resumed.skipped] == [
        (6, "digest mismatch"),
        (5, "missing"),
    ]
    first = episodes(events)[0]
    assert first.best_reward == pytest.approx(best_through(5))  # on from the restored best


async def test_no_usable_candidate_starts_from_scratch_saying_so(trainers: Trainers) -> None:
    trainers.add(A, 1)
    missing = CheckpointSaved(3, 1_700_000_000_000_000_000, 1000, "cd" * 32)
    stream = trainers.connector.train(
        A,
        "run-1",
        task(),
        config(3),
        grant_through_episode=3,
        resume_from=[ResumePoint("run-0", missing)],
    )
    events = await read_to_end(stream)
    assert kinds(events)[:4] == ["r0", "e1", "e2", "e3"]
    resumed = first_event(events)
    assert isinstance(resumed, Resumed)
    assert [n for n, _ in resumed.skipped] == [3]


async def test_a_re_attach_at_the_restored_episode_sends_resumed_again(
    trainers: Trainers,
) -> None:
    trainers.add(A, 1)
    saved = await _checkpoints_of_a_finished_run(trainers)
    await wait_slots_free(trainers, A, 1)
    first = trainers.connector.train(
        A,
        "run-2",
        task(),
        config(10),
        grant_through_episode=10,
        resume_from=[ResumePoint("run-1", saved[4])],
    )
    assert kinds(await read_until(first, "r4")) == ["r4"]
    first.cancel()  # a gateway that restarted before it stored anything of this job
    again = trainers.connector.train(
        A, "run-2", task(), config(10), grant_through_episode=10, attach_after_episode=4
    )
    events = await read_to_end(again)
    assert kinds(events) == ["r4", "e5", "e6", "e7", "e8", "e9", "e10", "c10"]


# -- busy --------------------------------------------------------------------------------------


async def test_a_trainer_with_every_slot_taken_refuses_as_busy(trainers: Trainers) -> None:
    trainers.add(A, 1)
    connector = trainers.connector
    first = connector.train(A, "run-a", task(), config(10), grant_through_episode=2)
    await read_until(first, "e2")
    assert await slots_free(trainers, A) == 0
    with pytest.raises(TrainerBusy):
        await read(connector.train(A, "run-b", task(), config(10), grant_through_episode=2))
    with pytest.raises(TrainerJobGone):  # the refused job is not there
        await connector.grant(A, "run-b", 3, TIMEOUT)
    await connector.cancel_job(A, "run-a", TIMEOUT)
    await wait_slots_free(trainers, A, 1)
    second = connector.train(A, "run-b", task(), config(2), grant_through_episode=2)
    assert kinds(await read_to_end(second)) == ["e1", "e2", "c2"]


# -- live hyperparameters ----------------------------------------------------------------------


async def test_a_hyperparameter_change_applies_from_the_next_step(trainers: Trainers) -> None:
    trainers.add(A, 1)
    connector = trainers.connector
    stream = connector.train(A, "run-1", task(0.05), config(6), grant_through_episode=2)
    before = episodes(await read_until(stream, "e2"))
    assert [e.metrics["learning_rate"] for e in before] == pytest.approx([0.05, 0.05])
    await heartbeats(stream, 1)
    await connector.set_hyperparameters(A, "run-1", Hyperparameters(learning_rate=0.01), TIMEOUT)
    await connector.grant(A, "run-1", 4, TIMEOUT)
    after = episodes(await read_until(stream, "e4"))
    assert [e.metrics["learning_rate"] for e in after] == pytest.approx([0.01, 0.01])

    # Out of range, or one imitation does not have: refused, naming the field.
    refused = await _refused(trainers, Hyperparameters(learning_rate=-1.0))
    assert [v.field for v in refused.violations] == ["learning_rate"]
    assert refused.user_message
    refused = await _refused(trainers, Hyperparameters(temperature=0.5))
    assert [v.field for v in refused.violations] == ["temperature"]

    await connector.grant(A, "run-1", 6, TIMEOUT)
    rest = await read_to_end(stream)
    assert [e.metrics["learning_rate"] for e in episodes(rest)] == pytest.approx([0.01, 0.01])
    with pytest.raises(TrainerJobFinished):
        await connector.set_hyperparameters(
            A, "run-1", Hyperparameters(learning_rate=0.02), TIMEOUT
        )


async def test_a_job_starts_with_the_default_learning_rate(trainers: Trainers) -> None:
    trainers.add(A, 1)
    stream = trainers.connector.train(A, "run-1", task(), config(1), grant_through_episode=1)
    [episode] = episodes(await read_to_end(stream))
    assert episode.metrics["learning_rate"] == pytest.approx(0.03)


async def _refused(trainers: Trainers, change: Hyperparameters) -> TrainerRefused:
    with pytest.raises(TrainerRefused) as refused:
        await trainers.connector.set_hyperparameters(A, "run-1", change, TIMEOUT)
    return refused.value


# -- unknown runs ------------------------------------------------------------------------------


async def test_calls_for_a_run_without_a_job(trainers: Trainers) -> None:
    trainers.add(A, 1)
    connector = trainers.connector
    with pytest.raises(TrainerJobGone):
        await connector.grant(A, "no-such-run", 3, TIMEOUT)
    with pytest.raises(TrainerJobGone):
        await connector.set_hyperparameters(
            A, "no-such-run", Hyperparameters(learning_rate=0.01), TIMEOUT
        )
    with pytest.raises(TrainerJobGone):
        await read(
            connector.train(
                A, "no-such-run", task(), config(5), grant_through_episode=5, attach_after_episode=2
            )
        )
    # Cancelling a job that is gone is fine; a final checkpoint of it says why there is none.
    assert await connector.cancel_job(A, "no-such-run", TIMEOUT) == Cancelled()
    assert await connector.cancel_job(A, "no-such-run", TIMEOUT, checkpoint=True) == Cancelled(
        checkpoint_error="the job was gone"
    )
    with pytest.raises(TrainerLost):
        await connector.grant(B, "no-such-run", 3, TIMEOUT)  # no trainer there


# -- finished jobs and replaced streams --------------------------------------------------------


async def test_a_finished_job_replays_its_episodes_and_its_end_to_a_re_attach(
    trainers: Trainers,
) -> None:
    trainers.add(A, 1)
    connector = trainers.connector
    first = connector.train(A, "run-1", task(), config(5, 2), grant_through_episode=5)
    assert kinds(await read_to_end(first)) == ["e1", "e2", "c2", "e3", "e4", "c4", "e5", "c5"]
    # A gateway that restarted before it stored the last episodes.
    again = connector.train(
        A, "run-1", task(), config(5, 2), grant_through_episode=5, attach_after_episode=3
    )
    assert kinds(await read_to_end(again)) == ["c2", "e4", "c4", "e5", "c5"]
    # A new job of the run replaces the finished one.
    new = connector.train(A, "run-1", task(), config(2), grant_through_episode=2)
    assert kinds(await read_to_end(new)) == ["e1", "e2", "c2"]


async def test_a_re_attach_replaces_the_stream_attached_before(trainers: Trainers) -> None:
    trainers.add(A, 1)
    connector = trainers.connector
    first = connector.train(A, "run-1", task(), config(10), grant_through_episode=2)
    await read_until(first, "e2")
    second = connector.train(
        A, "run-1", task(), config(10), grant_through_episode=4, attach_after_episode=2
    )
    assert kinds(await read_until(second, "e4")) == ["e3", "e4"]
    events, error = await read_failure(first)
    assert kinds(events) == []
    assert isinstance(error, TrainerCrashed)  # ABORTED: not lost, not the user's


# -- what a trainer cannot run ------------------------------------------------------------------


async def test_a_task_whose_provider_the_trainer_lacks_fails(trainers: Trainers) -> None:
    trainers.add(A, 1)  # imitation only
    stream = trainers.connector.train(A, "run-1", grpo_task(), config(3), grant_through_episode=3)
    with pytest.raises(TrainerFailed) as failed:
        await read(stream)
    assert failed.value.user_message
    assert await slots_free(trainers, A) == 1


async def test_a_job_takes_a_slot_per_process_and_waits_for_them_all(trainers: Trainers) -> None:
    trainers.add(A, 2, grpo=True)
    connector = trainers.connector
    one = connector.train(A, "run-a", task(), config(10), grant_through_episode=1)
    await read_until(one, "e1")
    with pytest.raises(TrainerBusy):  # two processes, one slot free
        await read(connector.train(A, "run-b", grpo_task(2), config(3), grant_through_episode=3))
    await connector.cancel_job(A, "run-a", TIMEOUT)
    await wait_slots_free(trainers, A, 2)
    both = connector.train(A, "run-b", grpo_task(2), config(3), grant_through_episode=1)
    await read_until(both, "e1")
    assert await slots_free(trainers, A) == 0


async def test_a_job_that_needs_more_slots_than_the_trainer_has_fails(trainers: Trainers) -> None:
    trainers.add(A, 2, grpo=True)
    stream = trainers.connector.train(A, "run-1", grpo_task(3), config(3), grant_through_episode=3)
    # Not busy: no slot will ever free up enough for it.
    with pytest.raises(TrainerFailed) as failed:
        await read(stream)
    assert "slots" in failed.value.user_message


# -- live hyperparameters of GRPO jobs ---------------------------------------------------------


async def test_grpo_jobs_start_with_their_kinds_defaults(trainers: Trainers) -> None:
    trainers.add(A, 2, grpo=True)
    connector = trainers.connector
    full = connector.train(A, "full", grpo_task(), config(1), grant_through_episode=1)
    lora = connector.train(A, "lora", grpo_task(lora=True), config(1), grant_through_episode=1)
    [first] = episodes(await read_to_end(full))
    [second] = episodes(await read_to_end(lora))
    values = ("learning_rate", "temperature", "beta")
    assert [first.metrics[name] for name in values] == pytest.approx([3e-3, 1.0, 0.0])
    assert [second.metrics[name] for name in values] == pytest.approx([1e-2, 1.0, 0.04])


async def test_beta_may_rise_only_for_a_job_with_a_reference_model(trainers: Trainers) -> None:
    trainers.add(A, 2, grpo=True)
    connector = trainers.connector
    full = connector.train(A, "full", grpo_task(), config(4), grant_through_episode=1)
    lora = connector.train(A, "lora", grpo_task(lora=True), config(4), grant_through_episode=1)
    await read_until(full, "e1")
    await read_until(lora, "e1")
    raise_beta = Hyperparameters(beta=0.1)
    with pytest.raises(TrainerRefused) as refused:  # full fine-tuning started at beta 0
        await connector.set_hyperparameters(A, "full", raise_beta, TIMEOUT)
    assert [v.field for v in refused.value.violations] == ["beta"]
    await connector.set_hyperparameters(A, "lora", raise_beta, TIMEOUT)  # its base model
    await connector.grant(A, "lora", 2, TIMEOUT)
    [episode] = episodes(await read_until(lora, "e2"))
    assert episode.metrics["beta"] == pytest.approx(0.1)


# -- jobs that span trainers -------------------------------------------------------------------


async def _spanning_job(trainers: Trainers, grant: int = 3) -> tuple[TrainerStream, TrainerStream]:
    """Rank 0's share of a 2-process job of 3 episodes on A (announcing its rendezvous first,
    and training nothing before the other share joined) and the other share on B."""
    trainers.add(A, 1, grpo=True)
    trainers.add(B, 1, grpo=True)
    connector = trainers.connector
    rank_0 = connector.train(
        A, "run-1", grpo_task(2), config(3), grant, placement=JobPlacement(2, 0, 1)
    )
    rendezvous = await read(rank_0)
    assert isinstance(rendezvous, Rendezvous) and rendezvous.address
    await heartbeats(rank_0, 2)  # waits for the other rank
    share = connector.train(
        B,
        "run-1",
        grpo_task(2),
        config(3),
        grant,
        placement=JobPlacement(2, 1, 1, rendezvous.address),
    )
    return rank_0, share


async def test_a_job_across_trainers_trains_once_every_rank_joined(trainers: Trainers) -> None:
    rank_0, share = await _spanning_job(trainers)
    assert kinds(await read_to_end(rank_0)) == ["e1", "e2", "e3", "c3"]
    assert kinds(await read_to_end(share)) == []  # heartbeats only, then OK
    await wait_slots_free(trainers, A, 1)
    await wait_slots_free(trainers, B, 1)


async def test_the_other_shares_fail_when_rank_0_stops_short(trainers: Trainers) -> None:
    rank_0, share = await _spanning_job(trainers, grant=1)
    await read_until(rank_0, "e1")
    await heartbeats(rank_0, 1)  # at its grant
    assert await slots_free(trainers, B) == 0  # the share holds its slot
    await trainers.connector.cancel_job(A, "run-1", TIMEOUT)
    events, error = await read_failure(share)
    assert kinds(events) == []
    assert isinstance(error, TrainerProcessDied)
    await wait_slots_free(trainers, B, 1)


async def test_a_final_checkpoint_before_any_episode_says_the_job_had_not_trained(
    trainers: Trainers,
) -> None:
    # Rank 0 of a job across trainers is live, and trains nothing, until the other rank joins.
    trainers.add(A, 1, grpo=True)
    connector = trainers.connector
    rank_0 = connector.train(
        A, "run-1", grpo_task(2), config(3, 1), 3, placement=JobPlacement(2, 0, 1)
    )
    assert isinstance(await read(rank_0), Rendezvous)
    await heartbeats(rank_0, 1)
    cancelled = await connector.cancel_job(A, "run-1", TIMEOUT, checkpoint=True)
    assert cancelled == Cancelled(checkpoint_error="the job had not trained an episode")
    events, error = await read_failure(rank_0)
    assert kinds(events) == []
    assert isinstance(error, TrainerLost)
    await wait_slots_free(trainers, A, 1)


# -- the trainer core's rules that the fake calls, not copies ----------------------------------


async def test_a_too_big_job_is_refused_naming_the_field_and_the_limit(trainers: Trainers) -> None:
    trainers.add(A, 2, grpo=True)
    stream = trainers.connector.train(A, "run-1", grpo_task(3), config(3), grant_through_episode=3)
    with pytest.raises(TrainerFailed) as failed:
        await read(stream)
    assert failed.value.user_message == (
        "The trainer refused this task: task.grpo: needs 3 slots (one per process, each on its "
        "own GPU when there are GPUs); this trainer can give one job at most 2"
    )


async def test_a_refused_hyperparameter_change_says_so_in_the_trainer_s_words(
    trainers: Trainers,
) -> None:
    trainers.add(A, 1, grpo=True)
    connector = trainers.connector
    full = connector.train(A, "full", grpo_task(), config(4), grant_through_episode=1)
    await read_until(full, "e1")
    with pytest.raises(TrainerRefused) as refused:
        await connector.set_hyperparameters(A, "full", Hyperparameters(beta=0.1), TIMEOUT)
    assert refused.value.user_message.startswith("The hyperparameters cannot be changed: beta: ")


async def test_another_run_s_candidate_that_does_not_fit_is_skipped(trainers: Trainers) -> None:
    trainers.add(A, 1, grpo=True)
    saved = await _checkpoints_of_a_finished_run(trainers)
    await wait_slots_free(trainers, A, 1)
    # A fork that ends at episode 5 cannot continue after episode 6; one of another task kind
    # cannot continue an imitation checkpoint at all.
    after_its_end = trainers.connector.train(
        A,
        "fork-1",
        task(),
        config(5),
        grant_through_episode=5,
        resume_from=[ResumePoint("run-1", saved[6]), ResumePoint("run-1", saved[4])],
    )
    events = await read_to_end(after_its_end)
    assert kinds(events) == ["r4", "e5", "c5"]
    resumed = first_event(events)
    assert isinstance(resumed, Resumed)
    assert [(n, why.split(":")[0]) for n, why in resumed.skipped] == [(6, "does not fit")]
    await wait_slots_free(trainers, A, 1)
    other_kind = trainers.connector.train(
        A,
        "fork-2",
        grpo_task(),
        config(10),
        grant_through_episode=1,
        resume_from=[ResumePoint("run-1", saved[4])],
    )
    events = await read_until(other_kind, "e1")
    resumed = kinds(events)[0], first_event(events)
    assert resumed[0] == "r0"
    assert isinstance(resumed[1], Resumed)
    assert [(n, why.split(":")[0]) for n, why in resumed[1].skipped] == [(4, "does not fit")]


@pytest.mark.parametrize("own_run", [True, False])
async def test_a_final_checkpoint_of_a_job_that_only_restored_one(
    trainers: Trainers, own_run: bool
) -> None:
    """Its own run's restored checkpoint is the final one; a fork that trained nothing since
    its parent's has none."""
    trainers.add(A, 1)
    saved = await _checkpoints_of_a_finished_run(trainers)
    await wait_slots_free(trainers, A, 1)
    run_id = "run-1" if own_run else "fork-1"
    stream = trainers.connector.train(
        A,
        run_id,
        task(),
        config(10),
        grant_through_episode=4,  # nothing to train after the restored episode 4
        resume_from=[ResumePoint("run-1", saved[4])],
    )
    await read(stream)  # the job is live (resumed, or a heartbeat while it restores)
    cancelled = await trainers.connector.cancel_job(A, run_id, TIMEOUT, checkpoint=True)
    if own_run:
        assert cancelled == Cancelled(4, saved[4], "")
    else:
        assert cancelled == Cancelled(4, None, "the job had not trained an episode")
    await wait_slots_free(trainers, A, 1)


async def test_a_re_attach_with_another_config_is_refused(trainers: Trainers) -> None:
    trainers.add(A, 1)
    connector = trainers.connector
    stream = connector.train(A, "run-1", task(), config(10), grant_through_episode=2)
    await read_until(stream, "e2")
    other = connector.train(
        A, "run-1", task(), config(11), grant_through_episode=2, attach_after_episode=2
    )
    with pytest.raises(TrainerFailed) as failed:
        await read(other)
    assert "task" in failed.value.user_message
    # A changed learning rate is the run's live value, not another task.
    same = connector.train(
        A, "run-1", task(0.5), config(10), grant_through_episode=3, attach_after_episode=2
    )
    assert kinds(await read_until(same, "e3")) == ["e3"]


async def test_a_share_whose_rendezvous_is_gone_fails_as_a_process_died(
    trainers: Trainers,
) -> None:
    trainers.add(B, 1, grpo=True)
    share = trainers.connector.train(
        B, "run-1", grpo_task(2), config(3), 3, placement=JobPlacement(2, 1, 1, "127.0.0.1:1")
    )
    events, error = await read_failure(share)
    assert kinds(events) == []
    assert isinstance(error, TrainerProcessDied)
    await wait_slots_free(trainers, B, 1)


async def test_a_share_that_cannot_restore_rank_0_s_checkpoint_fails(trainers: Trainers) -> None:
    trainers.add(B, 1, grpo=True)
    missing = CheckpointSaved(4, 1_700_000_000_000_000_000, 1000, "ab" * 32)
    share = trainers.connector.train(
        B,
        "run-1",
        grpo_task(2),
        config(6),
        6,
        resume_from=[ResumePoint("run-1", missing)],
        placement=JobPlacement(2, 1, 1, "127.0.0.1:1"),
    )
    events, error = await read_failure(share)
    assert kinds(events) == []
    assert isinstance(error, TrainerFailed) and not isinstance(error, TrainerProcessDied)
    assert "every trainer of the job needs it" in error.user_message
    await wait_slots_free(trainers, B, 1)


async def test_a_re_attach_after_an_episode_not_produced_yet_is_refused(
    trainers: Trainers,
) -> None:
    trainers.add(A, 1)
    connector = trainers.connector
    stream = connector.train(A, "run-1", task(), config(10), grant_through_episode=2)
    await read_until(stream, "e2")
    ahead = connector.train(
        A, "run-1", task(), config(10), grant_through_episode=2, attach_after_episode=5
    )
    with pytest.raises(TrainerJobGone):
        await read(ahead)
    await connector.grant(A, "run-1", 3, TIMEOUT)
    assert kinds(await read_until(stream, "e3")) == ["e3"]  # the attached stream goes on

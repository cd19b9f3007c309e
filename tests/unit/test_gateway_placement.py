"""The pieces of a job across trainers outside the core's loop: the slots a task needs, a
placement's shape and words, the ``TrainRequest.placement`` and ``Rendezvous`` event on the wire,
how a failed share ends a run, and ``Run.trainers`` in the proto."""

from __future__ import annotations

import pytest

from gateway.convert import run_to_proto
from gateway.core.ending import end_of
from gateway.core.placement import Placement, Share, slots_needed
from gateway.core.runs import LOST_MESSAGE, TrainingRun
from gateway.core.shares import ShareFailed, SharesNotReattached
from gateway.core.trainers import (
    JobPlacement,
    Rendezvous,
    TrainerFailed,
    TrainerLost,
    TrainerProcessDied,
)
from gateway.trainer_client import stream_event, train_request
from trainwire.v1 import episode_pb2, trainer_service_pb2


def _grpo(processes: int) -> episode_pb2.TrainTask:
    return episode_pb2.TrainTask(
        grpo=episode_pb2.GrpoTask(model_path="m", dataset_path="d", num_processes=processes)
    )


def test_a_grpo_job_takes_a_slot_per_process_and_any_other_one() -> None:
    assert [slots_needed(_grpo(n)) for n in (0, 1, 3)] == [1, 1, 3]
    imitation = episode_pb2.TrainTask(imitation=episode_pb2.ImitationTask(rig_name="stickman"))
    assert slots_needed(imitation) == 1


def test_a_placement_numbers_its_ranks_rank_0_first_and_says_where_it_runs() -> None:
    spans = Placement.of([("b:1", 2), ("a:1", 1)])
    assert spans.shares == (Share("b:1", 0, 2), Share("a:1", 2, 1))
    assert (spans.world_size, spans.addresses, spans.spans) == (3, ("b:1", "a:1"), True)
    assert spans.describe() == "b:1 (ranks 0-1), a:1 (ranks 2-2)"
    assert spans.who(spans.others[0]) == "trainer a:1 (ranks 2-2 of 3)"
    assert spans.job_placement(spans.rank0) == JobPlacement(3, 0, 2, "")
    assert spans.job_placement(spans.others[0], "h:9") == JobPlacement(3, 2, 1, "h:9")

    alone = Placement.of([("a:1", 3)])
    assert (alone.describe(), alone.spans, alone.job_placement(alone.rank0)) == (
        "a:1",
        False,
        None,  # the whole job runs there: no placement on the wire
    )
    with pytest.raises(ValueError):
        Placement((Share("a:1", 0, 1), Share("b:1", 2, 1)))  # rank 1 missing


def test_the_train_request_carries_the_placement_only_when_the_job_spans_trainers() -> None:
    task, config = _grpo(2), episode_pb2.TrainConfig(max_episodes=5)
    plain = train_request("r1", task, config, grant_through_episode=3)
    assert not plain.HasField("placement")
    share = train_request("r1", task, config, placement=JobPlacement(2, 1, 1, "h:29500"))
    assert share.placement == trainer_service_pb2.JobPlacement(
        world_size=2, first_rank=1, processes=1, rendezvous="h:29500"
    )
    assert (share.run_id, share.task, share.config) == ("r1", task, config)


def test_the_rendezvous_event_reaches_the_core() -> None:
    message = trainer_service_pb2.TrainResponse(
        rendezvous=trainer_service_pb2.Rendezvous(address="10.0.0.2:29500")
    )
    assert stream_event(message) == Rendezvous("10.0.0.2:29500")


def test_a_failed_share_ends_the_run_as_its_cause_naming_the_trainer_and_its_ranks() -> None:
    who = "trainer b:1 (ranks 1-1 of 2)"
    lost = end_of(ShareFailed(who, "b:1", TrainerLost("b:1: UNAVAILABLE")))
    assert (lost.message, lost.restartable, lost.cancel_job, lost.label) == (
        f"{who} was lost: {LOST_MESSAGE}",
        True,
        True,
        "lost",
    )
    died = end_of(ShareFailed(who, "b:1", TrainerProcessDied("b:1", "A rank ran out of memory.")))
    assert (died.message, died.restartable) == (f"{who} failed: A rank ran out of memory.", True)
    failed = end_of(ShareFailed(who, "b:1", TrainerFailed("b:1", "The dataset is missing.")))
    assert (failed.message, failed.restartable) == (f"{who} failed: The dataset is missing.", False)
    gone = end_of(SharesNotReattached("spanned a:1, b:1"))
    assert gone.restartable and not gone.cancel_job


def test_run_trainers_go_into_the_proto_rank_0_first() -> None:
    run = TrainingRun(id="r1", task=_grpo(3), config=episode_pb2.TrainConfig(max_episodes=5))
    assert list(run_to_proto(run).trainers) == []
    run.start("b:1", 1, ("b:1", "a:1"))
    message = run_to_proto(run)
    assert (message.trainer, list(message.trainers)) == ("b:1", ["b:1", "a:1"])
    run = TrainingRun(id="r2", task=_grpo(1), config=episode_pb2.TrainConfig(max_episodes=5))
    run.start("a:1", 1)
    assert list(run_to_proto(run).trainers) == ["a:1"]

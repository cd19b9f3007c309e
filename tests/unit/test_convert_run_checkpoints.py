"""``run_to_proto`` carries a run's checkpoint fields: ``checkpoint_episode``, ``restarts`` and
``parked``."""

from __future__ import annotations

from gateway.convert import run_to_proto
from gateway.core.runs import RunState, TrainingRun
from trainwire.v1 import episode_pb2, gateway_service_pb2


def make_run(**fields: object) -> TrainingRun:
    return TrainingRun(
        id="r1",
        task=episode_pb2.TrainTask(),
        config=episode_pb2.TrainConfig(max_episodes=50, checkpoint_every=5, keep_checkpoints=2),
        state=RunState.PAUSED,
        **fields,  # type: ignore[arg-type]
    )


def test_the_checkpoint_fields_reach_the_run_message_in_every_view() -> None:
    run = make_run(checkpoint_episode=35, restarts=2, parked=True)
    for view in (gateway_service_pb2.RUN_VIEW_BASIC, gateway_service_pb2.RUN_VIEW_FULL):
        message = run_to_proto(run, view)
        assert (message.checkpoint_episode, message.restarts, message.parked) == (35, 2, True)
        assert (message.config.checkpoint_every, message.config.keep_checkpoints) == (5, 2)


def test_a_run_without_checkpoints_leaves_them_off_the_wire() -> None:
    message = run_to_proto(make_run())
    assert (message.checkpoint_episode, message.restarts, message.parked) == (0, 0, False)
    sent = {field.name for field, _ in message.ListFields()}
    assert sent.isdisjoint({"checkpoint_episode", "restarts", "parked"})

"""The quickstart's grpcurl recipes for the trainer, run with the real grpcurl binary.

One in-process trainer on port 0 (the real imitation provider) serves every recipe; grpcurl finds
the services through reflection v1alpha.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.fakes.trainer_harness import running_trainer
from tests.grpcurl_helpers import run_grpcurl
from trainer_service.metrics import TrainerMetrics

SERVICE = "trainwire.v1.TrainerService"


@pytest.fixture(scope="module")
def trainer() -> Iterator[tuple[str, TrainerMetrics]]:
    """``127.0.0.1:PORT`` of a ready trainer, and its metrics."""
    with running_trainer({"imitation": "trainer_service.providers.imitation"}) as running:
        yield running.address, running.metrics


def test_list_shows_the_trainer_and_health(trainer: tuple[str, TrainerMetrics]) -> None:
    services = run_grpcurl(trainer[0], "list").check().lines()
    assert SERVICE in services
    assert "grpc.health.v1.Health" in services
    assert "grpc.reflection.v1alpha.ServerReflection" in services


def test_describe_the_trainer_service(trainer: tuple[str, TrainerMetrics]) -> None:
    out = run_grpcurl(trainer[0], "describe", SERVICE).check().stdout
    assert f"{SERVICE} is a service:" in out
    assert (
        "rpc Train ( .trainwire.v1.TrainRequest ) returns ( stream .trainwire.v1.TrainResponse );"
        in out
    )
    assert "rpc GetCapabilities" in out


def test_get_capabilities(trainer: tuple[str, TrainerMetrics]) -> None:
    reply = run_grpcurl(trainer[0], f"{SERVICE}/GetCapabilities").check().message()
    assert reply["providers"] == ["imitation"]
    # grpcurl prints the proto field names, not their lowerCamelCase JSON names.
    assert (reply["slots_total"], reply["slots_free"]) == (1, 1)
    assert reply["device"] == "cpu"
    # What an imitation task's 0 fields mean on this trainer.
    assert reply["provider_defaults"] == {
        "imitation": {
            "checkpoint_every": 500,
            "imitation": {"group_size": 16, "learning_rate": 0.03},
        }
    }


def test_health_check(trainer: tuple[str, TrainerMetrics]) -> None:
    overall = run_grpcurl(trainer[0], "grpc.health.v1.Health/Check").check().message()
    assert overall == {"status": "SERVING"}
    service = run_grpcurl(
        trainer[0], "grpc.health.v1.Health/Check", data={"service": SERVICE}
    ).check()
    assert service.message() == {"status": "SERVING"}


def test_train_streams_to_the_end(trainer: tuple[str, TrainerMetrics]) -> None:
    address, metrics = trainer
    body = (
        '{"run_id": "g1", "task": {"imitation": {"clip_name": "wave"}},'
        ' "config": {"max_episodes": 3}}'
    )
    events = run_grpcurl(address, f"{SERVICE}/Train", data=body).check().messages()
    episodes = [e["episode"] for e in events if "episode" in e]
    # int64 fields are strings in proto JSON.
    assert [e["episode"] for e in episodes] == ["1", "2", "3"]
    assert episodes[-1]["done"] is True
    assert not any(e.get("done") for e in episodes[:-1])
    assert all(isinstance(e["reward"], float | int) for e in episodes)
    labels = {"kind": "imitation", "outcome": "ok"}
    assert metrics.value("trainwire_trainer_jobs_ended_total", labels) == 1


def test_bad_train_request_is_a_readable_error(trainer: tuple[str, TrainerMetrics]) -> None:
    result = run_grpcurl(
        trainer[0],
        f"{SERVICE}/Train",
        data={"run_id": "g2", "task": {"imitation": {"clip_name": "wave"}}},
    )
    assert result.returncode == 64 + 3  # grpcurl exits 64 + the status code (INVALID_ARGUMENT)
    assert "Code: InvalidArgument" in result.stderr
    assert "run g2" in result.stderr and "config.max_episodes" in result.stderr
    assert "google.rpc.BadRequest" in result.stderr

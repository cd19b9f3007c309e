"""Labels and display names at the core's seams: set at creation, validated like Kubernetes
labels (the bad key named), changed by ``update`` on an active or finished run, kept across a
gateway restart, and what the servicer's field mask lets through."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.convert import run_spec_from_proto, update_from_proto
from gateway.core.catalog import RunSpec
from gateway.core.errors import InvalidRequest, RunNotFound
from gateway.core.runs import RunState
from tests.fakes.core_harness import imitation_task, running_core
from tests.fakes.virtual_time import VIRTUAL_TIME
from trainwire.v1 import episode_pb2, gateway_service_pb2

pytestmark = VIRTUAL_TIME


def spec(labels: dict[str, str], name: str = "") -> RunSpec:
    return RunSpec(
        task=imitation_task(),
        config=episode_pb2.TrainConfig(max_episodes=30, seed=1),
        labels=labels,
        display_name=name,
    )


async def test_labels_are_set_changed_and_kept_across_a_restart(tmp_path: Path) -> None:
    async with running_core(db=str(tmp_path / "g.db")) as core:
        run = await core.registry.create(spec({"team": "vision", "app.io/lr": "0.03"}, "a"))
        assert run.labels == {"team": "vision", "app.io/lr": "0.03"}
        updated = await core.registry.update(run.id, None, {"team": "speech", "seed": "1"})
        assert updated.labels == {"team": "speech", "seed": "1"} and updated.display_name == "a"
        renamed = await core.registry.update(run.id, "baseline", None)
        assert renamed.display_name == "baseline" and renamed.labels == updated.labels
        assert (await core.run(run.id)).labels == {"team": "speech", "seed": "1"}  # its driver's
        await core.wait_state(run.id, RunState.DONE)
        done = await core.registry.update(run.id, "baseline v1", {})
        assert done.display_name == "baseline v1" and done.labels == {}
        await core.registry.update(run.id, None, {"kept": "yes"})
        await core.restart()
        again = await core.run(run.id)
        assert again.labels == {"kept": "yes"} and again.display_name == "baseline v1"


@pytest.mark.parametrize(
    ("labels", "field", "words"),
    [
        ({"bad key": "x"}, "labels[bad key]", "bad key 'bad key'"),
        ({"Team/x": "x"}, "labels[Team/x]", "DNS subdomain"),
        ({"ok": "no spaces"}, "labels[ok]", "bad value 'no spaces'"),
        ({"k" * 64: ""}, "labels[" + "k" * 64 + "]", "1-63"),
        ({f"k{i}": "" for i in range(65)}, "labels", "at most 64"),
    ],
)
async def test_bad_labels_are_refused_naming_the_key(
    labels: dict[str, str], field: str, words: str
) -> None:
    async with running_core() as core:
        with pytest.raises(InvalidRequest) as created:
            run_spec_from_proto(
                gateway_service_pb2.CreateRunRequest(
                    task=imitation_task(),
                    config=episode_pb2.TrainConfig(max_episodes=5),
                    labels=labels,
                )
            )
        assert created.value.violations[0].field == field
        assert words in created.value.violations[0].description
        run = await core.create(max_episodes=5)
        with pytest.raises(InvalidRequest) as updated:
            await core.registry.update(run.id, None, labels)
        assert updated.value.violations[0].field == "run." + field
        assert run.id in str(updated.value)
        with pytest.raises(InvalidRequest) as named:
            await core.registry.update(run.id, "two\nlines", None)
        assert named.value.violations[0].field == "run.display_name"
        with pytest.raises(RunNotFound):
            await core.registry.update("nosuchrun", "x", None)


def test_the_update_mask_says_what_changes() -> None:
    run = gateway_service_pb2.Run(id="r1", display_name="n", labels={"a": "b"})

    def request(*paths: str) -> gateway_service_pb2.UpdateRunRequest:
        message = gateway_service_pb2.UpdateRunRequest(run=run)
        message.update_mask.paths.extend(paths)
        return message

    assert update_from_proto(request()) == ("n", {"a": "b"})  # empty: both
    assert update_from_proto(request("*")) == ("n", {"a": "b"})
    assert update_from_proto(request("labels")) == (None, {"a": "b"})
    assert update_from_proto(request("display_name")) == ("n", None)
    with pytest.raises(InvalidRequest) as bad:
        update_from_proto(request("labels", "speed"))
    assert bad.value.violations[0].field == "update_mask.paths"
    assert "'speed'" in str(bad.value) and "r1" in str(bad.value)

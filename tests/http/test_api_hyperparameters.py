"""``POST /v1/runs/{id}:setHyperparameters``: SetRunHyperparameters over the JSON API."""

from __future__ import annotations

import pytest

from tests.fakes.fake_trainer import FakeTrainer, Script
from tests.http.conftest import Http
from tests.http.test_api import detail, error_of

pytestmark = pytest.mark.timeout(120)


async def test_set_hyperparameters_changes_the_runs_task(http: Http, fake: FakeTrainer) -> None:
    hold = Script(hold_at=3)
    fake.push(hold)
    run = await http.create(max_episodes=10)
    await http.wait_state(run["id"], "STATE_RUNNING")
    path = f"/v1/runs/{run['id']}:setHyperparameters"
    changed = (await http.ok("POST", path, {"learningRate": 0.02}))["run"]
    assert changed["task"]["imitation"]["learningRate"] == 0.02
    assert [r.learning_rate for r in fake.hyperparameter_requests] == [0.02]
    status, reply = await http.call("POST", path, {"temperature": 0.5})
    error = error_of(reply)
    assert (status, error["status"]) == (400, "INVALID_ARGUMENT") and run["id"] in error["message"]
    assert [v["field"] for v in detail(error, "BadRequest")["fieldViolations"]] == ["temperature"]
    hold.release.set()
    await http.wait_state(run["id"], "STATE_DONE")
    status, reply = await http.call("POST", path, {"learningRate": 0.01})
    assert (status, error_of(reply)["status"]) == (409, "FAILED_PRECONDITION")

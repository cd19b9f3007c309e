"""The JSON API over real sockets: every endpoint, the protobuf JSON mapping, the error shape and
the HTTP status of every gRPC code."""

from __future__ import annotations

import re
from typing import Any

import grpc
import pytest
from google.protobuf import json_format

from gateway.core.errors import RunNotFound
from gateway.http.errors import HTTP_STATUS
from gateway.status import STATUS_CODES
from tests.fakes.fake_trainer import FakeTrainer
from tests.fakes.waiting import TIMEOUT
from tests.http.conftest import Http
from tests.http.harness import create_body
from trainwire import motion
from trainwire.v1 import gateway_service_pb2 as pb

pytestmark = pytest.mark.timeout(120)


def error_of(reply: dict[str, Any]) -> dict[str, Any]:
    """The ``error`` object, checked for the Google API shape."""
    assert set(reply) == {"error"}, reply
    error = reply["error"]
    assert {"code", "status", "message"} <= set(error) <= {"code", "status", "message", "details"}
    return error


def detail(error: dict[str, Any], kind: str) -> dict[str, Any]:
    """The ``google.rpc.<kind>`` detail of an error."""
    found = [d for d in error.get("details", []) if d["@type"].endswith(f"google.rpc.{kind}")]
    assert len(found) == 1, error
    return found[0]


async def test_create_get_and_list_answer_the_json_grpcurl_shows(http: Http) -> None:
    run = await http.create(max_episodes=20, display_name="first")
    assert run["state"] in ("STATE_PENDING", "STATE_RUNNING") and run["displayName"] == "first"
    done = await http.wait_state(run["id"], "STATE_DONE")
    assert done["episode"] == "20"  # int64 is a string in the JSON mapping
    reply = await http.grpc.stub.GetRun(pb.GetRunRequest(run_id=run["id"]), timeout=TIMEOUT)
    assert await http.ok("GET", f"/v1/runs/{run['id']}") == json_format.MessageToDict(reply)
    listed = await http.ok("GET", "/v1/runs")
    assert [r["id"] for r in listed["runs"]] == [run["id"]] and "nextPageToken" not in listed


async def test_create_is_idempotent_per_request_id(http: Http) -> None:
    first = await http.create(request_id="once")
    again = await http.create(request_id="once")
    assert again["id"] == first["id"]


async def test_list_pages_filters_and_rejects_bad_parameters(http: Http) -> None:
    ids = [(await http.create(max_episodes=5))["id"] for _ in range(3)]
    for run_id in ids:
        await http.wait_state(run_id, "STATE_DONE")
    first = await http.ok("GET", "/v1/runs?pageSize=2")
    assert [r["id"] for r in first["runs"]] == ids[:0:-1]  # newest first
    token = first["nextPageToken"]
    rest = await http.ok("GET", f"/v1/runs?pageSize=2&pageToken={token}")
    assert [r["id"] for r in rest["runs"]] == ids[:1] and "nextPageToken" not in rest
    for query in ("state=STATE_DONE", "state=4", "page_size=10&state=STATE_DONE"):
        assert len((await http.ok("GET", f"/v1/runs?{query}"))["runs"]) == 3, query
    assert "runs" not in await http.ok("GET", "/v1/runs?state=STATE_ERROR")
    for query, field in (
        ("pageToken=bogus", "page_token"),
        ("pageSize=abc", "query"),
        ("pageSize=5000", "page_size"),
        ("colour=blue", "query"),
        ("state=STATE_SLEEPING", "query"),
        ("pageSize=1&pageSize=2", "query"),
    ):
        status, reply = await http.call("GET", f"/v1/runs?{query}")
        error = error_of(reply)
        assert (status, error["code"], error["status"]) == (400, 400, "INVALID_ARGUMENT"), query
        violations = detail(error, "BadRequest")["fieldViolations"]
        assert [v["field"] for v in violations] == [field], (query, violations)


async def test_controls_pause_resume_speed_stop_and_delete(http: Http) -> None:
    run = await http.create(max_episodes=2000, episodes_per_second=20)
    run_id = run["id"]
    await http.wait_state(run_id, "STATE_RUNNING")
    base = f"/v1/runs/{run_id}"
    assert (await http.ok("POST", f"{base}:pause"))["run"]["state"] == "STATE_PAUSED"
    assert (await http.ok("POST", f"{base}:pause", {}))["run"]["state"] == "STATE_PAUSED"
    assert (await http.ok("POST", f"{base}:resume"))["run"]["state"] == "STATE_RUNNING"
    assert (await http.ok("POST", f"{base}:setSpeed", {"speed": 4}))["run"]["speed"] == 4
    assert (await http.ok("POST", f"{base}:setSpeed", {"speed": 100}))["run"]["speed"] == 20
    status, reply = await http.call("POST", f"{base}:setSpeed", {"speed": "NaN"})
    assert status == 400 and error_of(reply)["status"] == "INVALID_ARGUMENT"
    status, reply = await http.call("POST", f"{base}:setSpeed", {"runId": "other", "speed": 2})
    assert (
        status == 400
        and detail(error_of(reply), "BadRequest")["fieldViolations"][0]["field"] == "run_id"
    )
    status, reply = await http.call("DELETE", base)
    error = error_of(reply)
    assert (status, error["status"]) == (409, "FAILED_PRECONDITION")
    assert detail(error, "ErrorInfo")["metadata"] == {"run_id": run_id}
    assert (await http.ok("POST", f"{base}:stop"))["run"]["state"] == "STATE_STOPPED"
    for action in ("pause", "resume", "stop"):
        status, reply = await http.call("POST", f"{base}:{action}")
        error = error_of(reply)
        assert (status, error["code"], error["status"]) == (409, 409, "FAILED_PRECONDITION")
        assert run_id in error["message"]
    assert (await http.ok("DELETE", base))["run"]["id"] == run_id
    status, reply = await http.call("GET", base)
    assert status == 404


async def test_errors_are_google_api_json_with_details(http: Http) -> None:
    status, reply = await http.call("GET", "/v1/runs/nosuchrun")
    error = error_of(reply)
    assert (status, error["code"], error["status"]) == (404, 404, "NOT_FOUND")
    assert error["message"] == "run 'nosuchrun' not found"
    info = detail(error, "ErrorInfo")
    assert info == {
        "@type": "type.googleapis.com/google.rpc.ErrorInfo",
        "reason": "RUN_NOT_FOUND",
        "domain": "trainwire",
        "metadata": {"run_id": "nosuchrun"},
    }
    # Every bad field at once, as over gRPC.
    status, reply = await http.call("POST", "/v1/runs", {"task": {}, "config": {}})
    error = error_of(reply)
    assert status == 400 and error["status"] == "INVALID_ARGUMENT"
    fields = {v["field"] for v in detail(error, "BadRequest")["fieldViolations"]}
    assert {"task", "config.max_episodes"} <= fields
    # Not JSON, not the message, not declared as JSON.
    for body, headers in (
        ("{not json", None),
        ('{"colour": "blue"}', None),
        ('{"config": {"maxEpisodes": "many"}}', None),
        ("{}", {"Content-Type": "text/plain"}),
    ):
        status, reply = await http.call("POST", "/v1/runs", body, headers=headers)
        assert status == 400 and error_of(reply)["status"] == "INVALID_ARGUMENT", body
    # Paths and methods nobody serves.
    status, reply = await http.call("GET", "/v1/nothing")
    assert (status, error_of(reply)["status"]) == (404, "NOT_FOUND")
    status, reply = await http.call("PUT", "/v1/runs")
    assert (status, error_of(reply)["status"]) == (405, "UNIMPLEMENTED")
    status, reply = await http.call("POST", "/v1/runs/abc:explode")
    assert (status, error_of(reply)["status"]) == (404, "NOT_FOUND")


async def test_an_unexpected_failure_is_500_without_internals(
    http: Http, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    core = http.grpc.gateway.core
    assert core is not None

    async def broken(run_id: str) -> None:
        raise RuntimeError("secret internals")

    monkeypatch.setattr(core, "get", broken)
    status, reply = await http.call("GET", "/v1/runs/abc")
    error = error_of(reply)
    assert (status, error["status"]) == (500, "INTERNAL")
    assert "secret" not in error["message"] and "internal error (logged)" in error["message"]
    assert "secret internals" in caplog.text  # logged once, with its traceback


def test_every_grpc_code_and_domain_error_has_an_http_status() -> None:
    assert set(HTTP_STATUS) == set(grpc.StatusCode)
    assert HTTP_STATUS[grpc.StatusCode.FAILED_PRECONDITION] == 409
    for code in STATUS_CODES.values():
        assert 400 <= HTTP_STATUS[code] <= 599
    assert HTTP_STATUS[STATUS_CODES[RunNotFound]] == 404


async def test_motion_of_an_imitation_run_comes_from_trainwire_motion(http: Http) -> None:
    run = await http.create(max_episodes=3, clip="walk")
    reply = await http.ok("GET", f"/v1/runs/{run['id']}/motion")
    rig = motion.STICKMAN
    bones = reply["rig"]["bones"]
    assert [b["name"] for b in bones] == [b.name for b in rig.bones]
    assert [b.get("parent", 0) for b in bones] == [b.parent for b in rig.bones]
    assert [b["length"] for b in bones] == pytest.approx([b.length for b in rig.bones])
    clip = motion.builtin_clip("walk")
    assert reply["clip"]["frameCount"] == clip.frame_count
    assert reply["clip"]["jointCount"] == clip.joint_count
    assert reply["clip"]["angles"] == pytest.approx(clip.angles, abs=1e-6)
    motions = await http.ok("GET", "/v1/motions")
    assert motions == {"rigs": ["stickman"], "clips": list(motion.BUILTIN_CLIP_NAMES)}
    status, reply = await http.call("GET", "/v1/runs/nosuchrun/motion")
    assert status == 404


async def test_a_grpo_run_has_no_motion(fake: FakeTrainer, http: Http) -> None:
    body = create_body(max_episodes=3)
    body["task"] = {"grpo": {"modelPath": "m", "datasetPath": "d.jsonl"}}
    run = (await http.ok("POST", "/v1/runs", body))["run"]
    status, reply = await http.call("GET", f"/v1/runs/{run['id']}/motion")
    assert status == 400 and "not an imitation run" in error_of(reply)["message"]
    await http.call("POST", f"/v1/runs/{run['id']}:stop")


async def test_the_page_and_its_assets_come_from_the_gateway_only(http: Http) -> None:
    async with http.session.get(http.url + "/") as response:
        assert response.status == 200 and response.content_type == "text/html"
        policy = response.headers["Content-Security-Policy"]
        html = await response.text()
    assert "default-src 'self'" in policy
    references = re.findall(r'(?:src|href)="([^"]+)"', html)
    assert references and all(r.startswith(("/", "#", "data:")) for r in references), references
    types = {".js": "text/javascript", ".css": "text/css"}
    for path in [r for r in references if r.startswith("/static/")] + [
        "/static/draw.js",
        "/static/vendor/uplot/uPlot.esm.js",
        "/static/vendor/uplot/LICENSE",
    ]:
        async with http.session.get(http.url + path) as response:
            assert response.status == 200, path
            suffix = path[path.rfind(".") :]
            if suffix in types:
                assert response.content_type == types[suffix], path
            text = await response.text()
        if path.endswith((".js", ".css")) and "vendor" not in path:
            imports = re.findall(r'^import .* from "([^"]+)";', text, re.MULTILINE)
            assert all(i.startswith("./") for i in imports), imports
            assert "http://" not in text and "https://" not in text, path
    async with http.session.get(http.url + "/static/../gateway/config.py") as response:
        assert response.status == 404  # nothing outside static/

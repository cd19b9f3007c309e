"""The JSON API: ``GatewayService`` over HTTP, in the protobuf JSON mapping.

Each handler is a transcoder, like Google's HTTP rules (``google/api/http.proto``) served by a
gRPC-JSON gateway: the path, the query and the JSON body make the request message; the same
``GatewayServicer`` method that gRPC calls answers it (with an ``HttpContext``); the response
message is the body, the JSON grpcurl shows.

==========================================  ==================================================
``GET /v1/runs``                            ListRuns (``?pageSize=&pageToken=&state=&view=``)
``POST /v1/runs``                           CreateRun (body: ``CreateRunRequest``)
``GET /v1/runs/{run_id}``                   GetRun
``PATCH /v1/runs/{run_id}``                 UpdateRun (body: the ``Run`` fields to set;
                                            ``?updateMask=display_name,labels``)
``DELETE /v1/runs/{run_id}``                DeleteRun
``POST /v1/runs/{run_id}:pause``            PauseRun (``:resume``, ``:stop`` alike)
``POST /v1/runs/{run_id}:setSpeed``         SetRunSpeed (body ``{"speed": 2}``)
``POST /v1/runs/{run_id}:setHyperparameters``
                                            SetRunHyperparameters (body
                                            ``{"learningRate": 0.01}``)
``GET /v1/runs/{run_id}/checkpoints``       ListCheckpoints
``GET /v1/runs/{run_id}/checkpoints/{episode}:download``
                                            DownloadCheckpoint: the tar itself
                                            (``application/x-tar``; episode 0: the latest;
                                            ``?merged=true``: a LoRA run's model merged into
                                            its base model)
``GET /v1/runs/{run_id}/curve``             GetRunCurve (``?buckets=&metrics=a,b&firstEpisode=
                                            &lastEpisode=``; metrics comma-separated)
``GET /v1/runs/{run_id}/motion``            an imitation run's rig and target clip
``GET /v1/motions``                         the built-in rigs and clips
``GET /v1/trainers``                        the trainers as the gateway last probed them: per
                                            trainer ``address``, ``reachable``, ``error`` (why
                                            not) and ``capabilities`` (its
                                            ``GetCapabilitiesResponse``: providers, slots,
                                            device, ``gpus``)
==========================================  ==================================================

A POST must say ``Content-Type: application/json`` (its body may be empty for the controls):
a browser cannot send that cross-site without asking first, so another site's page cannot
drive runs through a visitor's browser.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from typing import Any, TypeVar, cast

import grpc
from aiohttp import web
from google.protobuf import json_format
from google.protobuf.message import Message

from gateway.convert import capabilities_to_proto
from gateway.core.errors import InvalidRequest
from gateway.core.scheduler import TrainerReport
from gateway.http.context import HttpContext
from gateway.http.errors import HttpAbort
from gateway.servicer import GatewayServicer
from gateway.status import map_errors
from trainwire import motion
from trainwire.contract import FieldViolation
from trainwire.v1 import gateway_service_pb2 as pb

M = TypeVar("M", bound=Message)

_LOGGER = logging.getLogger(__name__)


def json_reply(message: Message | dict[str, Any]) -> web.Response:
    """A 200 response whose body is the message in the protobuf JSON mapping."""
    if isinstance(message, Message):
        message = json_format.MessageToDict(message)
    return web.json_response(message)


def _bad(field: str, message: str) -> InvalidRequest:
    return InvalidRequest(message, [FieldViolation(field, message)])


def from_query(request: web.Request, cls: type[M]) -> M:
    """The request message of the query parameters (JSON names or proto names).

    Raises:
        InvalidRequest: an unknown parameter or a bad value.
    """
    query = request.query
    if len(set(query)) != len(query):
        raise _bad("query", f"a query parameter is repeated: {request.query_string}")
    try:
        return json_format.ParseDict(dict(query), cls())
    except json_format.ParseError as exc:
        raise _bad("query", f"bad query parameters for {cls.DESCRIPTOR.name}: {exc}") from None


def query_flag(request: web.Request, name: str) -> bool:
    """A boolean query parameter: ``true``/``1`` or ``false``/``0`` (absent: false).

    Raises:
        InvalidRequest: it is repeated or another value.
    """
    values = request.query.getall(name, [])
    if len(values) > 1:
        raise _bad(name, f"the query parameter {name} is repeated")
    value = values[0].strip().lower() if values else "false"
    if value not in ("true", "1", "false", "0"):
        raise _bad(name, f"{name}={values[0]!r}; need true or false")
    return value in ("true", "1")


async def from_body(request: web.Request, cls: type[M], **path: str) -> M:
    """The request message of a JSON body (may be empty) and the path's fields; a path field
    the body also sets must agree.

    Raises:
        InvalidRequest: not JSON, not the message, or disagreeing with the path.
    """
    if request.content_type != "application/json":
        raise _bad(
            "Content-Type",
            f"send the body as Content-Type: application/json, not {request.content_type!r}",
        )
    text = await request.text()
    message = cls()
    if text.strip():
        try:
            json_format.Parse(text, message)
        except json_format.ParseError as exc:
            raise _bad("body", f"the body is not a {cls.DESCRIPTOR.name}: {exc}") from None
    for name, value in path.items():
        current = getattr(message, name)
        if current and current != value:
            raise _bad(name, f"{name} {current!r} in the body is not {value!r} in the path")
        setattr(message, name, value)
    return message


class _Motions:
    """The motion of a run, with errors mapped like servicer methods."""

    def __init__(self, servicer: GatewayServicer) -> None:
        self._servicer = servicer

    @map_errors
    async def GetRunMotion(self, request: pb.GetRunRequest, context: HttpContext) -> dict[str, Any]:
        reply = await self._servicer.GetRun(request, cast(grpc.aio.ServicerContext, context))
        task = reply.run.task
        if task.WhichOneof("kind") != "imitation":
            raise InvalidRequest(
                f"run {request.run_id!r} is not an imitation run: it has no motion",
                [FieldViolation("run_id", "not an imitation run")],
                request.run_id,
            )
        rig = motion.rig_from_task(task.imitation)
        clip = motion.clip_from_task(task.imitation)
        return {
            "rig": json_format.MessageToDict(motion.rig_to_proto(rig)),
            "clip": json_format.MessageToDict(motion.clip_to_proto(clip)),
        }


def trainer_to_json(report: TrainerReport) -> dict[str, Any]:
    """A trainer of ``GET /v1/trainers``."""
    found: dict[str, Any] = {
        "address": report.address,
        "reachable": report.capabilities is not None,
        "error": report.error,
    }
    if report.capabilities is not None:
        found["capabilities"] = json_format.MessageToDict(
            capabilities_to_proto(report.capabilities)
        )
    return found


class JsonApi:
    """The JSON API's handlers (see the module docstring).

    Args:
        servicer: Answers the routes that stand for RPCs.
        trainers: The trainers as the gateway last probed them (``RunRegistry.trainers``).
    """

    def __init__(
        self,
        servicer: GatewayServicer,
        trainers: Callable[[], Sequence[TrainerReport]] = list,
    ) -> None:
        self._servicer = servicer
        self._motions = _Motions(servicer)
        self._trainers = trainers

    def routes(self) -> list[web.RouteDef]:
        """The routes, for ``app.add_routes``."""
        run = "/v1/runs/{run_id:[^/:]+}"
        return [
            web.get("/v1/runs", self.list_runs),
            web.post("/v1/runs", self.create_run),
            web.get(run, self.get_run),
            web.patch(run, self.update_run),
            web.delete(run, self.delete_run),
            web.post(run + ":pause", self.pause_run),
            web.post(run + ":resume", self.resume_run),
            web.post(run + ":stop", self.stop_run),
            web.post(run + ":setSpeed", self.set_speed),
            web.post(run + ":setHyperparameters", self.set_hyperparameters),
            web.get(run + "/checkpoints", self.list_checkpoints),
            web.get(run + "/checkpoints/{episode:[0-9]+}:download", self.download_checkpoint),
            web.get(run + "/curve", self.get_run_curve),
            web.get(run + "/motion", self.run_motion),
            web.get("/v1/motions", self.motions),
            web.get("/v1/trainers", self.trainers),
        ]

    @staticmethod
    async def _call(
        method: Callable[[Any, grpc.aio.ServicerContext], Awaitable[Message]],
        message: Message,
        request: web.Request,
    ) -> web.Response:
        context = cast(grpc.aio.ServicerContext, HttpContext(request))
        return json_reply(await method(message, context))

    async def list_runs(self, request: web.Request) -> web.Response:
        """ListRuns."""
        message = from_query(request, pb.ListRunsRequest)
        return await self._call(self._servicer.ListRuns, message, request)

    async def create_run(self, request: web.Request) -> web.Response:
        """CreateRun."""
        message = await from_body(request, pb.CreateRunRequest)
        return await self._call(self._servicer.CreateRun, message, request)

    async def get_run(self, request: web.Request) -> web.Response:
        """GetRun."""
        message = pb.GetRunRequest(run_id=request.match_info["run_id"])
        return await self._call(self._servicer.GetRun, message, request)

    async def update_run(self, request: web.Request) -> web.Response:
        """UpdateRun: the body is the run's fields, ``updateMask`` (comma-separated) says
        which to set (all of display_name and labels when absent)."""
        unknown = set(request.query) - {"updateMask", "update_mask"}
        if unknown:
            raise _bad("query", f"unknown query parameter {sorted(unknown)[0]!r}")
        body = await from_body(request, pb.Run, id=request.match_info["run_id"])
        message = pb.UpdateRunRequest(run=body)
        mask = request.query.get("updateMask", request.query.get("update_mask", ""))
        message.update_mask.paths.extend(p.strip() for p in mask.split(",") if p.strip())
        return await self._call(self._servicer.UpdateRun, message, request)

    async def delete_run(self, request: web.Request) -> web.Response:
        """DeleteRun."""
        message = pb.DeleteRunRequest(run_id=request.match_info["run_id"])
        return await self._call(self._servicer.DeleteRun, message, request)

    async def pause_run(self, request: web.Request) -> web.Response:
        """PauseRun."""
        message = await from_body(request, pb.PauseRunRequest, **request.match_info)
        return await self._call(self._servicer.PauseRun, message, request)

    async def resume_run(self, request: web.Request) -> web.Response:
        """ResumeRun."""
        message = await from_body(request, pb.ResumeRunRequest, **request.match_info)
        return await self._call(self._servicer.ResumeRun, message, request)

    async def stop_run(self, request: web.Request) -> web.Response:
        """StopRun."""
        message = await from_body(request, pb.StopRunRequest, **request.match_info)
        return await self._call(self._servicer.StopRun, message, request)

    async def set_speed(self, request: web.Request) -> web.Response:
        """SetRunSpeed."""
        message = await from_body(request, pb.SetRunSpeedRequest, **request.match_info)
        return await self._call(self._servicer.SetRunSpeed, message, request)

    async def set_hyperparameters(self, request: web.Request) -> web.Response:
        """SetRunHyperparameters."""
        message = await from_body(request, pb.SetRunHyperparametersRequest, **request.match_info)
        return await self._call(self._servicer.SetRunHyperparameters, message, request)

    async def list_checkpoints(self, request: web.Request) -> web.Response:
        """ListCheckpoints."""
        message = pb.ListCheckpointsRequest(run_id=request.match_info["run_id"])
        return await self._call(self._servicer.ListCheckpoints, message, request)

    async def get_run_curve(self, request: web.Request) -> web.Response:
        """GetRunCurve; ``metrics`` is one comma-separated parameter."""
        if len(set(request.query)) != len(request.query):
            raise _bad("query", f"a query parameter is repeated: {request.query_string}")
        query = dict(request.query)
        metrics = query.pop("metrics", "")
        message = pb.GetRunCurveRequest()
        try:
            json_format.ParseDict(query, message)
        except json_format.ParseError as exc:
            raise _bad("query", f"bad query parameters for GetRunCurveRequest: {exc}") from None
        message.metrics.extend(m.strip() for m in metrics.split(",") if m.strip())
        message.run_id = request.match_info["run_id"]
        return await self._call(self._servicer.GetRunCurve, message, request)

    async def download_checkpoint(self, request: web.Request) -> web.StreamResponse:
        """DownloadCheckpoint, as the tar file itself: headers once the checkpoint is found
        (errors before that are JSON errors), then the chunks as they are read. A checkpoint
        that turns out corrupt cuts the body short of its Content-Length. ``?merged=true``: a
        LoRA run's checkpoint merged into its base model."""
        run_id = request.match_info["run_id"]
        merged = query_flag(request, "merged")
        message = pb.DownloadCheckpointRequest(
            run_id=run_id, episode=int(request.match_info["episode"]), merged=merged
        )
        context = cast(grpc.aio.ServicerContext, HttpContext(request))
        stream = cast(
            AsyncGenerator[pb.DownloadCheckpointResponse, None],
            self._servicer.DownloadCheckpoint(message, context),
        )
        try:
            first = await anext(stream)
            record = first.checkpoint
            name = f"{run_id}-episode-{record.episode}{'-merged' if merged else ''}.tar"
            response = web.StreamResponse(
                headers={
                    "Content-Type": "application/x-tar",
                    "Content-Length": str(record.size_bytes),
                    "Content-Disposition": f'attachment; filename="{name}"',
                    "X-Checkpoint-Episode": str(record.episode),
                    "X-Checkpoint-Sha256": record.sha256,
                }
            )
            await response.prepare(request)
            try:
                async for part in stream:
                    await response.write(part.chunk)
            except HttpAbort as exc:
                # Too late for an error body: the client sees the body cut short.
                _LOGGER.warning("download of run %s cut short: %s", run_id, exc.status.details)
                if request.transport is not None:
                    request.transport.close()
                return response
            await response.write_eof()
            return response
        finally:
            await stream.aclose()

    async def run_motion(self, request: web.Request) -> web.Response:
        """An imitation run's rig (bones: parent, length) and target clip (angles), from
        ``trainwire.motion``: the page draws the learned pose over the target with them."""
        message = pb.GetRunRequest(run_id=request.match_info["run_id"])
        return json_reply(await self._motions.GetRunMotion(message, HttpContext(request)))

    async def motions(self, request: web.Request) -> web.Response:
        """The built-in rig and clip names (the page's New-run form offers them)."""
        return json_reply(
            {"rigs": sorted(motion.BUILTIN_RIGS), "clips": list(motion.BUILTIN_CLIP_NAMES)}
        )

    async def trainers(self, request: web.Request) -> web.Response:
        """The trainers, their capabilities and GPUs as last probed (the page's Trainers
        card); the probes run in the background, so this never waits for a trainer."""
        return json_reply({"trainers": [trainer_to_json(r) for r in self._trainers()]})

"""Conversions between protobuf messages and the core's domain objects, in pairs."""

from __future__ import annotations

import hashlib
import time

from google.protobuf import timestamp_pb2

from gateway.core.curve import Bucket
from gateway.core.errors import InvalidRequest
from gateway.core.framing import encode_batch
from gateway.core.registry import (
    CaughtUp,
    EpisodeFrames,
    Finished,
    Keepalive,
    RunSpec,
    WatchEvent,
)
from gateway.core.runs import RunState, TrainingRun
from gateway.core.store import CheckpointRecord
from gateway.core.trainers import Capabilities, CheckpointSaved, Gpu
from trainwire.contract import FieldViolation, check_create_run, describe_violations
from trainwire.hyperparameters import Hyperparameters
from trainwire.v1 import episode_pb2, gateway_service_pb2, trainer_service_pb2

#: The largest CreateRunRequest accepted (the gRPC server lets larger ones through, up to its
#: own limit, so they get this clear answer).
MAX_CREATE_REQUEST_BYTES = 1 << 20


def timestamp_from_ns(ns: int) -> timestamp_pb2.Timestamp:
    """A Timestamp for Unix nanoseconds."""
    stamp = timestamp_pb2.Timestamp()
    stamp.FromNanoseconds(ns)
    return stamp


def checkpoint_to_proto(record: CheckpointRecord | CheckpointSaved) -> episode_pb2.Checkpoint:
    """The ``Checkpoint`` message of a stored record or of one a trainer reported."""
    message = episode_pb2.Checkpoint(
        episode=record.episode, size_bytes=record.size_bytes, sha256=record.sha256
    )
    message.create_time.FromNanoseconds(record.create_time)
    return message


def bucket_to_proto(bucket: Bucket) -> gateway_service_pb2.CurveBucket:
    """The ``CurveBucket`` message of a curve's bucket."""
    return gateway_service_pb2.CurveBucket(
        first_episode=bucket.first,
        last_episode=bucket.last,
        reward_min=bucket.reward_min,
        reward_max=bucket.reward_max,
        reward_mean=bucket.reward_mean,
        best_reward=bucket.best_reward,
        metrics_mean=bucket.metrics_mean,
    )


def run_to_proto(
    run: TrainingRun, view: int = gateway_service_pb2.RUN_VIEW_FULL
) -> gateway_service_pb2.Run:
    """The ``Run`` message of a run, in a ``RunView`` (BASIC leaves out custom rig and clip
    payloads)."""
    message = gateway_service_pb2.Run(
        id=run.id,
        state=int(run.state),  # type: ignore[arg-type]
        error_message=run.error_message,
        speed=run.speed,
        episodes_per_second=run.episodes_per_second,
        episode=run.episode,
        best_reward=run.best_reward,
        reward=run.reward,
        task=run.task,
        config=run.config,
        display_name=run.display_name,
        trainer=run.trainer,
        trainers=run.trainers,
        request_id=run.request_id,
        trainer_episode=run.trainer_episode,
        state_detail=run.state_detail,
        creator=run.creator,
        checkpoint_episode=run.checkpoint_episode,
        restarts=run.restarts,
        parked=run.parked,
        labels=run.labels,
    )
    if run.fork_run_id:
        message.fork_from.run_id = run.fork_run_id
        message.fork_from.episode = run.fork_episode
    if run.create_time:
        message.create_time.FromNanoseconds(run.create_time)
    if run.start_time:
        message.start_time.FromNanoseconds(run.start_time)
    if run.end_time:
        message.end_time.FromNanoseconds(run.end_time)
    if view != gateway_service_pb2.RUN_VIEW_FULL:
        imitation = message.task.imitation
        if imitation.HasField("rig"):
            del imitation.rig.bones[:]
        if imitation.HasField("clip"):
            del imitation.clip.angles[:]
    return message


def view_from_proto(view: int) -> int:
    """The ``RunView`` of a ``ListRuns`` request (unspecified: BASIC).

    Raises:
        InvalidRequest: an unknown view number.
    """
    if view == gateway_service_pb2.RUN_VIEW_UNSPECIFIED:
        return gateway_service_pb2.RUN_VIEW_BASIC
    if view in (gateway_service_pb2.RUN_VIEW_BASIC, gateway_service_pb2.RUN_VIEW_FULL):
        return view
    raise InvalidRequest(f"unknown view {view}", [FieldViolation("view", f"unknown view {view}")])


def scalars_from_proto(view: int, run_id: str) -> bool:
    """Whether a ``WatchRun`` asks for episodes without detail (``EpisodeView``).

    Raises:
        InvalidRequest: an unknown view number.
    """
    if view == gateway_service_pb2.EPISODE_VIEW_SCALARS:
        return True
    if view in (
        gateway_service_pb2.EPISODE_VIEW_UNSPECIFIED,
        gateway_service_pb2.EPISODE_VIEW_FULL,
    ):
        return False
    raise InvalidRequest(
        f"watch of run {run_id!r}: unknown view {view}",
        [FieldViolation("view", f"unknown view {view}; need EPISODE_VIEW_FULL or _SCALARS")],
        run_id,
    )


#: The fields ``UpdateRun`` may change, by their mask path.
UPDATABLE_FIELDS = ("display_name", "labels")


def update_from_proto(
    request: gateway_service_pb2.UpdateRunRequest,
) -> tuple[str | None, dict[str, str] | None]:
    """The display name and labels an ``UpdateRun`` sets (None: left as they are).

    Raises:
        InvalidRequest: a mask path other than display_name and labels.
    """
    paths = list(request.update_mask.paths) or list(UPDATABLE_FIELDS)
    if paths == ["*"]:
        paths = list(UPDATABLE_FIELDS)
    bad = [p for p in paths if p not in UPDATABLE_FIELDS]
    if bad:
        run_id = request.run.id
        raise InvalidRequest(
            f"cannot update run {run_id!r}: update_mask path {bad[0]!r} is not one of "
            f"{', '.join(UPDATABLE_FIELDS)}",
            [
                FieldViolation("update_mask.paths", f"{p!r}; only display_name and labels")
                for p in bad
            ],
            run_id,
        )
    name = request.run.display_name if "display_name" in paths else None
    labels = dict(request.run.labels) if "labels" in paths else None
    return name, labels


def run_spec_from_proto(request: gateway_service_pb2.CreateRunRequest) -> RunSpec:
    """A validated ``RunSpec`` from a ``CreateRunRequest``.

    Raises:
        InvalidRequest: with every bad field, or for a request larger than 1 MiB.
    """
    size = request.ByteSize()
    if size > MAX_CREATE_REQUEST_BYTES:
        raise InvalidRequest(
            f"the CreateRunRequest is {size:,} bytes; the limit is "
            f"{MAX_CREATE_REQUEST_BYTES:,} bytes (1 MiB)",
            [FieldViolation("task", f"request of {size:,} bytes; at most 1 MiB")],
        )
    violations = check_create_run(request)
    if violations:
        raise InvalidRequest(
            f"invalid CreateRunRequest: {describe_violations(violations)}", violations
        )
    return RunSpec(
        task=request.task,
        config=request.config,
        speed=request.speed,
        episodes_per_second=request.episodes_per_second,
        request_id=request.request_id,
        display_name=request.display_name,
        request_hash=request_fingerprint(request),
        labels=dict(request.labels),
        fork_run_id=request.fork_from.run_id if request.HasField("fork_from") else "",
        fork_episode=request.fork_from.episode,
    )


def request_fingerprint(request: gateway_service_pb2.CreateRunRequest) -> str:
    """The sha256 of a CreateRunRequest's canonical bytes without its request_id: what the
    idempotency key names."""
    unkeyed = gateway_service_pb2.CreateRunRequest()
    unkeyed.CopyFrom(request)
    unkeyed.ClearField("request_id")
    return hashlib.sha256(unkeyed.SerializeToString(deterministic=True)).hexdigest()


def state_from_proto(state: int) -> RunState | None:
    """The state filter of ``ListRuns`` (None for STATE_UNSPECIFIED).

    Raises:
        InvalidRequest: an unknown state number.
    """
    if state == 0:
        return None
    try:
        return RunState(state)
    except ValueError:
        raise InvalidRequest(
            f"unknown state {state}", [FieldViolation("state", f"unknown state {state}")]
        ) from None


def watch_event_to_wire(event: WatchEvent) -> bytes | gateway_service_pb2.WatchRunResponse:
    """The ``WatchRunResponse`` of a watch event: pre-encoded bytes for episodes (sent as they
    are, see ``gateway.server``), a message otherwise."""
    if isinstance(event, EpisodeFrames):
        return encode_batch(event.frames) if event.batch else event.frames[0]
    if isinstance(event, Keepalive):
        return gateway_service_pb2.WatchRunResponse(
            keepalive=gateway_service_pb2.Keepalive(
                last_episode=event.last_episode,
                state=int(event.state),  # type: ignore[arg-type]
                time=timestamp_from_ns(time.time_ns()),
            )
        )
    if isinstance(event, CaughtUp):
        return gateway_service_pb2.WatchRunResponse(
            caught_up=gateway_service_pb2.CaughtUp(last_episode=event.last_episode)
        )
    if isinstance(event, Finished):
        return gateway_service_pb2.WatchRunResponse(finished=run_to_proto(event.run))
    raise TypeError(f"unknown watch event {event!r}")  # pragma: no cover


def hyperparameters_from_proto(
    request: gateway_service_pb2.SetRunHyperparametersRequest,
) -> Hyperparameters:
    """The change a ``SetRunHyperparametersRequest`` asks for (unset fields stay ``None``)."""
    return Hyperparameters(
        learning_rate=request.learning_rate if request.HasField("learning_rate") else None,
        temperature=request.temperature if request.HasField("temperature") else None,
        beta=request.beta if request.HasField("beta") else None,
    )


def capabilities_from_proto(reply: trainer_service_pb2.GetCapabilitiesResponse) -> Capabilities:
    """What a trainer's ``GetCapabilities`` answer says."""
    return Capabilities(
        tuple(reply.providers),
        reply.slots_total,
        reply.slots_free,
        device=reply.device,
        torch_version=reply.torch_version,
        trl_version=reply.trl_version,
        server_version=reply.server_version,
        gpus=tuple(
            Gpu(g.index, g.name, g.memory_total_bytes, g.memory_used_bytes, g.utilization)
            for g in reply.gpus
        ),
        reward_functions=tuple(reply.reward_functions),
        provider_defaults=dict(reply.provider_defaults),
    )


def capabilities_to_proto(caps: Capabilities) -> trainer_service_pb2.GetCapabilitiesResponse:
    """The ``GetCapabilitiesResponse`` a trainer answered (as the gateway keeps it)."""
    return trainer_service_pb2.GetCapabilitiesResponse(
        providers=caps.providers,
        slots_total=caps.slots_total,
        slots_free=caps.slots_free,
        device=caps.device,
        torch_version=caps.torch_version,
        trl_version=caps.trl_version,
        server_version=caps.server_version,
        gpus=[
            trainer_service_pb2.Gpu(
                index=g.index,
                name=g.name,
                memory_total_bytes=g.memory_total_bytes,
                memory_used_bytes=g.memory_used_bytes,
                utilization=g.utilization,
            )
            for g in caps.gpus
        ],
        reward_functions=caps.reward_functions,
        provider_defaults=caps.provider_defaults,
    )

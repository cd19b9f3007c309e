"""How one ``Train`` call of the fake trainer plays its ``Script``: the mixin ``ScriptPlayer``.

It streams the script's episodes (``valid_episodes``, ``scripted_episodes`` with
``Script.motion``, or ``Script.stream``) after a "loading" heartbeat: normally, slowly, or not
at all; it holds an episode until the grant covers it (with "waiting" heartbeats) or until
``Script.release``, breaks one contract rule, or aborts with a ``google.rpc.LocalizedMessage`` or
plainly. ``tests.fakes.fake_trainer.FakeTrainer`` mixes it in and owns the state it reads.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator
from typing import NoReturn

import grpc

from tests.fakes.episodes import broken, scripted_episodes, valid_episodes
from tests.fakes.scripts import Script
from trainwire.reasons import ErrorReason
from trainwire.v1 import episode_pb2, trainer_service_pb2
from trainwire_ops.rich_status import rich_status


def _heartbeat(last: int, phase: str = "training") -> trainer_service_pb2.TrainResponse:
    hb = trainer_service_pb2.Heartbeat(last_episode=last, phase=phase)
    hb.time.FromNanoseconds(time.time_ns())
    return trainer_service_pb2.TrainResponse(heartbeat=hb)


def abort_with(
    context: grpc.ServicerContext,
    code: grpc.StatusCode,
    message: str,
    reason: str,
    localized: str | None = None,
) -> NoReturn:
    """Aborts with a rich status, built as the real trainer builds its own."""
    context.abort_with_status(rich_status(code, message, reason, localized=localized))
    raise AssertionError("unreachable")


class ScriptPlayer:
    """Plays a ``Script`` on one call; the host (``FakeTrainer``) owns the state below."""

    grants: dict[str, int]  # run id -> grant of its live call (0: none)
    sent: int  # episodes sent over all calls
    _cond: threading.Condition  # guards both

    def _wait(
        self, script: Script, seconds: float, last: int, ended: threading.Event
    ) -> Iterator[trainer_service_pb2.TrainResponse]:
        """Waits ``seconds``, sending heartbeats meanwhile."""
        deadline = time.monotonic() + seconds
        while not ended.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            if ended.wait(min(left, script.heartbeat_interval)):
                return
            if time.monotonic() < deadline:
                yield _heartbeat(last)

    def _wait_grant(
        self, script: Script, run_id: str, n: int, ended: threading.Event
    ) -> Iterator[trainer_service_pb2.TrainResponse]:
        """Holds episode ``n`` until it is granted, with "waiting" heartbeats meanwhile."""
        while not ended.is_set():
            with self._cond:
                grant = self.grants.get(run_id, 0)
                if not grant or n <= grant:
                    return
                self._cond.wait(script.heartbeat_interval)
                grant = self.grants.get(run_id, 0)
                if not grant or n <= grant:
                    return
            yield _heartbeat(n - 1, "waiting")

    def _play(
        self,
        script: Script,
        request: trainer_service_pb2.TrainRequest,
        context: grpc.ServicerContext,
        ended: threading.Event,
        after: int = 0,
    ) -> Iterator[trainer_service_pb2.TrainResponse]:
        if script.silent:
            while not ended.wait(0.05):
                pass
            return
        yield _heartbeat(after, "loading")
        count = script.episodes or request.config.max_episodes
        source: Iterable[episode_pb2.Episode]
        if script.stream is not None:
            # Copies: sending stamps each episode's produce_time (and a violation edits it).
            source = [episode_pb2.Episode.FromString(e.SerializeToString()) for e in script.stream]
            source = source[:count]
        elif script.motion:
            source = scripted_episodes(request.task, request.config)[:count]
        else:
            source = valid_episodes(count, script.detail_every, script.frames, script.joints)
        for ep in source:
            n = ep.episode
            if n <= after:
                continue
            if ended.is_set():
                return
            if script.abort_after is not None and n > script.abort_after:
                self._abort(script, request, context)
            if script.hold_at is not None and n == script.hold_at:
                while not script.release.wait(script.heartbeat_interval):
                    if ended.is_set():
                        return
                    yield _heartbeat(n - 1)
            if script.interval > 0 and n > 1:
                yield from self._wait(script, script.interval, n - 1, ended)
            yield from self._wait_grant(script, request.run_id, n, ended)
            if ended.is_set():
                return
            if script.violate == "end_without_done" and ep.done:
                return
            out = [ep]
            if script.violate not in (None, "end_without_done") and n == script.violate_at:
                assert script.violate is not None
                if script.violate == "done_missing":
                    return  # ends OK without done, mid-run
                out = broken(ep, script.violate)
            for item in out:
                item.produce_time.FromNanoseconds(time.time_ns())
                yield trainer_service_pb2.TrainResponse(episode=item)
                with self._cond:
                    self.sent += 1
                    self._cond.notify_all()
        if script.abort_after is not None and script.abort_after >= count:
            self._abort(script, request, context)

    def _abort(
        self,
        script: Script,
        request: trainer_service_pb2.TrainRequest,
        context: grpc.ServicerContext,
    ) -> None:
        if script.localized is None and script.abort_reason is None:
            context.abort(script.abort_code, f"run {request.run_id}: the fake trainer gave up")
        abort_with(
            context,
            script.abort_code,
            f"run {request.run_id}: provider failed",
            script.abort_reason or ErrorReason.PROVIDER_FAILED,
            script.localized,
        )

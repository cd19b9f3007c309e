"""Typed helpers over the generated ``GatewayService`` stubs.

This module owns the client side of the gateway contract for Python callers:

- ``GatewayClient`` wraps every ``GatewayService`` RPC with a deadline on every call and turns a
  failed call into a typed ``TrainwireError`` (``NotFound``, ``InvalidArgument``, ...) raised
  ``from`` the original ``grpc.RpcError``, with the ``google.rpc`` details decoded
  (``BadRequest`` field violations, ``LocalizedMessage``, ``ErrorInfo``).
- ``GatewayClient.watch`` follows a run as a plain iterator of events: batches are flattened into
  episodes, and a dropped connection (``UNAVAILABLE``, a reset, a stream deadline, an idle stream
  that stopped sending keepalives) is resumed from the last episode seen, with bounded retries and
  backoff, so the caller sees every episode exactly once and in order.
- ``imitation_task``, ``grpo_task`` and ``train_config`` build requests without touching protobuf
  oneofs by hand.

It depends on grpcio, grpcio-status and protobuf only (no torch, no rich).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias, cast

import grpc
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from trainwire.contract import FieldViolation
from trainwire.tls import (
    channel_credentials,
    describe_connection_failure,
    is_certificate_failure,
    is_loopback_target,
)
from trainwire.v1 import episode_pb2, gateway_service_pb2, gateway_service_pb2_grpc

if TYPE_CHECKING:
    from trainwire.motion import ClipSpec, RigSpec

_LOGGER = logging.getLogger(__name__)

Run = gateway_service_pb2.Run
RunState: TypeAlias = int  # a gateway_service_pb2.Run.State value

#: Events ``GatewayClient.watch`` yields: an ``Episode``, a ``Keepalive``, a ``CaughtUp`` (once)
#: and, last, the finished ``Run``.
WatchEvent: TypeAlias = (
    episode_pb2.Episode | gateway_service_pb2.Keepalive | gateway_service_pb2.CaughtUp | Run
)

DEFAULT_TIMEOUT = 10.0
DEFAULT_IDLE_TIMEOUT = 30.0
TERMINAL_STATES: frozenset[int] = frozenset(
    {Run.State.STATE_DONE, Run.State.STATE_STOPPED, Run.State.STATE_ERROR}
)


# -- errors --------------------------------------------------------------------------------------


class TrainwireError(Exception):
    """A failed gateway call, or a watch stream that cannot be trusted.

    Attributes:
        code: The gRPC status code (``None`` only for errors raised without one).
        message: The server's message (it names the run id).
        field_violations: Every bad request field, from a ``google.rpc.BadRequest`` detail.
        localized_message: The text of a ``google.rpc.LocalizedMessage`` detail, if any.
        reason: The ``reason`` of a ``google.rpc.ErrorInfo`` detail, if any.
        metadata: The ``metadata`` of that ``ErrorInfo`` (empty without one).
    """

    grpc_code: grpc.StatusCode | None = None

    def __init__(
        self,
        message: str,
        *,
        code: grpc.StatusCode | None = None,
        field_violations: Sequence[FieldViolation] = (),
        localized_message: str = "",
        reason: str = "",
        metadata: dict[str, str] | None = None,
    ) -> None:
        self.code = code if code is not None else self.grpc_code
        self.message = message
        self.field_violations: tuple[FieldViolation, ...] = tuple(field_violations)
        self.localized_message = localized_message
        self.reason = reason
        self.metadata: dict[str, str] = dict(metadata or {})
        super().__init__(message)

    @property
    def code_name(self) -> str:
        """The status code's name (``NOT_FOUND``), or ``ERROR`` without a code."""
        return self.code.name if self.code is not None else "ERROR"

    def __str__(self) -> str:
        return f"{self.code_name}: {self.message}"


class Cancelled(TrainwireError):
    """The call was cancelled (``CANCELLED``)."""

    grpc_code = grpc.StatusCode.CANCELLED


class Unknown(TrainwireError):
    """The server failed without saying why (``UNKNOWN``)."""

    grpc_code = grpc.StatusCode.UNKNOWN


class InvalidArgument(TrainwireError):
    """A bad request; ``field_violations`` lists every bad field (``INVALID_ARGUMENT``)."""

    grpc_code = grpc.StatusCode.INVALID_ARGUMENT


class DeadlineExceeded(TrainwireError):
    """The call ran past its deadline (``DEADLINE_EXCEEDED``)."""

    grpc_code = grpc.StatusCode.DEADLINE_EXCEEDED


class NotFound(TrainwireError):
    """No such run (``NOT_FOUND``)."""

    grpc_code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(TrainwireError):
    """``ALREADY_EXISTS`` (the gateway never sends it: request ids are idempotent)."""

    grpc_code = grpc.StatusCode.ALREADY_EXISTS


class PermissionDenied(TrainwireError):
    """``PERMISSION_DENIED``."""

    grpc_code = grpc.StatusCode.PERMISSION_DENIED


class ResourceExhausted(TrainwireError):
    """No capacity left (``RESOURCE_EXHAUSTED``)."""

    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED


class FailedPrecondition(TrainwireError):
    """An illegal transition, e.g. pausing a finished run (``FAILED_PRECONDITION``)."""

    grpc_code = grpc.StatusCode.FAILED_PRECONDITION


class Aborted(TrainwireError):
    """``ABORTED``."""

    grpc_code = grpc.StatusCode.ABORTED


class OutOfRange(TrainwireError):
    """``OUT_OF_RANGE``."""

    grpc_code = grpc.StatusCode.OUT_OF_RANGE


class Unimplemented(TrainwireError):
    """The server does not implement the method (``UNIMPLEMENTED``)."""

    grpc_code = grpc.StatusCode.UNIMPLEMENTED


class Internal(TrainwireError):
    """A server bug or a contract violation (``INTERNAL``)."""

    grpc_code = grpc.StatusCode.INTERNAL


class Unavailable(TrainwireError):
    """The gateway (or its trainer) cannot be reached (``UNAVAILABLE``)."""

    grpc_code = grpc.StatusCode.UNAVAILABLE


class DataLoss(TrainwireError):
    """Episodes went missing: a watch stream skipped episodes (``DATA_LOSS``)."""

    grpc_code = grpc.StatusCode.DATA_LOSS


class Unauthenticated(TrainwireError):
    """``UNAUTHENTICATED``."""

    grpc_code = grpc.StatusCode.UNAUTHENTICATED


_ERROR_CLASSES: dict[grpc.StatusCode, type[TrainwireError]] = {
    cls.grpc_code: cls
    for cls in (
        Cancelled,
        Unknown,
        InvalidArgument,
        DeadlineExceeded,
        NotFound,
        AlreadyExists,
        PermissionDenied,
        ResourceExhausted,
        FailedPrecondition,
        Aborted,
        OutOfRange,
        Unimplemented,
        Internal,
        Unavailable,
        DataLoss,
        Unauthenticated,
    )
    if cls.grpc_code is not None
}


def _rich_status(exc: grpc.RpcError) -> status_pb2.Status | None:
    """The ``google.rpc.Status`` in the trailers; None when absent or inconsistent."""
    if not isinstance(exc, grpc.Call):
        return None
    try:
        return rpc_status.from_call(exc)
    except ValueError as bad:  # code/message differ from the trailers: trust the call itself
        _LOGGER.debug("ignoring inconsistent status details: %s", bad)
        return None
    except Exception:  # a half-built call (e.g. a local failure) has no usable trailers
        _LOGGER.debug("no status details on %r", exc, exc_info=True)
        return None


def error_from_rpc(exc: grpc.RpcError) -> TrainwireError:
    """Maps a failed call to its typed ``TrainwireError``, decoding ``google.rpc`` details.

    Use as ``raise error_from_rpc(exc) from exc`` so the original error stays attached.
    """
    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN
    message = ""
    if isinstance(exc, grpc.Call):
        code = exc.code() or grpc.StatusCode.UNKNOWN
        message = exc.details() or ""
    if not message:
        message = code.name.lower().replace("_", " ")
    violations: list[FieldViolation] = []
    localized = ""
    reason = ""
    metadata: dict[str, str] = {}
    status = _rich_status(exc)
    if status is not None:
        for detail in status.details:
            if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
                bad = error_details_pb2.BadRequest()
                detail.Unpack(bad)
                violations.extend(
                    FieldViolation(v.field, v.description) for v in bad.field_violations
                )
            elif detail.Is(error_details_pb2.LocalizedMessage.DESCRIPTOR):
                text = error_details_pb2.LocalizedMessage()
                detail.Unpack(text)
                localized = text.message
            elif detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                info = error_details_pb2.ErrorInfo()
                detail.Unpack(info)
                reason = info.reason
                metadata = dict(info.metadata)
    cls = _ERROR_CLASSES.get(code, TrainwireError)
    return cls(
        message,
        code=code,
        field_violations=violations,
        localized_message=localized,
        reason=reason,
        metadata=metadata,
    )


# -- watch resume policy ---------------------------------------------------------------------------


@dataclass(frozen=True)
class RetryPolicy:
    """How ``watch`` reconnects after a dropped stream.

    Attributes:
        max_retries: Reconnection attempts in a row without receiving anything before giving up.
        initial_backoff: Delay before the first reconnection, in seconds.
        max_backoff: Upper bound of the delay, in seconds.
        multiplier: Growth of the delay per failed attempt.
        jitter: Relative random spread of each delay (0.2 = +/-20 %), so that many watchers
            dropped at once do not reconnect in lockstep.
    """

    max_retries: int = 8
    initial_backoff: float = 0.2
    max_backoff: float = 5.0
    multiplier: float = 2.0
    jitter: float = 0.2

    def __post_init__(self) -> None:
        if self.max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {self.max_retries}")
        if not 0 <= self.initial_backoff <= self.max_backoff:
            raise ValueError("need 0 <= initial_backoff <= max_backoff")
        if self.multiplier < 1:
            raise ValueError(f"multiplier must be >= 1, got {self.multiplier}")
        if not 0 <= self.jitter < 1:
            raise ValueError(f"jitter must be in [0, 1), got {self.jitter}")

    def delay(self, attempt: int) -> float:
        """The delay before reconnection ``attempt`` (1-based)."""
        base = min(self.max_backoff, self.initial_backoff * self.multiplier ** (attempt - 1))
        return base * (1 + self.jitter * (2 * random.random() - 1))


@dataclass(frozen=True)
class Reconnect:
    """Reported to ``watch``'s ``on_reconnect`` before each reconnection.

    Attributes:
        attempt: 1 for the first reconnection after a drop, 2 for the next failure in a row...
        delay: Seconds ``watch`` waits before reconnecting.
        code: The status the stream ended with (``None`` for an idle stream or a stream that
            closed without its ``finished`` event).
        reason: A few words for people.
        after_episode: The episode the new stream resumes after.
    """

    attempt: int
    delay: float
    code: grpc.StatusCode | None
    reason: str
    after_episode: int


class EpisodeChecker(Protocol):
    """Anything that vets each episode, e.g. ``trainwire.contract.StreamChecker``."""

    def check(self, episode: episode_pb2.Episode) -> None: ...


# Codes after which the same watch can simply be reopened from the last episode seen. INTERNAL
# with RST_STREAM is how a connection reset by a proxy sometimes surfaces.
_RETRIABLE_CODES = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ABORTED}
)


def _is_retriable(exc: grpc.RpcError) -> bool:
    if not isinstance(exc, grpc.Call):
        return False
    code = exc.code()
    if code in _RETRIABLE_CODES:
        return True
    return code == grpc.StatusCode.INTERNAL and "RST_STREAM" in (exc.details() or "")


class _IdleWatchdog:
    """Cancels a stream that received nothing for ``timeout`` seconds.

    The gateway sends keepalives on idle streams, so silence means a dead connection that the
    transport has not noticed (a half-open TCP connection, a stuck proxy).
    """

    def __init__(self, call: grpc.Call, timeout: float | None) -> None:
        self.fired = False
        self._call = call
        self._timeout = timeout
        self._last = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if timeout is not None:
            self._thread = threading.Thread(
                target=self._run, name="trainwire-watchdog", daemon=True
            )
            self._thread.start()

    def touch(self) -> None:
        self._last = time.monotonic()

    def _run(self) -> None:
        assert self._timeout is not None
        while True:
            remaining = self._last + self._timeout - time.monotonic()
            if remaining <= 0:
                self.fired = True
                self._call.cancel()
                return
            if self._stop.wait(remaining):
                return

    def stop(self) -> None:
        self._stop.set()


# -- the client ----------------------------------------------------------------------------------


class GatewayClient:
    """A typed client of ``trainwire.v1.GatewayService``.

    Every call carries a deadline (``timeout``, overridable per call) and raises a
    ``TrainwireError`` subclass on failure. Use as a context manager, or call ``close``.

    Args:
        target: The gateway's ``host:port`` (ignored when ``channel`` is given).
        timeout: Deadline of each unary call, in seconds.
        channel: An existing channel to use instead (the caller keeps ownership; ``close`` leaves
            it open). Tests pass ``grpc_testing`` or intercepted channels here.
        retry: How ``watch`` reconnects.
        idle_timeout: ``watch`` treats a stream silent for this long (no episode, no keepalive)
            as dropped and resumes it; ``None`` disables the check.
        stream_timeout: Deadline of each watch stream; when it expires, ``watch`` resumes on a
            new stream, so long watches still carry a deadline. ``None`` for none.
        options: Extra channel arguments for a channel the client creates.
        root_certificates: PEM CA(s) to verify a TLS gateway with; giving this (or a client
            certificate) makes the channel TLS.
        certificate_chain: PEM client certificate, for a gateway that requires one (with
            ``private_key``).
        private_key: Its PEM private key.
        token: A bearer token, sent as ``authorization: Bearer TOKEN`` on every call.
        tls: Force TLS on (with the system's roots when no ``root_certificates``) or off;
            ``None``: TLS when certificate material is given.
    """

    def __init__(
        self,
        target: str | None = None,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        channel: grpc.Channel | None = None,
        retry: RetryPolicy | None = None,
        idle_timeout: float | None = DEFAULT_IDLE_TIMEOUT,
        stream_timeout: float | None = 3600.0,
        options: Sequence[tuple[str, Any]] = (),
        root_certificates: bytes | None = None,
        certificate_chain: bytes | None = None,
        private_key: bytes | None = None,
        token: str | None = None,
        tls: bool | None = None,
    ) -> None:
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0, got {timeout}")
        if tls is None:
            tls = root_certificates is not None or certificate_chain is not None
        self._tls = tls
        self._client_certificate = certificate_chain is not None
        if token is not None and (not token.strip() or any(c in token for c in "\r\n")):
            raise ValueError("token must be one line of text")
        self._metadata: tuple[tuple[str, str], ...] = (
            (("authorization", f"Bearer {token.strip()}"),) if token else ()
        )
        if channel is None:
            if not target:
                raise ValueError("give a target (host:port) or a channel")
            if tls:
                credentials = channel_credentials(root_certificates, certificate_chain, private_key)
                channel = grpc.secure_channel(target, credentials, options=list(options))
            else:
                if token and not is_loopback_target(target):
                    _LOGGER.warning(
                        "sending a token to %s without TLS: anyone on the way can read it",
                        target,
                    )
                channel = grpc.insecure_channel(target, options=list(options))
            self._owns_channel = True
        else:
            self._owns_channel = False
        self.target = target or ""
        self.timeout = timeout
        self.retry = retry or RetryPolicy()
        self.idle_timeout = idle_timeout
        self.stream_timeout = stream_timeout
        self._channel = channel
        self._stub = gateway_service_pb2_grpc.GatewayServiceStub(channel)

    # context management

    def close(self) -> None:
        """Closes the channel if the client created it."""
        if self._owns_channel:
            self._channel.close()

    def __enter__(self) -> GatewayClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # unary calls

    def _error(self, exc: grpc.RpcError) -> TrainwireError:
        """``error_from_rpc``, with a failed connection said in one line (TLS problems)."""
        error = error_from_rpc(exc)
        if error.code == grpc.StatusCode.UNAVAILABLE:
            text = describe_connection_failure(
                error.message,
                self.target,
                tls=self._tls,
                client_certificate=self._client_certificate,
            )
            if text is not None:
                return Unavailable(text, code=grpc.StatusCode.UNAVAILABLE)
        return error

    def _unary(self, method: Callable[..., Any], request: Any, timeout: float | None) -> Any:
        try:
            return method(
                request,
                timeout=self.timeout if timeout is None else timeout,
                metadata=self._metadata or None,
            )
        except grpc.RpcError as exc:
            raise self._error(exc) from exc

    def create_run(
        self,
        task: episode_pb2.TrainTask,
        config: episode_pb2.TrainConfig | None = None,
        *,
        speed: float = 0.0,
        episodes_per_second: float = 0.0,
        request_id: str = "",
        display_name: str = "",
        timeout: float | None = None,
    ) -> Run:
        """Creates a run (``CreateRun``); a ``request_id`` seen before returns the same run.

        Args:
            task: What to train (see ``imitation_task`` and ``grpo_task``).
            config: Episodes and seed (see ``train_config``).
            speed: Playback speed; 0 means 1.0.
            episodes_per_second: Base rate; 0 means the gateway's default, negative unpaced.
            request_id: Idempotency key.
            display_name: A name for people.
            timeout: This call's deadline; the client's default when ``None``.

        Raises:
            InvalidArgument: a bad task, config, speed or rate (see ``field_violations``).
        """
        request = gateway_service_pb2.CreateRunRequest(
            task=task,
            config=config,
            speed=speed,
            episodes_per_second=episodes_per_second,
            request_id=request_id,
            display_name=display_name,
        )
        response = self._unary(self._stub.CreateRun, request, timeout)
        return response.run

    def get_run(self, run_id: str, *, timeout: float | None = None) -> Run:
        """Returns one run (``GetRun``). Raises ``NotFound`` for an unknown run."""
        request = gateway_service_pb2.GetRunRequest(run_id=run_id)
        return self._unary(self._stub.GetRun, request, timeout).run

    def list_runs_page(
        self,
        *,
        state: RunState = Run.State.STATE_UNSPECIFIED,
        page_size: int = 0,
        page_token: str = "",
        timeout: float | None = None,
    ) -> gateway_service_pb2.ListRunsResponse:
        """Returns one page of runs, newest first (``ListRuns``)."""
        request = gateway_service_pb2.ListRunsRequest(
            page_size=page_size, page_token=page_token, state=cast("Run.State", state)
        )
        response: gateway_service_pb2.ListRunsResponse = self._unary(
            self._stub.ListRuns, request, timeout
        )
        return response

    def list_runs(
        self,
        *,
        state: RunState = Run.State.STATE_UNSPECIFIED,
        limit: int | None = None,
        page_size: int = 0,
        timeout: float | None = None,
    ) -> list[Run]:
        """Returns runs, newest first, following page tokens until ``limit`` runs or the end.

        Each page is its own call with its own deadline.
        """
        runs: list[Run] = []
        token = ""
        while True:
            page = self.list_runs_page(
                state=state, page_size=page_size, page_token=token, timeout=timeout
            )
            runs.extend(page.runs)
            token = page.next_page_token
            if not token or (limit is not None and len(runs) >= limit):
                return runs if limit is None else runs[:limit]

    def pause_run(self, run_id: str, *, timeout: float | None = None) -> Run:
        """Pauses a running run (``PauseRun``); a no-op on a paused run."""
        request = gateway_service_pb2.PauseRunRequest(run_id=run_id)
        return self._unary(self._stub.PauseRun, request, timeout).run

    def resume_run(self, run_id: str, *, timeout: float | None = None) -> Run:
        """Resumes a paused run (``ResumeRun``); a no-op on a running run."""
        request = gateway_service_pb2.ResumeRunRequest(run_id=run_id)
        return self._unary(self._stub.ResumeRun, request, timeout).run

    def stop_run(self, run_id: str, *, timeout: float | None = None) -> Run:
        """Stops a run (``StopRun``); its history is kept."""
        request = gateway_service_pb2.StopRunRequest(run_id=run_id)
        return self._unary(self._stub.StopRun, request, timeout).run

    def set_run_speed(self, run_id: str, speed: float, *, timeout: float | None = None) -> Run:
        """Sets a run's playback speed (``SetRunSpeed``); the gateway clamps it to 0.1..20."""
        request = gateway_service_pb2.SetRunSpeedRequest(run_id=run_id, speed=speed)
        return self._unary(self._stub.SetRunSpeed, request, timeout).run

    def delete_run(self, run_id: str, *, timeout: float | None = None) -> Run:
        """Deletes a finished run and its history (``DeleteRun``); returns it as it was."""
        request = gateway_service_pb2.DeleteRunRequest(run_id=run_id)
        return self._unary(self._stub.DeleteRun, request, timeout).run

    # streaming

    def watch(
        self,
        run_id: str,
        after_episode: int = 0,
        *,
        checker: EpisodeChecker | None = None,
        on_reconnect: Callable[[Reconnect], None] | None = None,
    ) -> WatchStream:
        """Follows a run to its end, resuming dropped streams; iterates over its events in order.

        Yields ``Episode`` s (batches flattened, each episode exactly once, numbered
        ``after_episode + 1, + 2, ...``), ``Keepalive`` s, one ``CaughtUp`` (the first stream's;
        the one a resumed stream sends again is dropped) and, last, the finished ``Run``; then
        the iteration ends. ``close()`` (or leaving a ``for`` loop over a generator that wraps
        it) cancels the stream; ``cancel()`` does so from any thread or a signal handler's
        thread. Either leaves the run alone.

        After ``UNAVAILABLE``, ``DEADLINE_EXCEEDED``, ``ABORTED``, a connection reset, a stream
        that stayed silent past ``idle_timeout`` or one that closed without ``finished``, it
        reopens the stream with ``after_episode`` = the last episode seen, waiting
        ``retry.delay(attempt)`` first; it gives up after ``retry.max_retries`` attempts in a row
        that received nothing.

        Args:
            run_id: The run to follow.
            after_episode: Start after this episode; 0 replays the whole history.
            checker: Vets each episode before it is yielded (e.g. a
                ``trainwire.contract.StreamChecker``; it must expect ``after_episode + 1``
                first). Its ``ContractViolation`` propagates.
            on_reconnect: Called before each reconnection (a connection indicator).

        Raises:
            ValueError: a negative ``after_episode``.

        The iteration raises ``TrainwireError`` for a non-retriable status (``NotFound``,
        ``InvalidArgument``...) or the last retriable one once retries are spent, and
        ``DataLoss`` when the stream skipped episodes.
        """
        if after_episode < 0:
            raise ValueError(f"after_episode must be >= 0, got {after_episode}")
        return WatchStream(self, run_id, after_episode, checker, on_reconnect)


class WatchStream(Iterator[WatchEvent]):
    """The iterator ``GatewayClient.watch`` returns; see there.

    Dropping it (leaving a ``for`` loop early) cancels the stream; ``close`` and ``cancel`` do
    so explicitly.
    """

    def __init__(
        self,
        client: GatewayClient,
        run_id: str,
        after_episode: int,
        checker: EpisodeChecker | None,
        on_reconnect: Callable[[Reconnect], None] | None,
    ) -> None:
        # The generator holds the state, never this object: no reference cycle, so a dropped
        # WatchStream closes its generator (and cancels its call) at once.
        self._state = _WatchState(client, run_id, after_episode, checker, on_reconnect)
        self._events = self._state.run()

    @property
    def run_id(self) -> str:
        """The watched run."""
        return self._state.run_id

    @property
    def last_episode(self) -> int:
        """The last episode delivered (``after_episode`` before the first)."""
        return self._state.last_episode

    @property
    def cancelled(self) -> bool:
        """Whether ``cancel`` or ``close`` ended the watch."""
        return self._state.cancel.is_set()

    def __iter__(self) -> WatchStream:
        return self

    def __next__(self) -> WatchEvent:
        return next(self._events)

    def cancel(self) -> None:
        """Ends the watch: the current stream is cancelled and the iteration stops quietly.

        Safe from any thread. From a signal handler, call it on another thread: the handler
        may have interrupted a lock this takes.
        """
        state = self._state
        state.cancel.set()
        with state.lock:
            call = state.call
        if call is not None:
            call.cancel()

    def close(self) -> None:
        """Cancels the stream from the iterating thread (or after iteration)."""
        self._state.cancel.set()
        self._events.close()


class _WatchState:
    """What one ``WatchStream`` keeps across its reconnections, and the loop that drives it."""

    def __init__(
        self,
        client: GatewayClient,
        run_id: str,
        after_episode: int,
        checker: EpisodeChecker | None,
        on_reconnect: Callable[[Reconnect], None] | None,
    ) -> None:
        self.client = client
        self.run_id = run_id
        self.last_episode = after_episode
        self.checker = checker
        self.on_reconnect = on_reconnect
        self.cancel = threading.Event()
        self.lock = threading.Lock()
        self.call: grpc.Call | None = None

    def run(self) -> Generator[WatchEvent, None, None]:
        client = self.client
        run_id = self.run_id
        failures = 0
        caught_up_seen = False
        while not self.cancel.is_set():
            request = gateway_service_pb2.WatchRunRequest(
                run_id=run_id, after_episode=self.last_episode
            )
            call = client._stub.WatchRun(
                request, timeout=client.stream_timeout, metadata=client._metadata or None
            )
            with self.lock:
                self.call = call
            if self.cancel.is_set():  # cancel() ran before it could see this call
                call.cancel()
            watchdog = _IdleWatchdog(call, client.idle_timeout)
            code: grpc.StatusCode | None = None
            reason = "the stream closed before the run finished"
            error: grpc.RpcError | None = None
            try:
                for response in call:
                    watchdog.touch()
                    failures = 0
                    kind = response.WhichOneof("event")
                    if kind == "episode" or kind == "batch":
                        episodes = (
                            (response.episode,) if kind == "episode" else response.batch.episodes
                        )
                        for episode in episodes:
                            if self._accept(episode):
                                yield episode
                    elif kind == "keepalive":
                        yield response.keepalive
                    elif kind == "caught_up":
                        if not caught_up_seen:
                            caught_up_seen = True
                            yield response.caught_up
                    elif kind == "finished":
                        yield response.finished
                        return
                    else:  # a newer server's event this client does not know: skip it
                        _LOGGER.debug("run %s: skipping unknown watch event %r", run_id, kind)
            except grpc.RpcError as exc:
                if self.cancel.is_set():
                    return
                if watchdog.fired:
                    reason = f"no message for {client.idle_timeout:g} s"
                elif _is_retriable(exc) and not (
                    client._tls
                    and isinstance(exc, grpc.Call)
                    and is_certificate_failure(exc.details() or "")
                ):
                    code = exc.code() if isinstance(exc, grpc.Call) else None
                    reason = (exc.details() if isinstance(exc, grpc.Call) else "") or "dropped"
                else:
                    raise client._error(exc) from exc
                error = exc
            finally:
                watchdog.stop()
                call.cancel()
                with self.lock:
                    self.call = None
            if self.cancel.is_set():
                return
            if failures >= client.retry.max_retries:
                if error is not None and not watchdog.fired:
                    raise client._error(error) from error
                raise Unavailable(
                    f"run {run_id}: the watch stream keeps dropping ({reason}); gave up after "
                    f"episode {self.last_episode} and {failures} retries"
                ) from error
            failures += 1
            delay = client.retry.delay(failures)
            _LOGGER.info(
                "run %s: watch stream dropped (%s); resuming after episode %d in %.2f s",
                run_id,
                reason,
                self.last_episode,
                delay,
            )
            if self.on_reconnect is not None:
                self.on_reconnect(Reconnect(failures, delay, code, reason, self.last_episode))
            self.cancel.wait(delay)

    def _accept(self, episode: episode_pb2.Episode) -> bool:
        """Checks an episode's number (and the checker); False for one already delivered."""
        last = self.last_episode
        if episode.episode <= last:
            # A server replaying too much: exactly once matters more to callers than echoing
            # the server's mistake.
            _LOGGER.warning(
                "run %s: dropped repeated episode %d (last seen %d)",
                self.run_id,
                episode.episode,
                last,
            )
            return False
        if episode.episode != last + 1:
            raise DataLoss(
                f"run {self.run_id}: the watch stream skipped from episode {last} to "
                f"{episode.episode}"
            )
        if self.checker is not None:
            self.checker.check(episode)
        self.last_episode = episode.episode
        return True


# -- request builders ------------------------------------------------------------------------------


def imitation_task(
    *,
    clip: str | episode_pb2.Clip | ClipSpec = "wave",
    rig: str | episode_pb2.Rig | RigSpec = "stickman",
    group_size: int = 0,
    learning_rate: float = 0.0,
    avatar_id: str = "",
) -> episode_pb2.TrainTask:
    """Builds an imitation ``TrainTask``.

    Args:
        clip: A built-in clip name (``wave``, ``walk``, ``jump``), a ``Clip`` message or a
            ``trainwire.motion.ClipSpec``.
        rig: A built-in rig name (``stickman``), a ``Rig`` message or a ``RigSpec``.
        group_size: Motions sampled per episode; 0 for the default.
        learning_rate: Adam learning rate; 0 for the default.
        avatar_id: Free-form id of the avatar.
    """
    task = episode_pb2.ImitationTask(
        avatar_id=avatar_id, group_size=group_size, learning_rate=learning_rate
    )
    if isinstance(rig, str):
        task.rig_name = rig
    elif isinstance(rig, episode_pb2.Rig):
        task.rig.CopyFrom(rig)
    else:
        from trainwire.motion import rig_to_proto

        task.rig.CopyFrom(rig_to_proto(rig))
    if isinstance(clip, str):
        task.clip_name = clip
    elif isinstance(clip, episode_pb2.Clip):
        task.clip.CopyFrom(clip)
    else:
        from trainwire.motion import clip_to_proto

        task.clip.CopyFrom(clip_to_proto(clip))
    return episode_pb2.TrainTask(imitation=task)


def grpo_task(
    *,
    model: str,
    dataset: str,
    reward_functions: Sequence[str] = (),
    num_generations: int = 0,
    batch_size: int = 0,
    max_completion_length: int = 0,
    learning_rate: float = 0.0,
    beta: float | None = None,
    temperature: float = 0.0,
    gradient_accumulation_steps: int = 0,
    dataloader_num_workers: int | None = None,
    dataloader_prefetch_factor: int | None = None,
) -> episode_pb2.TrainTask:
    """Builds a GRPO ``TrainTask``; zeros and ``None`` leave the trainer's defaults.

    Args:
        model: Model directory, relative to the trainer's data root.
        dataset: JSONL dataset file, relative to the trainer's data root.
        reward_functions: Reward function names; empty for ``exact_match`` and ``format``.
        num_generations: Completions per prompt.
        batch_size: Per-device batch size in completions.
        max_completion_length: Maximum completion length in tokens.
        learning_rate: Learning rate.
        beta: KL coefficient (``None``: no reference model).
        temperature: Sampling temperature.
        gradient_accumulation_steps: Gradient accumulation steps.
        dataloader_num_workers: Image-decoding worker processes.
        dataloader_prefetch_factor: Batches each worker prefetches.
    """
    task = episode_pb2.GrpoTask(
        model_path=model,
        dataset_path=dataset,
        reward_functions=list(reward_functions),
        num_generations=num_generations,
        batch_size=batch_size,
        max_completion_length=max_completion_length,
        learning_rate=learning_rate,
        temperature=temperature,
        gradient_accumulation_steps=gradient_accumulation_steps,
    )
    if beta is not None:
        task.beta = beta
    if dataloader_num_workers is not None:
        task.dataloader_num_workers = dataloader_num_workers
    if dataloader_prefetch_factor is not None:
        task.dataloader_prefetch_factor = dataloader_prefetch_factor
    return episode_pb2.TrainTask(grpo=task)


def train_config(max_episodes: int = 200, seed: int = 0) -> episode_pb2.TrainConfig:
    """Builds a ``TrainConfig`` (``max_episodes`` in 1..5000)."""
    return episode_pb2.TrainConfig(max_episodes=max_episodes, seed=seed)


def state_name(state: RunState) -> str:
    """``Run.State`` value to a short lower-case name: ``STATE_RUNNING`` -> ``running``."""
    return Run.State.Name(state).removeprefix("STATE_").lower()


def parse_state(name: str) -> RunState:
    """Short or full state name (``running``, ``STATE_RUNNING``) to its ``Run.State`` value.

    Raises:
        ValueError: an unknown state name.
    """
    full = name.strip().upper()
    if not full.startswith("STATE_"):
        full = "STATE_" + full
    try:
        value: int = Run.State.Value(full)
    except ValueError:
        names = ", ".join(state_name(v) for v in Run.State.values() if v)
        raise ValueError(f"unknown run state {name!r}; one of: {names}") from None
    return value

"""Watch-with-resume: following a run across dropped streams, each episode exactly once.

``WatchCursor`` is the bookkeeping both clients share (``trainwire.client`` and
``trainwire.aio``): the episode to resume after, batches flattened, repeats dropped, a skipped
episode raised as ``DataLoss``, the ``CaughtUp`` of a resumed stream dropped, and the retry count.
A forked run's history starts after its fork episode (``Run.fork_from``), so the first episode
a watch delivers may come after ``after_episode + 1``; from then on each is the previous + 1.
``WatchStream`` drives it over sync calls, ``trainwire.aio.AsyncWatchStream`` over ``grpc.aio``
ones. Which codes resume (``is_retriable``) and how long to wait (``RetryPolicy``) are decided
here once for both.

A watch never sees its client: the client hands it a callable that opens one ``WatchRun`` call
for a request (its stub, deadline and metadata inside) and one that turns a final status into
its typed error, so this module imports no client and the client's channel stays its own.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from typing import Protocol, TypeAlias

import grpc

from trainwire.errors import DataLoss, TrainwireError, Unavailable
from trainwire.tls import is_certificate_failure
from trainwire.v1 import episode_pb2, gateway_service_pb2

__all__ = [
    "EpisodeChecker",
    "EpisodeView",
    "EpisodeViewValue",
    "ErrorFor",
    "OpenWatchCall",
    "Reconnect",
    "RetryPolicy",
    "WatchCall",
    "WatchCursor",
    "WatchEvent",
    "WatchStream",
    "check_view",
    "is_retriable",
]

_LOGGER = logging.getLogger(__name__)

#: Events a watch yields: an ``Episode``, a ``Keepalive``, a ``CaughtUp`` (once) and, last, the
#: finished ``Run``.
WatchEvent: TypeAlias = (
    episode_pb2.Episode
    | gateway_service_pb2.Keepalive
    | gateway_service_pb2.CaughtUp
    | gateway_service_pb2.Run
)
#: What each episode of a watch carries (``WatchRunRequest.view``):
#: ``EpisodeView.EPISODE_VIEW_FULL`` (the default; ``EPISODE_VIEW_UNSPECIFIED`` means it too) or
#: ``EpisodeView.EPISODE_VIEW_SCALARS``, episodes without their ``detail``.
EpisodeView = gateway_service_pb2.EpisodeView
#: An ``EpisodeView`` value (an int at run time).
EpisodeViewValue: TypeAlias = "gateway_service_pb2.EpisodeView.ValueType"


def check_view(view: EpisodeViewValue) -> None:
    """Refuses a ``view`` the contract does not define.

    Raises:
        ValueError: an unknown value.
    """
    if view not in EpisodeView.values():
        raise ValueError(f"view must be an EpisodeView value, got {view!r}")


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


class WatchCall(Protocol):
    """One open sync ``WatchRun`` call, as the stub returns it."""

    def __iter__(self) -> Iterator[gateway_service_pb2.WatchRunResponse]: ...

    def cancel(self) -> bool: ...


#: Opens one ``WatchRun`` call for a request; the client's stub, deadline and metadata are
#: behind it.
OpenWatchCall: TypeAlias = Callable[[gateway_service_pb2.WatchRunRequest], WatchCall]
#: A failed call as the typed error the client raises (its connection problems said in one
#: line).
ErrorFor: TypeAlias = Callable[[grpc.RpcError], TrainwireError]


# Codes after which the same watch can simply be reopened from the last episode seen. INTERNAL
# with RST_STREAM is how a connection reset by a proxy sometimes surfaces.
_RETRIABLE_CODES = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ABORTED}
)


def is_retriable(exc: grpc.RpcError, *, tls: bool = False) -> bool:
    """Whether a watch stream that failed with ``exc`` is reopened (sync or asyncio call).

    A TLS certificate failure is never retried: it will fail the same way again.
    """
    if not isinstance(exc, grpc.Call | grpc.aio.AioRpcError):
        return False
    code = exc.code()
    details = exc.details() or ""
    if tls and is_certificate_failure(details):
        return False
    if code in _RETRIABLE_CODES:
        return True
    return code == grpc.StatusCode.INTERNAL and "RST_STREAM" in details


class WatchCursor:
    """What one watch keeps across its reconnections; no I/O, shared by both clients.

    Attributes:
        run_id: The watched run.
        last_episode: The last episode delivered (``after_episode`` before the first).
        failures: Reconnections in a row that received nothing.
        view: What each episode carries, on every stream of the watch.
    """

    def __init__(
        self,
        run_id: str,
        after_episode: int,
        checker: EpisodeChecker | None,
        retry: RetryPolicy,
        view: EpisodeViewValue = EpisodeView.EPISODE_VIEW_UNSPECIFIED,
    ) -> None:
        self.run_id = run_id
        self.last_episode = after_episode
        self.checker = checker
        self.retry = retry
        self.view = view
        self.failures = 0
        self._caught_up_seen = False
        self._delivered = False  # an episode was: the next must follow it

    def request(self) -> gateway_service_pb2.WatchRunRequest:
        """The request of the next stream: resume after the last episode delivered."""
        return gateway_service_pb2.WatchRunRequest(
            run_id=self.run_id, after_episode=self.last_episode, view=self.view
        )

    def events(self, response: gateway_service_pb2.WatchRunResponse) -> list[WatchEvent]:
        """The events to deliver for one response, in order (a batch is flattened; repeats and
        a second ``CaughtUp`` dropped). Resets the failure count: the stream is alive.

        Raises:
            DataLoss: the stream skipped episodes.
            ContractViolation: from the checker.
        """
        self.failures = 0
        kind = response.WhichOneof("event")
        if kind == "episode":
            return [response.episode] if self._accept(response.episode) else []
        if kind == "batch":
            return [e for e in response.batch.episodes if self._accept(e)]
        if kind == "keepalive":
            return [response.keepalive]
        if kind == "caught_up":
            if self._caught_up_seen:
                return []
            self._caught_up_seen = True
            return [response.caught_up]
        if kind == "finished":
            return [response.finished]
        # A newer server's event this client does not know: skip it.
        _LOGGER.debug("run %s: skipping unknown watch event %r", self.run_id, kind)
        return []

    def next_delay(
        self,
        reason: str,
        error: grpc.RpcError | None,
        error_for: ErrorFor,
        idle: bool,
    ) -> float:
        """Counts one more drop; returns the delay before reconnecting.

        Raises:
            TrainwireError: retries are spent (the last status, or ``Unavailable``).
        """
        if self.failures >= self.retry.max_retries:
            if error is not None and not idle:
                raise error_for(error) from error
            raise Unavailable(
                f"run {self.run_id}: the watch stream keeps dropping ({reason}); gave up after "
                f"episode {self.last_episode} and {self.failures} retries"
            ) from error
        self.failures += 1
        delay = self.retry.delay(self.failures)
        _LOGGER.info(
            "run %s: watch stream dropped (%s); resuming after episode %d in %.2f s",
            self.run_id,
            reason,
            self.last_episode,
            delay,
        )
        return delay

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
        if episode.episode != last + 1 and self._delivered:
            raise DataLoss(
                f"run {self.run_id}: the watch stream skipped from episode {last} to "
                f"{episode.episode}"
            )
        if self.checker is not None:
            self.checker.check(episode)
        self.last_episode = episode.episode
        self._delivered = True
        return True


class _IdleWatchdog:
    """Cancels a stream that received nothing for ``timeout`` seconds.

    The gateway sends keepalives on idle streams, so silence means a dead connection that the
    transport has not noticed (a half-open TCP connection, a stuck proxy).
    """

    def __init__(self, call: WatchCall, timeout: float | None) -> None:
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


class WatchStream(Iterator[WatchEvent]):
    """The iterator ``GatewayClient.watch`` returns; see there.

    Dropping it (leaving a ``for`` loop early) cancels the stream; ``close`` and ``cancel`` do
    so explicitly.

    Args:
        open_call: Opens each stream of the watch (the first, and one per reconnection).
        error_for: Turns a status that ends the watch into the error the iteration raises.
        run_id: The run to follow.
        after_episode: Start after this episode.
        retry: How to reconnect.
        idle_timeout: A stream silent for this long is dropped and reopened; ``None``: never.
        tls: Whether the channel uses TLS (a certificate failure is then never retried).
        checker: Vets each episode before it is yielded.
        on_reconnect: Called before each reconnection.
        view: What each episode carries (``EPISODE_VIEW_SCALARS``: no ``detail``).
    """

    def __init__(
        self,
        open_call: OpenWatchCall,
        error_for: ErrorFor,
        run_id: str,
        after_episode: int,
        *,
        retry: RetryPolicy,
        idle_timeout: float | None,
        tls: bool,
        checker: EpisodeChecker | None = None,
        on_reconnect: Callable[[Reconnect], None] | None = None,
        view: EpisodeViewValue = EpisodeView.EPISODE_VIEW_UNSPECIFIED,
    ) -> None:
        # The generator holds the state, never this object: no reference cycle, so a dropped
        # WatchStream closes its generator (and cancels its call) at once.
        self._state = _WatchState(
            open_call,
            error_for,
            WatchCursor(run_id, after_episode, checker, retry, view),
            idle_timeout,
            tls,
            on_reconnect,
        )
        self._events = self._state.run()

    @property
    def run_id(self) -> str:
        """The watched run."""
        return self._state.cursor.run_id

    @property
    def last_episode(self) -> int:
        """The last episode delivered (``after_episode`` before the first)."""
        return self._state.cursor.last_episode

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
    """The sync loop of one ``WatchStream``: streams over ``WatchCursor``, reconnecting."""

    def __init__(
        self,
        open_call: OpenWatchCall,
        error_for: ErrorFor,
        cursor: WatchCursor,
        idle_timeout: float | None,
        tls: bool,
        on_reconnect: Callable[[Reconnect], None] | None,
    ) -> None:
        self.open_call = open_call
        self.error_for = error_for
        self.cursor = cursor
        self.idle_timeout = idle_timeout
        self.tls = tls
        self.on_reconnect = on_reconnect
        self.cancel = threading.Event()
        self.lock = threading.Lock()
        self.call: WatchCall | None = None

    def run(self) -> Generator[WatchEvent, None, None]:
        cursor = self.cursor
        while not self.cancel.is_set():
            call = self.open_call(cursor.request())
            with self.lock:
                self.call = call
            if self.cancel.is_set():  # cancel() ran before it could see this call
                call.cancel()
            watchdog = _IdleWatchdog(call, self.idle_timeout)
            code: grpc.StatusCode | None = None
            reason = "the stream closed before the run finished"
            error: grpc.RpcError | None = None
            try:
                for response in call:
                    watchdog.touch()
                    for event in cursor.events(response):
                        yield event
                        if isinstance(event, gateway_service_pb2.Run):
                            return
            except grpc.RpcError as exc:
                if self.cancel.is_set():
                    return
                if watchdog.fired:
                    reason = f"no message for {self.idle_timeout:g} s"
                elif is_retriable(exc, tls=self.tls):
                    code = exc.code() if isinstance(exc, grpc.Call) else None
                    reason = (exc.details() if isinstance(exc, grpc.Call) else "") or "dropped"
                else:
                    raise self.error_for(exc) from exc
                error = exc
            finally:
                watchdog.stop()
                call.cancel()
                with self.lock:
                    self.call = None
            if self.cancel.is_set():
                return
            delay = cursor.next_delay(reason, error, self.error_for, watchdog.fired)
            if self.on_reconnect is not None:
                self.on_reconnect(
                    Reconnect(cursor.failures, delay, code, reason, cursor.last_episode)
                )
            self.cancel.wait(delay)

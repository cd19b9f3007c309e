"""The synchronous typed client of ``trainwire.v1.GatewayService``.

``GatewayClient`` wraps every ``GatewayService`` RPC with a deadline on every call and turns a
failed call into a typed ``TrainwireError`` (``NotFound``, ``InvalidArgument``, ...; see
``trainwire.errors``) raised ``from`` the original ``grpc.RpcError``. ``GatewayClient.watch``
follows a run as a plain iterator of events, resuming dropped streams so each episode comes
exactly once (``trainwire.watch``). ``trainwire.aio.GatewayClient`` is the same surface for
asyncio services.

Callers import the client's whole surface from here: the errors, the watch types and the
request builders (``imitation_task``, ``grpo_task``, ``train_config``, ``state_name``,
``parse_state``) are re-exported from the modules that own them.

It depends on grpcio, grpcio-status and protobuf only (no torch, no rich).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc

from trainwire.builders import (
    TERMINAL_STATES,
    ForkFrom,
    Run,
    RunState,
    create_run_request,
    fork_source,
    grpo_task,
    hyperparameters_request,
    imitation_task,
    parse_state,
    run_curve_request,
    state_name,
    train_config,
    update_run_request,
)
from trainwire.checkpoints import TarDownload
from trainwire.errors import (
    Aborted,
    AlreadyExists,
    Cancelled,
    CheckpointCorrupt,
    CheckpointNotFound,
    CheckpointStoreUnavailable,
    DataLoss,
    DeadlineExceeded,
    FailedPrecondition,
    IllegalTransition,
    Internal,
    InvalidArgument,
    InvalidRequest,
    NotFound,
    OutOfRange,
    PermissionDenied,
    ResourceExhausted,
    RunNotFound,
    ShuttingDown,
    SlotsBusy,
    StoreUnavailable,
    TooManyPending,
    TrainerUnavailable,
    TrainwireError,
    Unauthenticated,
    Unavailable,
    Unimplemented,
    Unknown,
    error_from_rpc,
)
from trainwire.reasons import ErrorReason
from trainwire.tls import (
    channel_credentials,
    describe_connection_failure,
    is_loopback_target,
)
from trainwire.v1 import episode_pb2, gateway_service_pb2, gateway_service_pb2_grpc
from trainwire.watch import (
    EpisodeChecker,
    EpisodeView,
    EpisodeViewValue,
    Reconnect,
    RetryPolicy,
    WatchCall,
    WatchEvent,
    WatchStream,
    check_view,
)

__all__ = [
    "DEFAULT_IDLE_TIMEOUT",
    "DEFAULT_TIMEOUT",
    "TERMINAL_STATES",
    "Aborted",
    "AlreadyExists",
    "Cancelled",
    "CheckpointCorrupt",
    "CheckpointNotFound",
    "CheckpointStoreUnavailable",
    "DataLoss",
    "DeadlineExceeded",
    "EpisodeChecker",
    "EpisodeView",
    "EpisodeViewValue",
    "ErrorReason",
    "FailedPrecondition",
    "ForkFrom",
    "GatewayClient",
    "IllegalTransition",
    "Internal",
    "InvalidArgument",
    "InvalidRequest",
    "NotFound",
    "OutOfRange",
    "PermissionDenied",
    "Reconnect",
    "ResourceExhausted",
    "RetryPolicy",
    "Run",
    "RunNotFound",
    "RunState",
    "ShuttingDown",
    "SlotsBusy",
    "StoreUnavailable",
    "TooManyPending",
    "TrainerUnavailable",
    "TrainwireError",
    "Unauthenticated",
    "Unavailable",
    "Unimplemented",
    "Unknown",
    "WatchEvent",
    "WatchStream",
    "error_from_rpc",
    "fork_source",
    "grpo_task",
    "imitation_task",
    "parse_state",
    "state_name",
    "train_config",
]

_LOGGER = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 10.0
DEFAULT_IDLE_TIMEOUT = 30.0


def bearer_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The call metadata that carries ``token`` (none without one).

    Raises:
        ValueError: a token that is not one line of text.
    """
    if token is not None and (not token.strip() or any(c in token for c in "\r\n")):
        raise ValueError("token must be one line of text")
    return (("authorization", f"Bearer {token.strip()}"),) if token else ()


def channel_plan(
    target: str | None,
    tls: bool,
    token: str | None,
    root_certificates: bytes | None,
    certificate_chain: bytes | None,
    private_key: bytes | None,
) -> grpc.ChannelCredentials | None:
    """The credentials of a channel the client creates to ``target``; None for plaintext.

    Raises:
        ValueError: no target.
    """
    if not target:
        raise ValueError("give a target (host:port) or a channel")
    if tls:
        return channel_credentials(root_certificates, certificate_chain, private_key)
    if token and not is_loopback_target(target):
        _LOGGER.warning("sending a token to %s without TLS: anyone on the way can read it", target)
    return None


def connection_error(
    error: TrainwireError, target: str, tls: bool, client_certificate: bool
) -> TrainwireError:
    """``error``, or for a failed connection an ``Unavailable`` that says why in one line."""
    if error.code == grpc.StatusCode.UNAVAILABLE:
        text = describe_connection_failure(
            error.message, target, tls=tls, client_certificate=client_certificate
        )
        if text is not None:
            return Unavailable(text, code=grpc.StatusCode.UNAVAILABLE)
    return error


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
        self._metadata = bearer_metadata(token)
        if channel is None:
            credentials = channel_plan(
                target, tls, token, root_certificates, certificate_chain, private_key
            )
            assert target  # channel_plan checked it
            if credentials is not None:
                channel = grpc.secure_channel(target, credentials, options=list(options))
            else:
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
        return connection_error(
            error_from_rpc(exc), self.target, self._tls, self._client_certificate
        )

    def _unary(self, method: Callable[..., Any], request: Any, timeout: float | None) -> Any:
        try:
            return method(
                request,
                timeout=self.timeout if timeout is None else timeout,
                metadata=self._metadata or None,
            )
        except grpc.RpcError as exc:
            raise self._error(exc) from exc

    def _control(self, method: Callable[..., Any], request: Any, timeout: float | None) -> Run:
        run: Run = self._unary(method, request, timeout).run
        return run

    def create_run(
        self,
        task: episode_pb2.TrainTask,
        config: episode_pb2.TrainConfig | None = None,
        *,
        speed: float = 0.0,
        episodes_per_second: float = 0.0,
        request_id: str = "",
        display_name: str = "",
        labels: Mapping[str, str] | None = None,
        fork_from: ForkFrom | None = None,
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
            labels: Labels for people and searches (Kubernetes label rules, see ``Run.labels``).
            fork_from: Start from this checkpoint of another run instead of from scratch:
                ``(run_id, episode)`` (episode 0: its latest checkpoint), a run id alone, or a
                ``ForkSource``. ``task`` must have the run's kind and model; its
                hyperparameters, the seed and ``max_episodes`` may differ. The new run's
                episodes are numbered from the checkpoint's episode + 1.
            timeout: This call's deadline; the client's default when ``None``.

        Raises:
            InvalidArgument: a bad task, config, speed, rate or label (see
                ``field_violations``); bad labels and fork sources are refused before
                anything is sent.
            TrainwireError: a fork the gateway refuses (no such run or checkpoint, another
                task kind or model); its message names the reason.
        """
        request = create_run_request(
            task,
            config,
            speed=speed,
            episodes_per_second=episodes_per_second,
            request_id=request_id,
            display_name=display_name,
            labels=labels,
            fork_from=fork_from,
        )
        return self._control(self._stub.CreateRun, request, timeout)

    def get_run(self, run_id: str, *, timeout: float | None = None) -> Run:
        """Returns one run (``GetRun``). Raises ``NotFound`` for an unknown run."""
        request = gateway_service_pb2.GetRunRequest(run_id=run_id)
        return self._control(self._stub.GetRun, request, timeout)

    def list_runs_page(
        self,
        *,
        state: RunState = Run.State.STATE_UNSPECIFIED,
        page_size: int = 0,
        page_token: str = "",
        filter: str = "",
        order_by: str = "",
        timeout: float | None = None,
    ) -> gateway_service_pb2.ListRunsResponse:
        """Returns one page of runs (``ListRuns``): those ``filter`` finds (AIP-160, e.g.
        ``'state = STATE_DONE AND labels.team = "vision"'``), newest first unless ``order_by``
        says otherwise (AIP-132, e.g. ``"best_reward desc"``). A token goes with the filter and
        order it was issued for. A malformed filter raises ``InvalidArgument``."""
        request = gateway_service_pb2.ListRunsRequest(
            page_size=page_size,
            page_token=page_token,
            state=state,
            filter=filter,
            order_by=order_by,
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
        filter: str = "",
        order_by: str = "",
        timeout: float | None = None,
    ) -> list[Run]:
        """Returns the runs ``filter`` finds in ``order_by``'s order (newest first by default;
        see ``list_runs_page``), following page tokens until ``limit`` runs or the end.

        Each page is its own call with its own deadline.
        """
        runs: list[Run] = []
        token = ""
        while True:
            page = self.list_runs_page(
                state=state,
                page_size=page_size,
                page_token=token,
                filter=filter,
                order_by=order_by,
                timeout=timeout,
            )
            runs.extend(page.runs)
            token = page.next_page_token
            if not token or (limit is not None and len(runs) >= limit):
                return runs if limit is None else runs[:limit]

    def update_run(
        self,
        run_id: str,
        *,
        display_name: str | None = None,
        labels: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> Run:
        """Renames and/or relabels a run, active or finished (``UpdateRun``); returns it.

        Only what is given changes (the request's field mask names exactly those fields).
        ``labels`` replaces the run's whole label set: read the run, change its labels and
        send them back to add or remove some (``{}`` removes them all).

        Raises:
            ValueError: neither ``display_name`` nor ``labels``.
            InvalidArgument: a bad display name, label key or value (the field names the key,
                ``run.labels[key]``); refused before anything is sent.
            NotFound: no such run.
            PermissionDenied: the token's role is below operator.
        """
        request = update_run_request(run_id, display_name=display_name, labels=labels)
        return self._control(self._stub.UpdateRun, request, timeout)

    def pause_run(self, run_id: str, *, timeout: float | None = None) -> Run:
        """Pauses a running run (``PauseRun``); a no-op on a paused run."""
        request = gateway_service_pb2.PauseRunRequest(run_id=run_id)
        return self._control(self._stub.PauseRun, request, timeout)

    def resume_run(self, run_id: str, *, timeout: float | None = None) -> Run:
        """Resumes a paused run (``ResumeRun``); a no-op on a running run."""
        request = gateway_service_pb2.ResumeRunRequest(run_id=run_id)
        return self._control(self._stub.ResumeRun, request, timeout)

    def stop_run(self, run_id: str, *, timeout: float | None = None) -> Run:
        """Stops a run (``StopRun``); its history is kept."""
        request = gateway_service_pb2.StopRunRequest(run_id=run_id)
        return self._control(self._stub.StopRun, request, timeout)

    def set_run_speed(self, run_id: str, speed: float, *, timeout: float | None = None) -> Run:
        """Sets a run's playback speed (``SetRunSpeed``); the gateway clamps it to 0.1..20."""
        request = gateway_service_pb2.SetRunSpeedRequest(run_id=run_id, speed=speed)
        return self._control(self._stub.SetRunSpeed, request, timeout)

    def set_run_hyperparameters(
        self,
        run_id: str,
        *,
        learning_rate: float | None = None,
        temperature: float | None = None,
        beta: float | None = None,
        timeout: float | None = None,
    ) -> Run:
        """Changes a RUNNING or PAUSED run's hyperparameters from its next optimizer step
        (``SetRunHyperparameters``); ``None`` leaves a value as it is. Returns the run, its
        task holding the values now in effect. Every episode trained from then on carries
        them as metrics (``learning_rate``, ``temperature``, ``beta``).

        Args:
            run_id: The run.
            learning_rate: Learning rate, in (0, 1] (imitation and grpo).
            temperature: Sampling temperature, in (0, 10] (grpo).
            beta: KL coefficient, in [0, 10] (grpo; above 0 only for a job started with one).
            timeout: This call's deadline; the client's default when ``None``.

        Raises:
            ValueError: no value given.
            InvalidArgument: a value not finite or out of range (refused before anything is
                sent), or one the run's task kind does not have.
            NotFound: no such run.
            FailedPrecondition: the run is PENDING or finished.
            Unavailable: its trainer could not be reached; try again.
            PermissionDenied: the token's role is below operator.
        """
        request = hyperparameters_request(
            run_id, learning_rate=learning_rate, temperature=temperature, beta=beta
        )
        return self._control(self._stub.SetRunHyperparameters, request, timeout)

    def delete_run(self, run_id: str, *, timeout: float | None = None) -> Run:
        """Deletes a finished run and its history (``DeleteRun``); returns it as it was."""
        request = gateway_service_pb2.DeleteRunRequest(run_id=run_id)
        return self._control(self._stub.DeleteRun, request, timeout)

    def list_checkpoints(
        self, run_id: str, *, timeout: float | None = None
    ) -> list[episode_pb2.Checkpoint]:
        """The run's checkpoints, oldest first (``ListCheckpoints``)."""
        request = gateway_service_pb2.ListCheckpointsRequest(run_id=run_id)
        return list(self._unary(self._stub.ListCheckpoints, request, timeout).checkpoints)

    def download_checkpoint(
        self,
        run_id: str,
        out_dir: str | Path,
        *,
        episode: int = 0,
        merged: bool = False,
        timeout: float | None = None,
    ) -> episode_pb2.Checkpoint:
        """Downloads a checkpoint (``episode`` 0: the latest) into ``out_dir`` (a directory
        that does not exist yet, or an empty one); returns its record once its SHA-256 matched
        and it was extracted. A GRPO checkpoint's ``model/`` loads with transformers'
        ``from_pretrained``; a LoRA run's holds the adapter, which peft's
        ``PeftModel.from_pretrained(base, out_dir / "model")`` loads onto the base model that
        ``model/base_model.json`` names. Memory stays flat: the chunks go to disk as they come.

        Args:
            merged: A LoRA run's adapter merged into its base model by a trainer: ``model/``
                then loads with transformers alone (the record's size and digest are the
                merged tar's).
            timeout: Deadline of the whole download (default: ``stream_timeout``; a merge
                takes the time to load, merge and save the model first).

        Raises:
            CheckpointNotFound, RunNotFound: no such checkpoint or run.
            CheckpointCorrupt: the bytes did not match the checkpoint's digest (nothing is left
                at ``out_dir``).
            FailedPrecondition: ``merged`` for a run without LoRA adapters.
            FileExistsError: ``out_dir`` is not empty.
        """
        download = TarDownload(run_id, out_dir)
        request = gateway_service_pb2.DownloadCheckpointRequest(
            run_id=run_id, episode=episode, merged=merged
        )
        try:
            responses = self._stub.DownloadCheckpoint(
                request,
                timeout=self.stream_timeout if timeout is None else timeout,
                metadata=self._metadata or None,
            )
            for response in responses:
                download.receive(response)
        except grpc.RpcError as exc:
            download.abort()
            raise self._error(exc) from exc
        except BaseException:
            download.abort()
            raise
        return download.finish()

    def get_run_curve(
        self,
        run_id: str,
        *,
        buckets: int = 0,
        metrics: Sequence[str] = (),
        first_episode: int = 0,
        last_episode: int = 0,
        timeout: float | None = None,
    ) -> gateway_service_pb2.GetRunCurveResponse:
        """The run's reward curve, summarised in contiguous buckets (``GetRunCurve``).

        Each ``CurveBucket`` holds the reward's min, max and mean over its episodes, the best
        reward at its last episode and the mean of each requested metric; together they cover
        the range once, in order. The gateway answers from aggregates it keeps, so a
        ten-million-episode run costs what a short one does. ``last_episode`` of the response is
        the run's last committed episode (0 and no buckets before the first).

        Args:
            run_id: The run.
            buckets: How many buckets, 1..10000; 0 means the gateway's default (500). Fewer
                come back when the range holds fewer episodes (one per episode then).
            metrics: Names of ``Episode.metrics`` whose per-bucket means to include.
            first_episode: Start of the range; 0 means the first episode.
            last_episode: End of the range; 0 means the run's last episode.
            timeout: This call's deadline; the client's default when ``None``.

        Raises:
            TypeError: ``metrics`` is one string (give a sequence of names).
            InvalidArgument: a bad bucket count, range or metric name.
            NotFound: no such run.
        """
        request = run_curve_request(run_id, buckets, metrics, first_episode, last_episode)
        response: gateway_service_pb2.GetRunCurveResponse = self._unary(
            self._stub.GetRunCurve, request, timeout
        )
        return response

    # streaming

    def watch(
        self,
        run_id: str,
        after_episode: int = 0,
        *,
        checker: EpisodeChecker | None = None,
        on_reconnect: Callable[[Reconnect], None] | None = None,
        view: EpisodeViewValue = EpisodeView.EPISODE_VIEW_UNSPECIFIED,
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
            view: What each episode carries, on every stream of the watch:
                ``EpisodeView.EPISODE_VIEW_SCALARS`` for episodes without their ``detail``
                (numbers only: curves and tables, a fraction of the bytes);
                ``EPISODE_VIEW_FULL``, the same as the default ``EPISODE_VIEW_UNSPECIFIED``, for
                the detail too.

        Raises:
            ValueError: a negative ``after_episode``, or a ``view`` that is no ``EpisodeView``.

        The iteration raises ``TrainwireError`` for a non-retriable status (``NotFound``,
        ``InvalidArgument``...) or the last retriable one once retries are spent, and
        ``DataLoss`` when the stream skipped episodes.
        """
        if after_episode < 0:
            raise ValueError(f"after_episode must be >= 0, got {after_episode}")
        check_view(view)
        return WatchStream(
            self._open_watch,
            self._error,
            run_id,
            after_episode,
            retry=self.retry,
            idle_timeout=self.idle_timeout,
            tls=self._tls,
            checker=checker,
            on_reconnect=on_reconnect,
            view=view,
        )

    def _open_watch(self, request: gateway_service_pb2.WatchRunRequest) -> WatchCall:
        """Opens one ``WatchRun`` stream with the stream deadline and this client's token."""
        call: WatchCall = self._stub.WatchRun(
            request, timeout=self.stream_timeout, metadata=self._metadata or None
        )
        return call

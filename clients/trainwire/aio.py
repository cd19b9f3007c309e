"""The asyncio typed client of ``trainwire.v1.GatewayService``, for ``grpc.aio`` services.

``GatewayClient`` here has the surface of ``trainwire.client.GatewayClient`` with coroutines:
a deadline on every call, typed ``TrainwireError`` s (``trainwire.errors``) raised ``from`` the
original ``grpc.aio.AioRpcError``, and ``watch``, an async iterator that resumes dropped streams
so each episode comes exactly once, with the same ``WatchCursor`` bookkeeping, retry policy and
retriable codes as the sync client (``trainwire.watch``).

Example::

    async with trainwire.aio.GatewayClient("127.0.0.1:50051") as gw:
        run = await gw.create_run(imitation_task(clip="wave"), train_config(200))
        async with gw.watch(run.id) as events:
            async for event in events:
                ...
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeAlias

import grpc

from trainwire.builders import (
    ForkFrom,
    Run,
    RunState,
    create_run_request,
    hyperparameters_request,
    run_curve_request,
    update_run_request,
)
from trainwire.checkpoints import TarDownload
from trainwire.client import (
    DEFAULT_IDLE_TIMEOUT,
    DEFAULT_TIMEOUT,
    bearer_metadata,
    channel_plan,
    connection_error,
)
from trainwire.errors import TrainwireError, error_from_rpc
from trainwire.v1 import episode_pb2, gateway_service_pb2, gateway_service_pb2_grpc
from trainwire.watch import (
    EpisodeChecker,
    EpisodeView,
    EpisodeViewValue,
    ErrorFor,
    Reconnect,
    RetryPolicy,
    WatchCursor,
    WatchEvent,
    check_view,
    is_retriable,
)

__all__ = ["AsyncWatchStream", "GatewayClient"]


class GatewayClient:
    """An asyncio client of ``trainwire.v1.GatewayService``; see ``trainwire.client``'s.

    Create it inside the event loop that uses it. Use as ``async with``, or await ``close``.
    Arguments are those of the sync ``GatewayClient``; ``channel`` is a ``grpc.aio.Channel``.
    """

    def __init__(
        self,
        target: str | None = None,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        channel: grpc.aio.Channel | None = None,
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
                channel = grpc.aio.secure_channel(target, credentials, options=list(options))
            else:
                channel = grpc.aio.insecure_channel(target, options=list(options))
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

    async def close(self) -> None:
        """Closes the channel if the client created it (open calls are cancelled)."""
        if self._owns_channel:
            await self._channel.close()

    async def __aenter__(self) -> GatewayClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def _error(self, exc: grpc.RpcError) -> TrainwireError:
        return connection_error(
            error_from_rpc(exc), self.target, self._tls, self._client_certificate
        )

    async def _unary(self, method: Callable[..., Any], request: Any, timeout: float | None) -> Any:
        try:
            return await method(
                request,
                timeout=self.timeout if timeout is None else timeout,
                metadata=self._metadata or None,
            )
        except grpc.aio.AioRpcError as exc:
            raise self._error(exc) from exc

    async def create_run(
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
        """Creates a run (``CreateRun``), from scratch or forked from another run's
        checkpoint; see the sync client's ``create_run``."""
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
        response: gateway_service_pb2.CreateRunResponse = await self._unary(
            self._stub.CreateRun, request, timeout
        )
        return response.run

    async def get_run(self, run_id: str, *, timeout: float | None = None) -> Run:
        """Returns one run (``GetRun``). Raises ``NotFound`` for an unknown run."""
        request = gateway_service_pb2.GetRunRequest(run_id=run_id)
        response: gateway_service_pb2.GetRunResponse = await self._unary(
            self._stub.GetRun, request, timeout
        )
        return response.run

    async def list_runs_page(
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
        response: gateway_service_pb2.ListRunsResponse = await self._unary(
            self._stub.ListRuns, request, timeout
        )
        return response

    async def list_runs(
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
        see ``list_runs_page``), following page tokens until ``limit`` runs or the end."""
        runs: list[Run] = []
        token = ""
        while True:
            page = await self.list_runs_page(
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

    async def _control(
        self, method: Callable[..., Any], request: Any, timeout: float | None
    ) -> Run:
        response = await self._unary(method, request, timeout)
        run: Run = response.run
        return run

    async def update_run(
        self,
        run_id: str,
        *,
        display_name: str | None = None,
        labels: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> Run:
        """Renames and/or relabels a run (``UpdateRun``, a field mask of the fields given;
        ``labels`` replaces the whole set); see the sync client's ``update_run``."""
        request = update_run_request(run_id, display_name=display_name, labels=labels)
        return await self._control(self._stub.UpdateRun, request, timeout)

    async def pause_run(self, run_id: str, *, timeout: float | None = None) -> Run:
        """Pauses a running run (``PauseRun``); a no-op on a paused run."""
        request = gateway_service_pb2.PauseRunRequest(run_id=run_id)
        return await self._control(self._stub.PauseRun, request, timeout)

    async def resume_run(self, run_id: str, *, timeout: float | None = None) -> Run:
        """Resumes a paused run (``ResumeRun``); a no-op on a running run."""
        request = gateway_service_pb2.ResumeRunRequest(run_id=run_id)
        return await self._control(self._stub.ResumeRun, request, timeout)

    async def stop_run(self, run_id: str, *, timeout: float | None = None) -> Run:
        """Stops a run (``StopRun``); its history is kept."""
        request = gateway_service_pb2.StopRunRequest(run_id=run_id)
        return await self._control(self._stub.StopRun, request, timeout)

    async def set_run_speed(
        self, run_id: str, speed: float, *, timeout: float | None = None
    ) -> Run:
        """Sets a run's playback speed (``SetRunSpeed``); the gateway clamps it to 0.1..20."""
        request = gateway_service_pb2.SetRunSpeedRequest(run_id=run_id, speed=speed)
        return await self._control(self._stub.SetRunSpeed, request, timeout)

    async def set_run_hyperparameters(
        self,
        run_id: str,
        *,
        learning_rate: float | None = None,
        temperature: float | None = None,
        beta: float | None = None,
        timeout: float | None = None,
    ) -> Run:
        """Changes a live run's hyperparameters (``SetRunHyperparameters``); see the sync
        client's ``set_run_hyperparameters``."""
        request = hyperparameters_request(
            run_id, learning_rate=learning_rate, temperature=temperature, beta=beta
        )
        return await self._control(self._stub.SetRunHyperparameters, request, timeout)

    async def delete_run(self, run_id: str, *, timeout: float | None = None) -> Run:
        """Deletes a finished run and its history (``DeleteRun``); returns it as it was."""
        request = gateway_service_pb2.DeleteRunRequest(run_id=run_id)
        return await self._control(self._stub.DeleteRun, request, timeout)

    async def list_checkpoints(
        self, run_id: str, *, timeout: float | None = None
    ) -> list[episode_pb2.Checkpoint]:
        """The run's checkpoints, oldest first (``ListCheckpoints``)."""
        request = gateway_service_pb2.ListCheckpointsRequest(run_id=run_id)
        reply = await self._unary(self._stub.ListCheckpoints, request, timeout)
        return list(reply.checkpoints)

    async def download_checkpoint(
        self,
        run_id: str,
        out_dir: str | Path,
        *,
        episode: int = 0,
        merged: bool = False,
        timeout: float | None = None,
    ) -> episode_pb2.Checkpoint:
        """Downloads a checkpoint into ``out_dir``; see
        ``trainwire.client.GatewayClient.download_checkpoint``. Disk writes and the extraction
        run in a thread."""
        download = await asyncio.to_thread(TarDownload, run_id, out_dir)
        request = gateway_service_pb2.DownloadCheckpointRequest(
            run_id=run_id, episode=episode, merged=merged
        )
        try:
            call = self._stub.DownloadCheckpoint(
                request,
                timeout=self.stream_timeout if timeout is None else timeout,
                metadata=self._metadata or None,
            )
            async for response in call:
                await asyncio.to_thread(download.receive, response)
        except grpc.aio.AioRpcError as exc:
            download.abort()
            raise self._error(exc) from exc
        except BaseException:
            download.abort()
            raise
        return await asyncio.to_thread(download.finish)

    async def get_run_curve(
        self,
        run_id: str,
        *,
        buckets: int = 0,
        metrics: Sequence[str] = (),
        first_episode: int = 0,
        last_episode: int = 0,
        timeout: float | None = None,
    ) -> gateway_service_pb2.GetRunCurveResponse:
        """The run's reward curve, summarised in contiguous buckets (``GetRunCurve``); see
        ``trainwire.client.GatewayClient.get_run_curve``."""
        request = run_curve_request(run_id, buckets, metrics, first_episode, last_episode)
        response: gateway_service_pb2.GetRunCurveResponse = await self._unary(
            self._stub.GetRunCurve, request, timeout
        )
        return response

    def watch(
        self,
        run_id: str,
        after_episode: int = 0,
        *,
        checker: EpisodeChecker | None = None,
        on_reconnect: Callable[[Reconnect], None] | None = None,
        view: EpisodeViewValue = EpisodeView.EPISODE_VIEW_UNSPECIFIED,
    ) -> AsyncWatchStream:
        """Follows a run to its end, resuming dropped streams; see the sync client's ``watch``.

        Returns an async iterator (``async for``); ``async with`` around it (or ``aclose``)
        cancels the stream when the caller stops early.

        Raises:
            ValueError: a negative ``after_episode``, or a ``view`` that is no ``EpisodeView``.
        """
        if after_episode < 0:
            raise ValueError(f"after_episode must be >= 0, got {after_episode}")
        check_view(view)
        return AsyncWatchStream(
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

    def _open_watch(self, request: gateway_service_pb2.WatchRunRequest) -> AsyncWatchCall:
        """Opens one ``WatchRun`` stream with the stream deadline and this client's token."""
        call: AsyncWatchCall = self._stub.WatchRun(
            request, timeout=self.stream_timeout, metadata=self._metadata or None
        )
        return call


#: One open ``WatchRun`` call of ``grpc.aio``.
AsyncWatchCall: TypeAlias = "grpc.aio.UnaryStreamCall[Any, Any]"


class AsyncWatchStream(AsyncIterator[WatchEvent]):
    """The async iterator ``GatewayClient.watch`` returns (see there).

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
        open_call: Callable[[gateway_service_pb2.WatchRunRequest], AsyncWatchCall],
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
        self._open_call = open_call
        self._error_for = error_for
        self._cursor = WatchCursor(run_id, after_episode, checker, retry, view)
        self._idle_timeout = idle_timeout
        self._tls = tls
        self._on_reconnect = on_reconnect
        self._cancelled = False
        self._wake = asyncio.Event()
        self._call: AsyncWatchCall | None = None
        self._events = self._run()

    @property
    def run_id(self) -> str:
        """The watched run."""
        return self._cursor.run_id

    @property
    def last_episode(self) -> int:
        """The last episode delivered (``after_episode`` before the first)."""
        return self._cursor.last_episode

    @property
    def cancelled(self) -> bool:
        """Whether ``cancel`` or ``aclose`` ended the watch."""
        return self._cancelled

    def __aiter__(self) -> AsyncWatchStream:
        return self

    async def __anext__(self) -> WatchEvent:
        return await self._events.__anext__()

    async def __aenter__(self) -> AsyncWatchStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def cancel(self) -> None:
        """Ends the watch: the current stream is cancelled and the iteration stops quietly.
        Call it from the client's event loop."""
        self._cancelled = True
        self._wake.set()
        if self._call is not None:
            self._call.cancel()

    async def aclose(self) -> None:
        """Cancels the stream and finishes the iteration."""
        self.cancel()
        await self._events.aclose()

    async def _read(self, call: AsyncWatchCall) -> Any:
        timeout = self._idle_timeout
        if timeout is None:
            return await call.read()
        return await asyncio.wait_for(call.read(), timeout)

    async def _run(self) -> AsyncGenerator[WatchEvent, None]:
        cursor = self._cursor
        while not self._cancelled:
            call = self._open_call(cursor.request())
            self._call = call
            code: grpc.StatusCode | None = None
            reason = "the stream closed before the run finished"
            error: grpc.RpcError | None = None
            idle = False
            try:
                while True:
                    try:
                        response = await self._read(call)
                    except TimeoutError:
                        # Silence: a dead connection the transport has not noticed.
                        idle = True
                        reason = f"no message for {self._idle_timeout:g} s"
                        break
                    if response is grpc.aio.EOF:
                        break
                    for event in cursor.events(response):
                        yield event
                        if isinstance(event, gateway_service_pb2.Run):
                            return
            except grpc.aio.AioRpcError as exc:
                if self._cancelled:
                    return
                if not is_retriable(exc, tls=self._tls):
                    raise self._error_for(exc) from exc
                code = exc.code()
                reason = exc.details() or "dropped"
                error = exc
            except asyncio.CancelledError:
                if self._cancelled:  # cancel() cancelled the call under our read
                    return
                raise
            finally:
                call.cancel()
                self._call = None
            if self._cancelled:
                return
            delay = cursor.next_delay(reason, error, self._error_for, idle)
            if self._on_reconnect is not None:
                self._on_reconnect(
                    Reconnect(cursor.failures, delay, code, reason, cursor.last_episode)
                )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), delay)

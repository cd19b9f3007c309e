"""``trainwire watch`` (the live view or JSON lines) and the history replay ``avatar`` reads;
Ctrl+C detaches from a run without stopping it (exit 130).
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from trainwire.cli import _format
from trainwire.cli._output import (
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_STOPPED,
    CliError,
    Output,
)
from trainwire.client import (
    EpisodeView,
    EpisodeViewValue,
    GatewayClient,
    Reconnect,
    Run,
    WatchEvent,
    WatchStream,
    state_name,
)
from trainwire.v1 import episode_pb2, gateway_service_pb2

if TYPE_CHECKING:
    from trainwire.cli._watch import WatchView


def _watch_exit(run: Run) -> int:
    if run.state == Run.State.STATE_DONE:
        return EXIT_OK
    if run.state == Run.State.STATE_STOPPED:
        return EXIT_STOPPED
    return EXIT_ERROR


def _event_json(event: WatchEvent | Reconnect) -> dict[str, Any]:
    """A watch event as the ``WatchRunResponse`` that carries it, in the protobuf JSON mapping
    (batches come as one ``episode`` each); a reconnection, which no message carries, as
    ``{"reconnect": {...}}`` in the same style."""
    if isinstance(event, Reconnect):
        reconnect: dict[str, Any] = {
            "attempt": event.attempt,
            "delay": round(event.delay, 3),
            "reason": event.reason,
            "afterEpisode": str(event.after_episode),  # int64: a string, as in the mapping
        }
        if event.code is not None:
            reconnect["code"] = event.code.name
        return {"reconnect": reconnect}
    response = gateway_service_pb2.WatchRunResponse()
    if isinstance(event, episode_pb2.Episode):
        response.episode.CopyFrom(event)
    elif isinstance(event, gateway_service_pb2.Keepalive):
        response.keepalive.CopyFrom(event)
    elif isinstance(event, gateway_service_pb2.CaughtUp):
        response.caught_up.CopyFrom(event)
    else:
        response.finished.CopyFrom(event)
    return _format.to_dict(response)


@contextlib.contextmanager
def _detach_on_ctrl_c(stream: WatchStream) -> Iterator[threading.Event]:
    """Turns Ctrl+C into ``stream.cancel()``; the yielded event says whether it happened.

    A KeyboardInterrupt raised inside grpc's blocking iteration can leave the call half torn
    down, and closing the channel then hangs; cancelling the call from another thread is the
    supported way out. Only the main thread can install signal handlers; elsewhere (tests
    calling ``main`` from a worker thread) Ctrl+C keeps its default behaviour.
    """
    hit = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield hit
        return

    def on_sigint(signum: int, frame: object) -> None:
        hit.set()
        # Not stream.cancel() here: the handler may have interrupted a lock cancel() takes.
        threading.Thread(target=stream.cancel, name="trainwire-detach", daemon=True).start()

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield hit
    finally:
        signal.signal(signal.SIGINT, previous)


def _detached(run_id: str, episode: int) -> int:
    print(
        f"detached from run {run_id} after episode {episode}; it keeps running "
        f"(trainwire watch {run_id} --after {episode} to follow it again)",
        file=sys.stderr,
    )
    return EXIT_INTERRUPTED


def cmd_watch(client: GatewayClient, args: argparse.Namespace, out: Output) -> int:
    client.idle_timeout = args.idle_timeout
    if out.json:
        return _watch_json(client, args)
    try:
        from rich.console import Console
        from rich.live import Live

        from trainwire.cli._watch import WatchView
    except ImportError as exc:
        raise CliError(
            "the live view needs rich: pip install 'trainwire[cli]' (or use --json)"
        ) from exc
    run = client.get_run(args.run_id)
    view = WatchView(run, args.after)
    console = Console()
    # The view shows numbers only: the detail of the history would be bytes for nothing.
    stream = client.watch(
        args.run_id,
        args.after,
        on_reconnect=view.on_reconnect,
        view=EpisodeView.EPISODE_VIEW_SCALARS,
    )
    with (
        _detach_on_ctrl_c(stream) as interrupted,
        Live(console=console, get_renderable=view.render, refresh_per_second=8),
        _latest_answers(client, run, args.after, view),  # ends first: the last frame has them
    ):
        for event in stream:
            view.on_event(event)
    if not console.is_terminal:  # rich ends a file's final frame without a newline
        console.line()
    if interrupted.is_set() or view.finished is None:
        return _detached(args.run_id, stream.last_episode)
    return _report_end(view.finished)


@contextlib.contextmanager
def _latest_answers(client: GatewayClient, run: Run, after: int, view: WatchView) -> Iterator[None]:
    """For a GRPO run, feeds ``view`` the samples of its episodes from the latest one on (not
    the history's: a thumbnail per sample adds up over a long run), on a stream of their own
    followed by a thread. On exit it cancels that stream, after waiting briefly for its last
    episodes when the run ended."""
    if run.task.WhichOneof("kind") != "grpo":
        yield
        return
    answers = client.watch(run.id, max(after, run.episode - 1), view=EpisodeView.EPISODE_VIEW_FULL)

    def follow() -> None:
        # The main stream reports the run's end and any error; this one only shows answers.
        with contextlib.suppress(Exception):
            for event in answers:
                if isinstance(event, episode_pb2.Episode):
                    view.on_answers(event)

    thread = threading.Thread(target=follow, name="trainwire-answers", daemon=True)
    thread.start()
    try:
        yield
    finally:
        if view.finished is not None:
            thread.join(_ANSWERS_GRACE_S)  # this stream ends too, right after the main one
        answers.cancel()
        thread.join(_ANSWERS_GRACE_S)


#: How long the live view waits for the answers of a run's last episodes once the run ended.
_ANSWERS_GRACE_S = 2.0


def _report_end(run: Run) -> int:
    code = _watch_exit(run)
    if run.state == Run.State.STATE_ERROR:
        print(
            f"error: run {run.id} failed: {_format.clean(run.error_message) or 'no reason given'}",
            file=sys.stderr,
        )
    else:
        print(f"run {run.id} {state_name(run.state)} after episode {run.episode}", file=sys.stderr)
    return code


def _watch_json(client: GatewayClient, args: argparse.Namespace) -> int:
    def emit(event: WatchEvent | Reconnect) -> None:
        print(_format.dumps(_event_json(event)), flush=True)

    view = EpisodeView.EPISODE_VIEW_SCALARS if args.scalars else EpisodeView.EPISODE_VIEW_FULL
    stream = client.watch(args.run_id, args.after, on_reconnect=emit, view=view)
    finished: Run | None = None
    with _detach_on_ctrl_c(stream) as interrupted:
        for event in stream:
            emit(event)
            if isinstance(event, Run):
                finished = event
    if interrupted.is_set() or finished is None:
        return _detached(args.run_id, stream.last_episode)
    if finished.state == Run.State.STATE_ERROR:
        print(
            f"error: run {finished.id} failed: {_format.clean(finished.error_message)}",
            file=sys.stderr,
        )
    return _watch_exit(finished)


def history(
    client: GatewayClient,
    run_id: str,
    view: EpisodeViewValue = EpisodeView.EPISODE_VIEW_FULL,
) -> Iterator[episode_pb2.Episode]:
    """The run's episodes published so far (the replay up to ``caught_up``, or to the end)."""
    stream = client.watch(run_id, view=view)
    with _detach_on_ctrl_c(stream) as interrupted:
        try:
            for event in stream:
                if isinstance(event, episode_pb2.Episode):
                    yield event
                elif isinstance(event, gateway_service_pb2.CaughtUp | Run):
                    return
        finally:
            stream.close()
    if interrupted.is_set():
        raise KeyboardInterrupt

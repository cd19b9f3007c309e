"""``trainwire watch``: the state behind the live view, and the rich rendering of it.

``WatchView`` folds watch events into what the view shows (progress, live rate, ETA, state,
rewards, the learning curve, connection health, and for a GRPO run the latest answers: the
samples of the latest episode that has some, each answer beside the expected one and its
reward). It is plain Python; only ``render`` imports rich, so the JSON mode and the tests of the
bookkeeping need no rich.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from trainwire.cli._format import clean, duration_text, sparkline, task_summary
from trainwire.client import Reconnect, Run, WatchEvent, state_name
from trainwire.v1 import episode_pb2, gateway_service_pb2

if TYPE_CHECKING:
    from rich.console import RenderableType

# Live episodes within this many seconds make up the displayed rate.
_RATE_WINDOW_S = 10.0
#: The latest answers shown, and how much of each text.
SHOWN_ANSWERS = 4
_ANSWER_CHARS = 48
_STATE_STYLE = {
    "pending": "yellow",
    "running": "green",
    "paused": "yellow",
    "done": "bold green",
    "stopped": "magenta",
    "error": "bold red",
}


class WatchView:
    """What the live view shows, updated event by event.

    Args:
        run: The run as ``GetRun`` returned it when the watch started.
        after_episode: The episode the watch starts after.
        clock: Monotonic clock (tests pass a fake one).
    """

    def __init__(self, run: Run, after_episode: int = 0, clock: Any = time.monotonic) -> None:
        self.run = run
        self.clock = clock
        self.max_episodes = run.config.max_episodes
        self.state = run.state
        self.episode = after_episode
        self.reward: float | None = None
        self.best_reward: float | None = run.best_reward if run.episode else None
        self.rewards: list[float] = []
        self.caught_up = False
        self.finished: Run | None = None
        self.reconnect: Reconnect | None = None
        self.reconnects = 0
        self.last_message = clock()
        self.keepalives = 0
        #: The latest episode with GRPO samples, and the samples shown of it.
        self.answers_episode = 0
        self.answers: list[episode_pb2.GrpoSample] = []
        self._arrivals: deque[tuple[float, int]] = deque()
        # rich renders from its refresh thread while events arrive on the main thread.
        self._lock = threading.Lock()

    def on_event(self, event: WatchEvent) -> None:
        """Folds one event of ``GatewayClient.watch`` into the view."""
        with self._lock:
            self._fold(event)

    def _fold(self, event: WatchEvent) -> None:
        now = self.clock()
        self.last_message = now
        self.reconnect = None
        if isinstance(event, episode_pb2.Episode):
            self.episode = event.episode
            self.reward = event.reward
            self.best_reward = event.best_reward
            self.rewards.append(event.reward)
            self._take_answers(event)
            if self.caught_up:  # replayed history would inflate the rate
                self._arrivals.append((now, event.episode))
                while self._arrivals and now - self._arrivals[0][0] > _RATE_WINDOW_S:
                    self._arrivals.popleft()
            if self.state == Run.State.STATE_PENDING:
                self.state = Run.State.STATE_RUNNING
        elif isinstance(event, gateway_service_pb2.Keepalive):
            self.keepalives += 1
            self.state = event.state
        elif isinstance(event, gateway_service_pb2.CaughtUp):
            self.caught_up = True
        elif isinstance(event, Run):
            self.finished = event
            self.state = event.state
            self.run = event

    def on_answers(self, episode: episode_pb2.Episode) -> None:
        """Shows an episode's samples, if it has any and is not older than those shown (the
        live view reads them from a stream of their own)."""
        with self._lock:
            self._take_answers(episode)

    def _take_answers(self, episode: episode_pb2.Episode) -> None:
        if episode.WhichOneof("detail") != "grpo" or not episode.grpo.samples:
            return
        if episode.episode >= self.answers_episode:
            self.answers_episode = episode.episode
            self.answers = list(episode.grpo.samples[:SHOWN_ANSWERS])

    def on_reconnect(self, reconnect: Reconnect) -> None:
        """Records a dropped stream that ``watch`` is about to resume."""
        with self._lock:
            self.reconnect = reconnect
            self.reconnects += 1

    def rate(self) -> float | None:
        """Live episodes per second over the last few seconds; the run's paced rate before."""
        if len(self._arrivals) >= 2:
            (t0, e0), (t1, e1) = self._arrivals[0], self._arrivals[-1]
            if t1 > t0:
                return (e1 - e0) / (t1 - t0)
        if self.run.episodes_per_second > 0:
            return self.run.episodes_per_second * (self.run.speed or 1.0)
        return None

    def eta(self) -> float | None:
        """Seconds until the last episode at the current rate (None when unknown)."""
        rate = self.rate()
        if rate is None or rate <= 0 or self.state != Run.State.STATE_RUNNING:
            return None
        return (self.max_episodes - self.episode) / rate

    def connection_text(self) -> tuple[str, str]:
        """The connection indicator and its style."""
        resumed = f", resumed {self.reconnects}x" if self.reconnects else ""
        if self.finished is not None:
            return f"stream closed{resumed}", "dim"
        if self.reconnect is not None:
            code = self.reconnect.code.name if self.reconnect.code else "dropped"
            return (
                f"reconnecting (attempt {self.reconnect.attempt}, {code}) "
                f"after episode {self.reconnect.after_episode}",
                "bold yellow",
            )
        idle = self.clock() - self.last_message
        text = "connected" if idle < 2 else f"connected, quiet for {duration_text(idle)}"
        if self.keepalives:
            text += f" ({self.keepalives} keepalives)"
        return text + resumed, "green"

    def render(self) -> RenderableType:
        """The live view as a rich renderable."""
        with self._lock:
            return self._render()

    def _render(self) -> RenderableType:
        from rich.console import Group
        from rich.panel import Panel
        from rich.progress_bar import ProgressBar
        from rich.table import Table
        from rich.text import Text

        name = state_name(self.state)
        grid = Table.grid(padding=(0, 1))
        grid.add_column(justify="right", style="bold")
        grid.add_column()
        bar = Table.grid(padding=(0, 1))
        bar.add_row(
            ProgressBar(total=max(1, self.max_episodes), completed=self.episode, width=40),
            Text(f"{self.episode}/{self.max_episodes}"),
        )
        grid.add_row("progress", bar)
        rate = self.rate()
        eta = self.eta()
        grid.add_row(
            "rate",
            Text(
                (f"{rate:.1f} episodes/s" if rate is not None else "-")
                + (f"   ETA {duration_text(eta)}" if eta is not None else "")
            ),
        )
        grid.add_row("state", Text(name.upper(), style=_STATE_STYLE.get(name, "")))
        if self.reward is not None or self.best_reward is not None:
            reward = f"{self.reward:.4f}" if self.reward is not None else "-"
            best = f"{self.best_reward:.4f}" if self.best_reward is not None else "-"
            grid.add_row("reward", Text(f"{reward}   best {best}"))
        if self.rewards:
            grid.add_row("curve", Text(sparkline(self.rewards, 48), style="cyan"))
        text, style = self.connection_text()
        grid.add_row("link", Text(("● " if style == "green" else "◌ ") + text, style=style))
        parts: list[RenderableType] = [grid]
        if self.answers:
            parts.append(self._answers_table())
        if self.finished is not None and self.finished.error_message:
            parts.append(Text(f"error: {clean(self.finished.error_message)}", style="bold red"))
        title = f"run {self.run.id} · {task_summary(self.run)}"
        if self.run.display_name:
            title += f" · {clean(self.run.display_name)}"
        return Panel(Group(*parts), title=title, title_align="left", expand=False)

    def _answers_table(self) -> RenderableType:
        """The latest answers: answer, expected answer, reward (model and dataset text as plain
        text: control characters escaped, no rich markup)."""
        from rich.table import Table
        from rich.text import Text

        table = Table(
            title=f"latest answers (episode {self.answers_episode})",
            title_justify="left",
            title_style="bold",
            box=None,
            padding=(0, 1),
        )
        table.add_column("answer", overflow="fold")
        table.add_column("expected", overflow="fold")
        table.add_column("reward", justify="right")
        for sample in self.answers:
            table.add_row(
                Text(one_line(sample.completion)),
                Text(one_line(sample.solution) or "-"),
                Text(f"{sample.reward:.2f}", style=_reward_style(sample)),
            )
        return table


def one_line(text: str, limit: int = _ANSWER_CHARS) -> str:
    """``text`` on one line (whitespace runs as one space), escaped (``clean``), at most
    ``limit`` characters (an ellipsis ends a cut one)."""
    flat = clean(" ".join(text.split()))
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def _reward_style(sample: episode_pb2.GrpoSample) -> str:
    """Green for an answer that matched (``exact_match`` 1), red for one that did not."""
    match = sample.rewards.get("exact_match")
    if match is None:
        return ""
    return "green" if match >= 1.0 else "red"

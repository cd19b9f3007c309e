"""Pictures of a run: its learning curve and its avatar's learned motion (PNG, GIF).

This module owns the CLI's drawings. It draws with Pillow only, imported lazily inside the
functions, so ``import trainwire.render`` works in a bare client install (Pillow comes with the
``cli`` extra); a missing Pillow raises ``ImportError`` saying how to install it.

- ``plot_buckets``: a run's curve from ``GetRunCurve`` buckets: the reward's min..max band, its
  rolling mean and the best reward, with axes, ticks, labels and a legend, and a panel per
  requested metric; its cost follows the bucket count, not the run's length.
- ``plot_curve``: the same from a list of episodes (one bucket each).
- ``plot_overlay``: several runs' curves on one chart, one colour each, with a legend of their
  names (``trainwire plot RUN RUN...``).
- ``avatar_strip``: a strip of stick-figure poses sampled across the clip, the learned motion
  drawn over the target clip's poses in another colour.
- ``avatar_gif``: the same two figures, animated.

The learned motion is the ``ImitationDetail`` of the run's last episode that has one
(``last_motion``), frame-major joint angles of the rig.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from trainwire.motion import ClipSpec, RigSpec, forward_kinematics
from trainwire.v1 import gateway_service_pb2

if TYPE_CHECKING:
    from PIL import ImageDraw, ImageFont

    from trainwire.v1 import episode_pb2

_LOGGER = logging.getLogger(__name__)

BACKGROUND = (255, 255, 255)
AXIS = (60, 60, 60)
GRID = (225, 225, 225)
TEXT = (30, 30, 30)
REWARD = (150, 185, 230)
MEAN = (31, 90, 180)
BEST = (220, 70, 40)
TARGET = (70, 110, 200)
LEARNED = (235, 120, 30)
PANEL = (245, 246, 250)
#: The lines of the metric panels, in the order of the metrics asked for (then again).
METRIC_COLOURS = ((46, 139, 87), (148, 87, 190), (200, 120, 20), (0, 150, 160), (110, 110, 110))
#: The runs of an overlay, in the order given (then again): Tableau's ten, told apart in print.
RUN_COLOURS = (
    (31, 119, 180),
    (255, 127, 14),
    (44, 160, 44),
    (214, 39, 40),
    (148, 103, 189),
    (140, 86, 75),
    (227, 119, 194),
    (127, 127, 127),
    (188, 189, 34),
    (23, 190, 207),
)
_BAND_ALPHA = 56  # of 255: a run's band under another's stays visible

#: A curve's image size without metric panels (width, height).
CURVE_SIZE = (900, 500)
#: The height each metric panel adds to a curve, its tick labels included.
METRIC_PANEL_HEIGHT = 150
_LEFT, _RIGHT, _BOTTOM = 70, 20, 56  # a curve's margins around its plot areas
_METRIC_GAP = 30  # above a metric panel: the tick labels of the panel above

_INSTALL_HINT = "drawing pictures needs Pillow: pip install 'trainwire[cli]'"


class EpisodeLike(Protocol):
    """What ``plot_curve`` reads from an episode (an ``Episode`` message fits)."""

    @property
    def episode(self) -> int: ...

    @property
    def reward(self) -> float: ...

    @property
    def best_reward(self) -> float: ...


def _pil() -> Any:
    try:
        from PIL import Image, ImageDraw, ImageFont
    except ImportError as exc:
        raise ImportError(_INSTALL_HINT) from exc
    return Image, ImageDraw, ImageFont


def _font(image_font: Any, size: int) -> ImageFont.ImageFont | ImageFont.FreeTypeFont:
    try:
        return image_font.load_default(size=size)
    except (TypeError, OSError):  # Pillow without FreeType: the fixed bitmap font
        return image_font.load_default()


def _nice_ticks(low: float, high: float, count: int = 5) -> list[float]:
    """Round tick values (1, 2 or 5 x 10^k apart) covering ``low..high``."""
    if high <= low:
        return [low]
    raw = (high - low) / max(1, count)
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    start = math.ceil(low / step - 1e-9) * step
    ticks = []
    value = start
    while value <= high + step * 1e-9:
        ticks.append(round(value, 10))
        value += step
    return ticks


def _format_tick(value: float) -> str:
    """``250``, ``0.25``, ``40k``, ``2.5M``: short enough for eight ticks across a long run."""
    if value == int(value):
        if abs(value) >= 1e6 and value % 1e4 == 0:
            return f"{value / 1e6:g}M"
        if abs(value) >= 1e4 and value % 100 == 0:
            return f"{value / 1e3:g}k"
        if abs(value) < 1e6:
            return str(int(value))
    return f"{value:.3g}"


def rolling_mean(values: Sequence[float], window: int) -> list[float]:
    """Mean of each value and up to ``window - 1`` values before it."""
    out: list[float] = []
    total = 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def default_window(episodes: int) -> int:
    """Episodes in the rolling mean of a run of ``episodes``: a twentieth of it, 3..50."""
    return min(50, max(3, episodes // 20))


def curve_buckets(width: int = CURVE_SIZE[0]) -> int:
    """How many ``GetRunCurve`` buckets a curve ``width`` pixels wide draws: one per pixel
    column of its plot area (more would share columns; fewer would leave steps)."""
    return max(1, width - _LEFT - _RIGHT)


def episode_buckets(
    episodes: Iterable[EpisodeLike],
) -> list[gateway_service_pb2.CurveBucket]:
    """One ``CurveBucket`` per episode, its metrics as the means: a replayed history as the
    curve ``GetRunCurve`` sends."""
    return [
        gateway_service_pb2.CurveBucket(
            first_episode=e.episode,
            last_episode=e.episode,
            reward_min=e.reward,
            reward_max=e.reward,
            reward_mean=e.reward,
            best_reward=e.best_reward,
            # An Episode's metrics; an episode-alike without them has none.
            metrics_mean=getattr(e, "metrics", None) or {},
        )
        for e in episodes
    ]


def bucket_means(buckets: Sequence[gateway_service_pb2.CurveBucket], window: int) -> list[float]:
    """Rolling mean of the reward at each bucket over whole buckets of at most ``window``
    episodes (always the bucket itself), each bucket weighted by its episode count.

    Over one-episode buckets this is ``rolling_mean`` of the rewards; where a bucket holds more
    than ``window`` episodes it is that bucket's mean.
    """
    out: list[float] = []
    total = 0.0
    count = 0
    start = 0
    for i, bucket in enumerate(buckets):
        total += bucket.reward_mean * _size(bucket)
        count += _size(bucket)
        while start < i and bucket.last_episode - buckets[start].first_episode + 1 > window:
            total -= buckets[start].reward_mean * _size(buckets[start])
            count -= _size(buckets[start])
            start += 1
        out.append(total / count)
    return out


def _size(bucket: gateway_service_pb2.CurveBucket) -> int:
    return bucket.last_episode - bucket.first_episode + 1


class _Panel:
    """One plot area of a figure: its data ranges mapped to pixels, grid, ticks and frame."""

    def __init__(
        self,
        draw: ImageDraw.ImageDraw,
        box: tuple[int, int, int, int],
        x_range: tuple[float, float],
        y_values: Sequence[float],
    ) -> None:
        self.draw = draw
        self.left, self.top, self.width, self.height = box
        self.x_low, self.x_high = x_range
        if self.x_high == self.x_low:
            self.x_low, self.x_high = self.x_low - 1, self.x_high + 1
        low, high = (min(y_values), max(y_values)) if y_values else (0.0, 1.0)
        pad = (high - low) * 0.05 or max(abs(high) * 0.1, 0.1)
        self.y_low, self.y_high = low - pad, high + pad

    def to_px(self, x: float, y: float) -> tuple[float, float]:
        return (
            self.left + (x - self.x_low) / (self.x_high - self.x_low) * self.width,
            self.top + (1 - (y - self.y_low) / (self.y_high - self.y_low)) * self.height,
        )

    def frame(self, font: Any, y_ticks: int = 5) -> None:
        """Grid lines with their tick labels on both axes, and the frame."""
        draw, left, top = self.draw, self.left, self.top
        for tick in _nice_ticks(self.y_low, self.y_high, y_ticks):
            _, py = self.to_px(self.x_low, tick)
            draw.line([(left, py), (left + self.width, py)], fill=GRID)
            label = _format_tick(tick)
            tw = draw.textlength(label, font=font)
            draw.text((left - 8 - tw, py - 7), label, fill=TEXT, font=font)
        for tick in _nice_ticks(self.x_low, self.x_high, 8):
            px, _ = self.to_px(tick, self.y_low)
            draw.line([(px, top), (px, top + self.height)], fill=GRID)
            label = _format_tick(tick)
            tw = draw.textlength(label, font=font)
            draw.text((px - tw / 2, top + self.height + 6), label, fill=TEXT, font=font)
        draw.rectangle([left, top, left + self.width, top + self.height], outline=AXIS, width=1)

    def line(
        self,
        xs: Sequence[float],
        ys: Sequence[float],
        colour: tuple[int, int, int],
        width: int,
    ) -> None:
        coords = [self.to_px(x, y) for x, y in zip(xs, ys, strict=True)]
        if len(coords) == 1:
            cx, cy = coords[0]
            self.draw.ellipse([cx - 3, cy - 3, cx + 3, cy + 3], fill=colour)
        elif coords:
            self.draw.line(coords, fill=colour, width=width, joint="curve")

    def band(
        self,
        xs: Sequence[float],
        lows: Sequence[float],
        highs: Sequence[float],
        colour: tuple[int, int, int],
    ) -> None:
        """The area between ``lows`` and ``highs``; its edges drawn too, so a band of no
        height (one-episode buckets) is still the line of its values."""
        upper = [self.to_px(x, y) for x, y in zip(xs, highs, strict=True)]
        lower = [self.to_px(x, y) for x, y in zip(xs, lows, strict=True)]
        if len(upper) == 1:
            (cx, top), (_, bottom) = upper[0], lower[0]
            self.draw.line([(cx, top), (cx, bottom)], fill=colour, width=3)
            self.draw.ellipse([cx - 3, top - 3, cx + 3, top + 3], fill=colour)
            return
        self.draw.polygon(upper + lower[::-1], fill=colour)
        self.draw.line(upper, fill=colour, width=1)
        self.draw.line(lower, fill=colour, width=1)


def _legend(
    draw: ImageDraw.ImageDraw,
    panel: _Panel,
    entries: Sequence[tuple[str, tuple[int, int, int]]],
    font: Any,
) -> None:
    """The entries' colours and names in a box in the panel's lower right corner, wide enough
    for the longest name."""
    right, bottom = panel.left + panel.width, panel.top + panel.height
    widest = max(draw.textlength(name, font=font) for name, _ in entries)
    lx, ly = right - max(160, round(widest) + 50), bottom - 22 * len(entries) - 10
    draw.rectangle([lx - 8, ly - 6, right - 8, bottom - 8], fill=BACKGROUND, outline=GRID)
    for i, (name, colour) in enumerate(entries):
        y = ly + 22 * i + 7
        draw.line([(lx, y), (lx + 26, y)], fill=colour, width=3)
        draw.text((lx + 34, y - 8), name, fill=TEXT, font=font)


class _Figure:
    """A curve's image: the reward's plot area, one panel per metric under it, the axis labels
    and the title; ``plot_buckets`` and ``plot_overlay`` draw into it."""

    def __init__(self, size: tuple[int, int], metrics: int, title: str) -> None:
        self.image_mod, self.draw_mod, font_mod = _pil()
        self.width, self.height = size[0], size[1] + METRIC_PANEL_HEIGHT * metrics
        self.image = self.image_mod.new("RGB", (self.width, self.height), BACKGROUND)
        self.draw = self.draw_mod.Draw(self.image)
        self.font = _font(font_mod, 14)
        self.small = _font(font_mod, 12)
        self.title = title
        self.top = 44 if title else 20
        self.plot_w, self.plot_h = self.width - _LEFT - _RIGHT, size[1] - self.top - _BOTTOM

    def reward_panel(self, x_range: tuple[float, float], y_values: Sequence[float]) -> _Panel:
        """The reward's plot area, framed, with its rotated axis label."""
        panel = _Panel(self.draw, (_LEFT, self.top, self.plot_w, self.plot_h), x_range, y_values)
        panel.frame(self.small)
        y_label = self.image_mod.new("RGB", (80, 20), BACKGROUND)
        self.draw_mod.Draw(y_label).text((12, 2), "reward", fill=TEXT, font=self.font)
        self.image.paste(y_label.rotate(90, expand=True), (4, self.top + self.plot_h // 2 - 40))
        return panel

    def metric_panel(
        self,
        index: int,
        name: str,
        x_range: tuple[float, float],
        series: Sequence[tuple[Sequence[float], Sequence[float | None], tuple[int, int, int]]],
        note_colour: tuple[int, int, int] | None,
    ) -> None:
        """The ``index``-th metric panel: each series (its x values, its values, None where a
        bucket lacks the metric, and its colour) as a line with gaps, and a note naming the
        metric (in ``note_colour``; ``TEXT`` when None or when no series has a value)."""
        known = [v for _, values, _ in series for v in values if v is not None]
        top = self.top + self.plot_h + index * METRIC_PANEL_HEIGHT
        box = (_LEFT, top + _METRIC_GAP, self.plot_w, METRIC_PANEL_HEIGHT - _METRIC_GAP)
        panel = _Panel(self.draw, box, x_range, known)
        panel.frame(self.small, 3)
        for xs, values, colour in series:
            stretches: list[tuple[list[float], list[float]]] = [([], [])]
            for x, value in zip(xs, values, strict=True):
                if value is None:
                    if stretches[-1][0]:
                        stretches.append(([], []))
                else:
                    stretches[-1][0].append(x)
                    stretches[-1][1].append(value)
            for line_xs, line_ys in stretches:
                panel.line(line_xs, line_ys, colour, 2)
        if known:
            note = f"{name} (mean)"
        else:
            note = f"{name}: no episode has it" if len(series) == 1 else f"{name}: no run has it"
        at = (panel.left + 8, panel.top + 4)
        self.draw.rectangle(self.draw.textbbox(at, note, font=self.small), fill=BACKGROUND)
        colour = note_colour if known and note_colour is not None else TEXT
        self.draw.text(at, note, fill=colour, font=self.small)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Writes the axis label and the title, then the PNG."""
        draw, font = self.draw, self.font
        axis_label = "episode"
        tw = draw.textlength(axis_label, font=font)
        draw.text(
            (_LEFT + self.plot_w / 2 - tw / 2, self.height - 24), axis_label, fill=TEXT, font=font
        )
        if self.title:
            tw = draw.textlength(self.title, font=font)
            draw.text((self.width / 2 - tw / 2, 14), self.title, fill=TEXT, font=font)
        self.image.save(path, format="PNG")


def _centres(buckets: Sequence[gateway_service_pb2.CurveBucket]) -> list[float]:
    return [(b.first_episode + b.last_episode) / 2 for b in buckets]


def _metric_values(
    buckets: Sequence[gateway_service_pb2.CurveBucket], name: str
) -> list[float | None]:
    return [b.metrics_mean.get(name) for b in buckets]


def _window(window: int | None, episodes: int) -> int:
    if window is None:
        window = default_window(episodes)
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    return window


def plot_buckets(
    buckets: Sequence[gateway_service_pb2.CurveBucket],
    path: str | os.PathLike[str],
    *,
    title: str = "",
    window: int | None = None,
    metrics: Sequence[str] = (),
    size: tuple[int, int] = CURVE_SIZE,
) -> None:
    """Draws a run's curve from ``GetRunCurve`` buckets to a PNG: the reward's min..max band,
    the rolling mean of the reward and the best reward; below it one panel per metric, the
    metric's mean per bucket.

    Drawing time depends on the number of buckets, never on the run's length: ask for
    ``curve_buckets(size[0])`` of them and a ten-million-episode run draws like a short one.

    Args:
        buckets: Contiguous buckets in order (``GetRunCurveResponse.buckets``).
        path: Where to write the PNG.
        title: A title above the plot.
        window: Episodes in the rolling mean, over whole buckets (a bucket holding more is its
            own mean); ``default_window`` of the run's length when ``None``.
        metrics: Metrics to draw (names in the buckets' ``metrics_mean``), one panel each; a
            bucket without a metric leaves a gap in its line.
        size: Image width, and height without the metric panels (each adds
            ``METRIC_PANEL_HEIGHT`` pixels).

    Raises:
        ValueError: no buckets, or a window below 1.
        ImportError: Pillow is missing.
    """
    if not buckets:
        raise ValueError("no episodes to plot")
    first, last = buckets[0].first_episode, buckets[-1].last_episode
    window = _window(window, last - first + 1)
    figure = _Figure(size, len(metrics), title)
    x_range = (float(first), float(last))

    centres = _centres(buckets)
    lows = [b.reward_min for b in buckets]
    highs = [b.reward_max for b in buckets]
    ends = [float(b.last_episode) for b in buckets]
    best = [b.best_reward for b in buckets]
    mean = bucket_means(buckets, window)
    rewards = figure.reward_panel(x_range, [*lows, *highs, *best])
    rewards.band(centres, lows, highs, REWARD)
    rewards.line(centres, mean, MEAN, 3)
    rewards.line(ends, best, BEST, 2)
    widest = max(_size(b) for b in buckets)
    if widest > window:
        mean_label = f"mean of ~{round((last - first + 1) / len(buckets))}"
    else:
        mean_label = f"mean of {window}"
    _legend(
        figure.draw,
        rewards,
        [
            ("reward min..max" if widest > 1 else "reward", REWARD),
            (mean_label, MEAN),
            ("best reward", BEST),
        ],
        figure.small,
    )
    for i, name in enumerate(metrics):
        colour = METRIC_COLOURS[i % len(METRIC_COLOURS)]
        series = [(centres, _metric_values(buckets, name), colour)]
        figure.metric_panel(i, name, x_range, series, colour)
    figure.save(path)
    _LOGGER.debug(
        "wrote the curve of episodes %d..%d in %d buckets to %s", first, last, len(buckets), path
    )


def run_colour(index: int) -> tuple[int, int, int]:
    """The colour of the ``index``-th run of an overlay (``RUN_COLOURS``, then again)."""
    return RUN_COLOURS[index % len(RUN_COLOURS)]


def plot_overlay(
    curves: Sequence[tuple[str, Sequence[gateway_service_pb2.CurveBucket]]],
    path: str | os.PathLike[str],
    *,
    title: str = "",
    window: int | None = None,
    metrics: Sequence[str] = (),
    size: tuple[int, int] = CURVE_SIZE,
) -> None:
    """Draws several runs' curves on one chart to a PNG, one colour each (``run_colour``): each
    run's reward as a translucent min..max band under its rolling mean, a legend of their
    names, and one panel per metric with a line per run. Episodes share the x axis, so a fork
    (numbered from its fork point + 1) lines up with its parent.

    Args:
        curves: ``(name, buckets)`` per run, in legend order; a run without buckets is left
            out of the chart but keeps its colour and its legend entry.
        path: Where to write the PNG.
        title: A title above the plot.
        window: Episodes in each rolling mean; ``default_window`` of the longest run's span
            when ``None``.
        metrics: Metrics to draw, one panel each.
        size: Image width, and height without the metric panels.

    Raises:
        ValueError: no run has a bucket, or a window below 1.
        ImportError: Pillow is missing.
    """
    drawn = [buckets for _, buckets in curves if buckets]
    if not drawn:
        raise ValueError("no episodes to plot")
    first = min(b[0].first_episode for b in drawn)
    last = max(b[-1].last_episode for b in drawn)
    window = _window(window, max(b[-1].last_episode - b[0].first_episode + 1 for b in drawn))
    figure = _Figure(size, len(metrics), title)
    x_range = (float(first), float(last))
    lows = [v for b in drawn for v in (x.reward_min for x in b)]
    highs = [v for b in drawn for v in (x.reward_max for x in b)]
    rewards = figure.reward_panel(x_range, [*lows, *highs])
    # Translucent bands first, so every run's mean line stays on top of every band.
    blend = figure.draw_mod.Draw(figure.image, "RGBA")
    for i, (_, buckets) in enumerate(curves):
        if buckets and max(_size(b) for b in buckets) > 1:
            points = list(zip(_centres(buckets), buckets, strict=True))
            upper = [rewards.to_px(x, b.reward_max) for x, b in points]
            lower = [rewards.to_px(x, b.reward_min) for x, b in points]
            if len(upper) > 1:
                blend.polygon(upper + lower[::-1], fill=(*run_colour(i), _BAND_ALPHA))
    for i, (_, buckets) in enumerate(curves):
        if buckets:
            rewards.line(_centres(buckets), bucket_means(buckets, window), run_colour(i), 3)
    _legend(
        figure.draw,
        rewards,
        [(name, run_colour(i)) for i, (name, _) in enumerate(curves)],
        figure.small,
    )
    for m, name in enumerate(metrics):
        series = [
            (_centres(buckets), _metric_values(buckets, name), run_colour(i))
            for i, (_, buckets) in enumerate(curves)
            if buckets
        ]
        figure.metric_panel(m, name, x_range, series, None)
    figure.save(path)
    _LOGGER.debug("wrote the curves of %d runs to %s", len(curves), path)


def plot_curve(
    episodes: Iterable[EpisodeLike],
    path: str | os.PathLike[str],
    *,
    title: str = "",
    window: int | None = None,
    size: tuple[int, int] = CURVE_SIZE,
) -> None:
    """Draws a learning curve of episodes to a PNG: reward, its rolling mean and the best
    reward (``plot_buckets`` of one bucket per episode).

    Args:
        episodes: The run's episodes, in order (``Episode`` messages or alike).
        path: Where to write the PNG.
        title: A title above the plot.
        window: Episodes in the rolling mean; a twentieth of the run (3..50) when ``None``.
        size: Image width and height in pixels.

    Raises:
        ValueError: no episodes.
        ImportError: Pillow is missing.
    """
    plot_buckets(episode_buckets(episodes), path, title=title, window=window, size=size)


# -- avatar ------------------------------------------------------------------------------------


def last_motion(
    episodes: Iterable[episode_pb2.Episode],
) -> episode_pb2.ImitationDetail | None:
    """The ``ImitationDetail`` of the last episode that carries one, or None."""
    found = None
    for episode in episodes:
        if episode.WhichOneof("detail") == "imitation":
            found = episode.imitation
    return found


def _frames(angles: Sequence[float], joints: int) -> list[Sequence[float]]:
    if joints <= 0 or not angles or len(angles) % joints:
        raise ValueError(f"{len(angles)} angles do not split into frames of {joints} joints")
    return [angles[i : i + joints] for i in range(0, len(angles), joints)]


Segment = tuple[float, float, float, float]


def _bounds(poses: Iterable[list[Segment]]) -> tuple[float, float, float, float]:
    xs: list[float] = []
    ys: list[float] = []
    for pose in poses:
        for x0, y0, x1, y1 in pose:
            xs += (x0, x1)
            ys += (y0, y1)
    return min(xs), min(ys), max(xs), max(ys)


def _draw_figure(
    draw: ImageDraw.ImageDraw,
    rig: RigSpec,
    pose: list[Segment],
    to_px: Any,
    colour: tuple[int, int, int],
    line: int,
) -> None:
    """One stick figure: bones as thick lines, joints as dots, a circle for a ``head`` bone."""
    for bone, (x0, y0, x1, y1) in zip(rig.bones, pose, strict=True):
        a, b = to_px(x0, y0), to_px(x1, y1)
        draw.line([a, b], fill=colour, width=line)
        if bone.name == "head":
            r = max(3.0, math.dist(a, b) * 0.45)
            draw.ellipse([b[0] - r, b[1] - r, b[0] + r, b[1] + r], outline=colour, width=line)
    r = line * 0.8
    for x0, y0, x1, y1 in pose:
        for px, py in (to_px(x0, y0), to_px(x1, y1)):
            draw.ellipse([px - r, py - r, px + r, py + r], fill=colour)


def _pose_pairs(
    rig: RigSpec, clip: ClipSpec, learned_angles: Sequence[float], count: int
) -> list[tuple[int, list[Segment], list[Segment]]]:
    """``count`` (clip frame, target pose, learned pose) triples evenly spread over the clip; a
    learned motion with another frame count is sampled at the same relative time."""
    joints = rig.bone_count
    if clip.joint_count != joints:
        raise ValueError(f"clip {clip.name} has {clip.joint_count} joints; rig has {joints}")
    learned = _frames(learned_angles, joints)
    count = max(1, min(count, clip.frame_count))
    out = []
    for i in range(count):
        frame = i * clip.frame_count // count
        learned_frame = min(len(learned) - 1, frame * len(learned) // clip.frame_count)
        out.append(
            (
                frame,
                forward_kinematics(rig, clip.frame(frame)),
                forward_kinematics(rig, learned[learned_frame]),
            )
        )
    return out


def _scaler(
    bounds: tuple[float, float, float, float], box: int, margin: int
) -> tuple[float, float, float]:
    """Uniform scale and the offsets that centre ``bounds`` in a square box (y up)."""
    x0, y0, x1, y1 = bounds
    span = max(x1 - x0, y1 - y0, 1e-6)
    scale = (box - 2 * margin) / span
    return (
        scale,
        (box - (x1 - x0) * scale) / 2 - x0 * scale,
        (box + (y1 - y0) * scale) / 2 + y0 * scale,
    )


def avatar_strip(
    rig: RigSpec,
    clip: ClipSpec,
    learned_angles: Sequence[float],
    path: str | os.PathLike[str],
    *,
    poses: int = 8,
    panel: int = 180,
    title: str = "",
) -> None:
    """Draws the learned motion over the target clip as a strip of poses, to a PNG.

    Args:
        rig: The avatar's rig.
        clip: The target clip (its joint count equals the rig's bone count).
        learned_angles: The learned motion, frame-major (``ImitationDetail.angles``).
        path: Where to write the PNG.
        poses: Poses in the strip, evenly spread over the clip.
        panel: Width and height of each pose's panel in pixels.
        title: A title above the strip (the clip's name by default).

    Raises:
        ValueError: the angles do not fit the rig or the clip.
        ImportError: Pillow is missing.
    """
    image_mod, draw_mod, font_mod = _pil()
    pairs = _pose_pairs(rig, clip, learned_angles, poses)
    font = _font(font_mod, 14)
    small = _font(font_mod, 12)
    header, footer, gap = 34, 22, 6
    width = len(pairs) * (panel + gap) + gap
    height = header + panel + footer
    image = image_mod.new("RGB", (width, height), BACKGROUND)
    draw = draw_mod.Draw(image)
    # One scale for every panel, so a pose's size is comparable across the strip.
    bounds = _bounds(pose for _, target, learned in pairs for pose in (target, learned))
    scale, dx, dy = _scaler(bounds, panel, 14)
    for i, (frame, target, learned) in enumerate(pairs):
        ox, oy = gap + i * (panel + gap), header

        def to_px(x: float, y: float, ox: int = ox, oy: int = oy) -> tuple[float, float]:
            return ox + dx + x * scale, oy + dy - y * scale

        draw.rectangle([ox, oy, ox + panel, oy + panel], fill=PANEL)
        _draw_figure(draw, rig, target, to_px, TARGET, 5)
        _draw_figure(draw, rig, learned, to_px, LEARNED, 3)
        label = f"{frame / clip.fps:.2f} s"
        tw = draw.textlength(label, font=small)
        draw.text((ox + panel / 2 - tw / 2, oy + panel + 4), label, fill=TEXT, font=small)
    heading = title or f"{rig.name} - clip {clip.name}"
    draw.text((gap, 9), heading, fill=TEXT, font=font)
    x = width - 230
    for name, colour in (("target", TARGET), ("learned", LEARNED)):
        draw.line([(x, 17), (x + 24, 17)], fill=colour, width=4)
        draw.text((x + 30, 9), name, fill=TEXT, font=font)
        x += 110
    image.save(path, format="PNG")
    _LOGGER.debug("wrote avatar strip of %d poses to %s", len(pairs), path)


def avatar_gif(
    rig: RigSpec,
    clip: ClipSpec,
    learned_angles: Sequence[float],
    path: str | os.PathLike[str],
    *,
    size: int = 320,
    max_frames: int = 120,
) -> int:
    """Animates the learned motion over the target clip, to a looping GIF at the clip's speed.

    Args:
        rig: The avatar's rig.
        clip: The target clip.
        learned_angles: The learned motion, frame-major.
        path: Where to write the GIF.
        size: Width and height in pixels.
        max_frames: At most this many frames (long clips are subsampled).

    Returns:
        The number of frames written.

    Raises:
        ValueError: the angles do not fit the rig or the clip.
        ImportError: Pillow is missing.
    """
    image_mod, draw_mod, font_mod = _pil()
    pairs = _pose_pairs(rig, clip, learned_angles, min(max_frames, clip.frame_count))
    bounds = _bounds(pose for _, target, learned in pairs for pose in (target, learned))
    scale, dx, dy = _scaler(bounds, size, 20)
    small = _font(font_mod, 12)

    def to_px(x: float, y: float) -> tuple[float, float]:
        return dx + x * scale, dy - y * scale

    frames = []
    for frame, target, learned in pairs:
        image = image_mod.new("RGB", (size, size), PANEL)
        draw = draw_mod.Draw(image)
        _draw_figure(draw, rig, target, to_px, TARGET, 5)
        _draw_figure(draw, rig, learned, to_px, LEARNED, 3)
        draw.text((6, 4), f"{clip.name}  {frame / clip.fps:.2f} s", fill=TEXT, font=small)
        frames.append(image)
    step_s = clip.frame_count / len(pairs) / clip.fps
    frames[0].save(
        path,
        format="GIF",
        save_all=True,
        append_images=frames[1:],
        duration=max(20, round(step_s * 1000)),
        loop=0,
    )
    _LOGGER.debug("wrote avatar animation of %d frames to %s", len(frames), path)
    return len(frames)


__all__ = [
    "CURVE_SIZE",
    "METRIC_PANEL_HEIGHT",
    "RUN_COLOURS",
    "avatar_gif",
    "avatar_strip",
    "bucket_means",
    "curve_buckets",
    "default_window",
    "episode_buckets",
    "last_motion",
    "plot_buckets",
    "plot_curve",
    "plot_overlay",
    "rolling_mean",
    "run_colour",
]

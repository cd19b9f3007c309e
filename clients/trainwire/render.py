"""Pictures of a run: its learning curve and its avatar's learned motion (PNG, GIF).

This module owns the CLI's drawings. It draws with Pillow only, imported lazily inside the
functions, so ``import trainwire.render`` works in a bare client install (Pillow comes with the
``cli`` extra); a missing Pillow raises ``ImportError`` saying how to install it.

- ``plot_curve``: reward, best reward and a rolling mean of reward per episode, with axes, ticks,
  labels and a legend.
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
    if value == int(value) and abs(value) < 1e6:
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


def plot_curve(
    episodes: Iterable[EpisodeLike],
    path: str | os.PathLike[str],
    *,
    title: str = "",
    window: int | None = None,
    size: tuple[int, int] = (900, 500),
) -> None:
    """Draws a learning curve to a PNG: reward, its rolling mean and the best reward.

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
    points = [(e.episode, e.reward, e.best_reward) for e in episodes]
    if not points:
        raise ValueError("no episodes to plot")
    image_mod, draw_mod, font_mod = _pil()
    width, height = size
    image = image_mod.new("RGB", size, BACKGROUND)
    draw = draw_mod.Draw(image)
    font = _font(font_mod, 14)
    small = _font(font_mod, 12)
    left, right, top, bottom = 70, 20, 44 if title else 20, 56
    plot_w, plot_h = width - left - right, height - top - bottom

    xs = [p[0] for p in points]
    rewards = [p[1] for p in points]
    best = [p[2] for p in points]
    if window is None:  # a twentieth of the run, but enough to smooth a short one
        window = min(50, max(3, len(points) // 20))
    mean = rolling_mean(rewards, window)
    x_low, x_high = min(xs), max(xs)
    if x_high == x_low:
        x_low, x_high = x_low - 1, x_high + 1
    y_low, y_high = min(*rewards, *best), max(*rewards, *best)
    pad = (y_high - y_low) * 0.05 or max(abs(y_high) * 0.1, 0.1)
    y_low, y_high = y_low - pad, y_high + pad

    def to_px(x: float, y: float) -> tuple[float, float]:
        return (
            left + (x - x_low) / (x_high - x_low) * plot_w,
            top + (1 - (y - y_low) / (y_high - y_low)) * plot_h,
        )

    for tick in _nice_ticks(y_low, y_high):
        _, py = to_px(x_low, tick)
        draw.line([(left, py), (left + plot_w, py)], fill=GRID)
        label = _format_tick(tick)
        tw = draw.textlength(label, font=small)
        draw.text((left - 8 - tw, py - 7), label, fill=TEXT, font=small)
    for tick in _nice_ticks(x_low, x_high, 8):
        px, _ = to_px(tick, y_low)
        draw.line([(px, top), (px, top + plot_h)], fill=GRID)
        label = _format_tick(tick)
        tw = draw.textlength(label, font=small)
        draw.text((px - tw / 2, top + plot_h + 6), label, fill=TEXT, font=small)
    draw.rectangle([left, top, left + plot_w, top + plot_h], outline=AXIS, width=1)

    def polyline(values: Sequence[float], colour: tuple[int, int, int], line: int) -> None:
        coords = [to_px(x, y) for x, y in zip(xs, values, strict=True)]
        if len(coords) == 1:
            cx, cy = coords[0]
            draw.ellipse([cx - 3, cy - 3, cx + 3, cy + 3], fill=colour)
        else:
            draw.line(coords, fill=colour, width=line, joint="curve")

    polyline(rewards, REWARD, 1)
    polyline(mean, MEAN, 3)
    polyline(best, BEST, 2)

    axis_label = "episode"
    tw = draw.textlength(axis_label, font=font)
    draw.text((left + plot_w / 2 - tw / 2, height - 24), axis_label, fill=TEXT, font=font)
    y_label = image_mod.new("RGB", (80, 20), BACKGROUND)
    draw_mod.Draw(y_label).text((12, 2), "reward", fill=TEXT, font=font)
    image.paste(y_label.rotate(90, expand=True), (4, top + plot_h // 2 - 40))
    if title:
        tw = draw.textlength(title, font=font)
        draw.text((width / 2 - tw / 2, 14), title, fill=TEXT, font=font)

    legend = [
        ("reward", REWARD),
        (f"mean of {window}", MEAN),
        ("best reward", BEST),
    ]
    lx, ly = left + plot_w - 160, top + plot_h - 22 * len(legend) - 10
    draw.rectangle(
        [lx - 8, ly - 6, left + plot_w - 8, top + plot_h - 8], fill=BACKGROUND, outline=GRID
    )
    for i, (name, colour) in enumerate(legend):
        y = ly + 22 * i + 7
        draw.line([(lx, y), (lx + 26, y)], fill=colour, width=3)
        draw.text((lx + 34, y - 8), name, fill=TEXT, font=small)
    image.save(path, format="PNG")
    _LOGGER.debug("wrote learning curve of %d episodes to %s", len(points), path)


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
    "avatar_gif",
    "avatar_strip",
    "last_motion",
    "plot_curve",
    "rolling_mean",
]

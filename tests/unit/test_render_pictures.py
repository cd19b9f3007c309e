"""trainwire.render: the learning curve and avatar pictures have the right size and real content
(the plotted lines' colours, both figures' colours), and bad input is refused."""

from __future__ import annotations

import math
import pathlib
import sys
from typing import cast

import pytest
from PIL import Image

from tests.fakes.fake_trainer import scripted_episodes
from trainwire import client as tc
from trainwire import motion, render
from trainwire.v1 import episode_pb2


def _colours(image: Image.Image) -> list[tuple[int, tuple[int, int, int]]]:
    return cast("list[tuple[int, tuple[int, int, int]]]", image.convert("RGB").getcolors(1 << 16))


def _colour_count(image: Image.Image, colour: tuple[int, int, int]) -> int:
    return sum(n for n, c in _colours(image) if c == colour)


def _near_count(image: Image.Image, colour: tuple[int, int, int], tolerance: int = 40) -> int:
    return sum(
        n
        for n, c in _colours(image)
        if all(abs(a - b) <= tolerance for a, b in zip(c, colour, strict=True))
    )


@pytest.fixture(scope="module")
def imitation_episodes() -> list[episode_pb2.Episode]:
    return scripted_episodes(tc.imitation_task(clip="wave"), tc.train_config(120))


def test_plot_curve_draws_every_series_on_axes(
    tmp_path: pathlib.Path, imitation_episodes: list[episode_pb2.Episode]
) -> None:
    out = tmp_path / "curve.png"
    render.plot_curve(imitation_episodes, out, title="run r-1", size=(700, 400))
    image = Image.open(out)
    assert image.format == "PNG"
    assert image.size == (700, 400)
    for colour in (render.MEAN, render.BEST, render.AXIS):
        assert _colour_count(image, colour) > 100, colour
    assert _colour_count(image, render.REWARD) > 20
    assert len(_colours(image)) > 20  # text, lines, antialiasing


def test_the_best_reward_line_sits_above_the_mean(tmp_path: pathlib.Path) -> None:
    # Rewards alternate 0 and 1: best is 1 from episode 2 on, the mean hovers around 0.5.
    episodes = [
        episode_pb2.Episode(episode=n, reward=float(n % 2 == 0), best_reward=float(n >= 2))
        for n in range(1, 101)
    ]
    out = tmp_path / "curve.png"
    render.plot_curve(episodes, out, window=10, size=(600, 400))
    rgb = Image.open(out).convert("RGB")
    column = 400  # mid-plot, away from the legend's box in the lower right
    best_rows = [y for y in range(400) if rgb.getpixel((column, y)) == render.BEST]
    mean_rows = [y for y in range(400) if rgb.getpixel((column, y)) == render.MEAN]
    assert best_rows and mean_rows
    assert max(best_rows) < min(mean_rows)  # image rows grow downwards


def test_plot_curve_handles_a_single_episode(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "one.png"
    render.plot_curve([episode_pb2.Episode(episode=1, reward=0.5, best_reward=0.5)], out)
    assert Image.open(out).size == (900, 500)
    with pytest.raises(ValueError, match="no episodes"):
        render.plot_curve([], tmp_path / "none.png")


def test_rolling_mean() -> None:
    assert render.rolling_mean([1, 2, 3, 4, 5], 2) == [1, 1.5, 2.5, 3.5, 4.5]
    assert render.rolling_mean([2.0], 10) == [2.0]
    values = [math.sin(i) for i in range(50)]
    assert render.rolling_mean(values, 1) == pytest.approx(values)


def test_last_motion_is_the_latest_detail(imitation_episodes: list[episode_pb2.Episode]) -> None:
    detail = render.last_motion(imitation_episodes)
    assert detail == imitation_episodes[-1].imitation
    assert render.last_motion(imitation_episodes[:9]) is None
    assert render.last_motion(imitation_episodes[:15]) == imitation_episodes[9].imitation


def test_avatar_strip_draws_both_figures_in_every_panel(
    tmp_path: pathlib.Path, imitation_episodes: list[episode_pb2.Episode]
) -> None:
    detail = render.last_motion(imitation_episodes)
    assert detail is not None
    out = tmp_path / "avatar.png"
    render.avatar_strip(
        motion.STICKMAN, motion.builtin_clip("wave"), detail.angles, out, poses=6, panel=150
    )
    image = Image.open(out).convert("RGB")
    assert image.size == (6 * 156 + 6, 34 + 150 + 22)
    for i in range(6):
        panel = image.crop((6 + i * 156, 34, 6 + i * 156 + 150, 184))
        assert _colour_count(panel, render.TARGET) > 150, f"target missing in panel {i}"
        assert _colour_count(panel, render.LEARNED) > 100, f"learned missing in panel {i}"


def test_avatar_strip_of_a_perfect_motion_covers_the_target(tmp_path: pathlib.Path) -> None:
    clip = motion.builtin_clip("walk")
    wrong = [a + 0.6 for a in clip.angles]
    perfect_out, wrong_out = tmp_path / "perfect.png", tmp_path / "wrong.png"
    render.avatar_strip(motion.STICKMAN, clip, clip.angles, perfect_out, poses=4)
    render.avatar_strip(motion.STICKMAN, clip, wrong, wrong_out, poses=4)
    # The learned figure is drawn thinner on top: when it matches, less of the target shows.
    perfect = _colour_count(Image.open(perfect_out), render.TARGET)
    off = _colour_count(Image.open(wrong_out), render.TARGET)
    assert perfect < off


def test_avatar_strip_accepts_a_learned_motion_of_another_length(tmp_path: pathlib.Path) -> None:
    clip = motion.builtin_clip("jump")
    half = [a for f in range(0, clip.frame_count, 2) for a in clip.frame(f)]
    out = tmp_path / "avatar.png"
    render.avatar_strip(motion.STICKMAN, clip, half, out, poses=3)
    assert _near_count(Image.open(out), render.LEARNED, 10) > 100


def test_avatar_strip_refuses_angles_that_do_not_fit(tmp_path: pathlib.Path) -> None:
    clip = motion.builtin_clip("wave")
    with pytest.raises(ValueError, match="do not split"):
        render.avatar_strip(motion.STICKMAN, clip, [0.0] * 10, tmp_path / "x.png")
    other = motion.RigSpec("two", (motion.BoneSpec("a", -1, 1.0), motion.BoneSpec("b", 0, 1.0)))
    with pytest.raises(ValueError, match="joints"):
        render.avatar_strip(other, clip, [0.0] * 4, tmp_path / "x.png")


def test_avatar_gif_animates_both_figures(tmp_path: pathlib.Path) -> None:
    clip = motion.builtin_clip("wave")
    learned = [a * 0.8 for a in clip.angles]
    out = tmp_path / "avatar.gif"
    frames = render.avatar_gif(motion.STICKMAN, clip, learned, out, size=200, max_frames=20)
    assert frames == 20
    image = Image.open(out)
    assert image.format == "GIF" and image.size == (200, 200)
    assert getattr(image, "n_frames", 1) == 20
    assert image.info["duration"] == round(clip.frame_count / 20 / clip.fps * 1000)
    image.seek(7)
    assert _near_count(image, render.TARGET, 30) > 100
    assert _near_count(image, render.LEARNED, 30) > 50


def test_render_imports_without_pillow(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    for name in [m for m in sys.modules if m == "PIL" or m.startswith("PIL.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "PIL", None)
    with pytest.raises(ImportError, match=r"pip install 'trainwire\[cli\]'"):
        render.plot_curve([episode_pb2.Episode(episode=1)], tmp_path / "x.png")

"""What a GRPO run and its trainers look like on the page, in a real browser (headless Chromium,
with the fixtures of tests/http/test_browser.py) against a real gateway over fake trainers.

- The learning curve of a run whose rewards are exactly 0 and 1 and whose learning rate follows
  TRL's schedule (it decays at every step, and the episodes carry it as ``learning_rate``):
  the schedule is no hyperparameter change, so no marker stands at its steps (a marker per
  episode is an orange dashed line per episode, and their handles a band along the top edge);
  a change made while it trains has its marker.
- "Latest metrics" with TRL's long names (``completions/mean_terminated_length``): no name runs
  into its value or another cell, in a wide window and in a narrow one.
- The Trainers card of the runs view: each trainer's GPUs (name, memory used / total,
  utilization) as the gateway last probed them, following changes; a CPU trainer says it has
  none, an unreachable one why.
"""

from __future__ import annotations

import io
import math
from collections.abc import Iterator
from typing import Any

import pytest
from PIL import Image
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver

from tests.fakes.fake_trainer import Script, running_fake
from tests.http.harness import LiveGateway, create_body, threaded_gateway
from tests.http.test_browser import (  # noqa: F401 (fixtures)
    assert_every_episode_once,
    attr,
    browser,
    curve,
    open_run,
    page,
    screenshot,
    state_badge,
    wait_until,
)
from trainwire.v1 import episode_pb2, trainer_service_pb2

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

GIB = 1 << 30
EPISODES = 80
CHANGE_AT = 41  # a person halves the learning rate's peak from this episode on
PEAK = 3e-3
#: The hyperparameter markers' colour (style.css ``--warn``, #d97706).
MARKER_RGB = (217, 119, 6)
H100 = "NVIDIA H100 80GB HBM3"


def gpu(index: int, used_gib: float, utilization: float) -> trainer_service_pb2.Gpu:
    return trainer_service_pb2.Gpu(
        index=index,
        name=H100,
        memory_total_bytes=80 * GIB,
        memory_used_bytes=int(used_gib * GIB),
        utilization=utilization,
    )


@pytest.fixture(scope="module")
def gw() -> Iterator[LiveGateway]:
    """One gateway for the module over a fake trainer with two GPUs (it takes the runs), a CPU
    one, and an address where nothing answers."""
    gpus = (gpu(0, 12.3, 0.45), gpu(1, 71.9, 0.0))
    with (
        running_fake(slots=8, gpus=gpus) as fake,
        running_fake(slots=1) as cpu,
        threaded_gateway((fake.address, cpu.address, "127.0.0.1:9")) as served,
    ):
        served.fake = fake  # type: ignore[attr-defined]
        served.cpu = cpu  # type: ignore[attr-defined]
        yield served


def learning_rate(n: int) -> float:
    """TRL's default schedule (linear decay to 0 over the run) of the rate's peak, which a
    person halves at ``CHANGE_AT``."""
    peak = PEAK if n < CHANGE_AT else PEAK / 2
    return peak * (1 - (n - 1) / EPISODES)


def grpo_episodes() -> tuple[episode_pb2.Episode, ...]:
    """A GRPO run's stream as the provider sends it: rewards of exactly 0 and 1 (every
    completion right, or none), and the metrics of TRL's log with its long names."""
    episodes = []
    best = -math.inf
    for n in range(1, EPISODES + 1):
        reward = 1.0 if n % 3 == 0 or (n > EPISODES // 2 and n % 2 == 0) else 0.0
        best = max(best, reward)
        metrics = {
            "learning_rate": learning_rate(n),
            "temperature": 1.0,
            "beta": 0.0,
            "loss": 0.01 * n,
            "grad_norm": 0.25,
            "reward": reward,
            "reward_std": 0.0,
            "frac_reward_zero_std": 1.0,
            "rewards/exact_match/mean": reward,
            "rewards/exact_match/std": 0.0,
            "completions/mean_length": 18.0,
            "completions/mean_terminated_length": 12.5 + n % 3,
            "completions/max_terminated_length": 20.0,
            "completions/clipped_ratio": 0.0,
            "step_time": 0.21,
            "completion_tokens_per_second": 1234.5,
        }
        episode = episode_pb2.Episode(
            episode=n, reward=reward, best_reward=best, done=n == EPISODES, metrics=metrics
        )
        episode.grpo.sample_completions.append(f"<answer>{n}</answer>")
        episodes.append(episode)
    return tuple(episodes)


@pytest.fixture(scope="module")
def grpo_run(gw: LiveGateway) -> dict[str, Any]:
    """A finished GRPO run of ``grpo_episodes``."""
    gw.fake.push(Script(stream=grpo_episodes()))  # type: ignore[attr-defined]
    body = create_body(max_episodes=EPISODES)
    body["task"] = {"grpo": {"modelPath": "tiny-vlm", "datasetPath": "shapes.jsonl"}}
    run: dict[str, Any] = gw.api("POST", "/v1/runs", body)["run"]
    return run


def open_done(driver: WebDriver, gw: LiveGateway, run: dict[str, Any]) -> None:
    open_run(driver, gw, run["id"])
    wait_until(driver, lambda: state_badge(driver) == "DONE", "the run DONE")
    wait_until(driver, lambda: curve(driver)["episodes"] == EPISODES, "every episode drawn")
    wait_until(
        driver,
        lambda: "step_time" in driver.find_element(By.ID, "metrics").text,
        "the latest metrics",
    )
    assert_every_episode_once(driver)


def marker_columns(driver: WebDriver) -> tuple[list[int], int]:
    """The x pixels of the chart where the markers' colour shows, and how many of its pixels
    in the plot's top 16 rows have it."""
    node = driver.find_element(By.CSS_SELECTOR, "#curve .u-over")
    picture = Image.open(io.BytesIO(node.screenshot_as_png)).convert("RGB")
    width, height = picture.size
    pixels = picture.load()
    assert pixels is not None

    def orange(x: int, y: int) -> bool:
        r, g, b = pixels[x, y]  # type: ignore[misc]
        return abs(r - MARKER_RGB[0]) <= 24 and abs(g - MARKER_RGB[1]) <= 24 and b <= 60

    columns = [x for x in range(width) if any(orange(x, y) for y in range(height))]
    top = sum(orange(x, y) for x in range(width) for y in range(min(16, height)))
    return columns, top


# -- the learning curve -------------------------------------------------------------------------


def test_a_learning_rate_schedule_draws_no_markers_and_a_live_change_draws_one(
    page: WebDriver,  # noqa: F811
    gw: LiveGateway,
    grpo_run: dict[str, Any],
) -> None:
    open_done(page, gw, grpo_run)
    assert attr(page, "stat-best", "textContent") == "1.000"
    assert attr(page, "curve", "data-markers") == "1"
    (marker,) = page.find_elements(By.CSS_SELECTOR, "#curve .hp-marker")
    assert marker.get_attribute("data-name") == "learning_rate"
    assert marker.get_attribute("data-episode") == str(CHANGE_AT)
    columns, top = marker_columns(page)
    # One marker: a dashed line and its handle, some 12 pixels wide (a marker per episode
    # would be 80 lines across the chart, their handles a band along its top edge).
    assert columns and columns[-1] - columns[0] <= 16, columns
    assert top <= 16 * 16, top
    screenshot(page, "run-view-grpo-rewards-0-1.png")


def test_a_change_inside_a_bucket_of_a_schedule_is_found_there(
    page: WebDriver,  # noqa: F811
    gw: LiveGateway,
) -> None:
    page.get(gw.url + "/")
    # 20 buckets of 10 episodes of a linear decay; the peak halves at episode 105 (inside
    # bucket 11, whose mean lies between its neighbours'); the temperature never moves.
    found = page.execute_async_script(
        "const done = arguments[0];"
        "import('/static/draw.js').then(({ CurveBuckets, hyperparameterChanges }) => {"
        "  const lr = (n) => (n < 105 ? 0.003 : 0.0015) * (1 - (n - 1) / 200);"
        "  const b = new CurveBuckets();"
        "  for (let i = 0; i < 20; i += 1) {"
        "    let sum = 0;"
        "    for (let n = 10 * i + 1; n <= 10 * i + 10; n += 1) sum += lr(n);"
        "    const metrics = { learning_rate: sum / 10, temperature: 1 };"
        "    b.push(10 * i + 1, 10 * i + 10, 0, 1, 0.5, 1, metrics);"
        "  }"
        "  const single = new CurveBuckets();"  # one episode per bucket: the schedule alone
        "  for (let n = 1; n <= 50; n += 1) single.add(n, n % 2, 1, { learning_rate: lr(n) });"
        "  done([hyperparameterChanges(b), hyperparameterChanges(single)]);"
        "});"
    )
    changes, alone = found
    assert [(c["name"], c["first"], c["last"]) for c in changes] == [("learning_rate", 101, 110)]
    assert changes[0]["from"] > 2 * changes[0]["to"] > 0
    assert alone == []


# -- latest metrics -----------------------------------------------------------------------------


def overlaps(driver: WebDriver) -> dict[str, Any]:
    """Every pair of the metrics panel's names and values whose boxes intersect, and the names
    whose text overflows their box."""
    found: dict[str, Any] = driver.execute_script(
        "const boxes = [...document.querySelectorAll('#metrics dt, #metrics dd')].map((n) => {"
        "  const r = n.getBoundingClientRect();"
        "  const over = n.scrollWidth > n.clientWidth + 1;"
        "  return { what: `${n.tagName} ${n.textContent}`, r, over };"
        "});"
        "const hits = [];"
        "for (let i = 0; i < boxes.length; i += 1) for (let j = i + 1; j < boxes.length; j += 1) {"
        "  const [a, b] = [boxes[i].r, boxes[j].r];"
        "  const across = a.left < b.right - 0.5 && b.left < a.right - 0.5;"
        "  const down = a.top < b.bottom - 0.5 && b.top < a.bottom - 0.5;"
        "  if (across && down) hits.push([boxes[i].what, boxes[j].what]);"
        "}"
        "const overflowing = boxes.filter((b) => b.over).map((b) => b.what);"
        "return { boxes: boxes.length, hits, overflowing };"
    )
    return found


@pytest.mark.parametrize("width", [1400, 520], ids=["wide", "narrow"])
def test_long_metric_names_never_run_into_their_values(
    page: WebDriver,  # noqa: F811
    gw: LiveGateway,
    grpo_run: dict[str, Any],
    width: int,
) -> None:
    size = page.get_window_size()
    page.set_window_size(width, size["height"])
    try:
        open_done(page, gw, grpo_run)
        found = overlaps(page)
        assert found["boxes"] == 2 * len(grpo_episodes()[-1].metrics), found
        assert found["hits"] == [] and found["overflowing"] == [], found
        # The whole name is there to read (and to hover).
        name = page.find_element(By.CSS_SELECTOR, "#metrics dt[title^='completions/mean_term']")
        assert name.text.replace("\n", "") == "completions/mean_terminated_length"
        page.execute_script("document.getElementById('metrics').scrollIntoView()")
        screenshot(page, f"run-view-metrics-{width}.png")
    finally:
        page.set_window_size(size["width"], size["height"])


# -- trainers and their GPUs --------------------------------------------------------------------


def trainers(driver: WebDriver) -> dict[str, Any]:
    """The Trainers card: per address, reachable, its text and its GPUs' data attributes."""
    found: dict[str, Any] = driver.execute_script(
        "const out = {};"
        "for (const t of document.querySelectorAll('#trainers li.trainer')) {"
        "  out[t.dataset.address] = { reachable: t.dataset.reachable, text: t.innerText,"
        "    gpus: [...t.querySelectorAll('li.gpu')]"
        "      .map((g) => ({ ...g.dataset, text: [...g.children].map((c) => c.textContent) })),"
        "    defaults: [...t.querySelectorAll('.provider-defaults li')]"
        "      .map((d) => ({ ...d.dataset, text: d.textContent })) };"
        "}"
        "return out;"
    )
    return found


def test_the_runs_view_shows_each_trainer_s_gpus_and_follows_them(
    page: WebDriver,  # noqa: F811
    gw: LiveGateway,
) -> None:
    fake, cpu = gw.fake, gw.cpu  # type: ignore[attr-defined]
    page.get(gw.url + "/")
    wait_until(
        page,
        lambda: len(trainers(page)) == 3 and trainers(page)["127.0.0.1:9"]["text"].strip(),
        "three trainers",
    )
    shown = wait_until(page, lambda: (t := trainers(page))[fake.address]["gpus"] and t, "the GPUs")
    gpus = shown[fake.address]["gpus"]
    assert [(g["index"], g["name"], g["utilization"]) for g in gpus] == [
        ("0", H100, "0.45"),
        ("1", H100, "0"),
    ]
    assert gpus[0]["memoryUsed"] == str(int(12.3 * GIB))
    assert gpus[0]["memoryTotal"] == str(80 * GIB)
    assert gpus[0]["text"] == [f"cuda:0 {H100}", "12.3 / 80.0 GiB", "45%", ""]
    assert gpus[1]["text"] == [f"cuda:1 {H100}", "71.9 / 80.0 GiB", "0%", ""]
    assert "8/8 slots free" in shown[fake.address]["text"]
    assert shown[cpu.address]["gpus"] == [] and "no GPUs" in shown[cpu.address]["text"]
    # What a task's 0 fields mean on each trainer, as it advertised them.
    defaults = {d["provider"]: d for d in shown[fake.address]["defaults"]}
    assert defaults["imitation"] == {
        "provider": "imitation",
        "checkpointEvery": "500",
        "text": "imitation: checkpoint every 500; group size 16; learning rate 0.03",
    }
    assert defaults["grpo"]["checkpointEvery"] == "50"
    assert "8 generations of 16 prompts a step" in defaults["grpo"]["text"]
    assert "LoRA rank 16, alpha 2 x rank, learning rate 0.01, beta 0.04" in defaults["grpo"]["text"]
    assert shown["127.0.0.1:9"]["reachable"] == "false"
    assert "connection refused" in shown["127.0.0.1:9"]["text"]
    assert attr(page, "trainers-status", "textContent") == "2 of 3 answering"
    screenshot(page, "runs-view-trainers.png")

    # The gateway probes its trainers in the background; the card follows what they report.
    fake.gpus = (gpu(0, 40.0, 0.97), gpu(1, 71.9, 0.0))
    wait_until(
        page,
        lambda: trainers(page)[fake.address]["gpus"][0]["utilization"] == "0.97",
        "the new reading",
    )
    assert trainers(page)[fake.address]["gpus"][0]["text"][1] == "40.0 / 80.0 GiB"

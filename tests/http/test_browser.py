"""The page in a real browser: headless Chromium (Debian's ``chromium`` and ``chromium-driver``)
driven by selenium, against a real gateway over the fake trainer. One browser and one gateway
serve the whole module; every test makes its own runs.

Chromium missing fails these tests with what to install (``make install`` installs it as root);
``TRAINWIRE_BROWSER_TESTS=0`` skips them explicitly.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import Select, WebDriverWait

from tests.fakes.episodes import scripted_samples
from tests.fakes.fake_trainer import Script, running_fake
from tests.fakes.gateway_harness import ROOT
from tests.fakes.waiting import TIMEOUT, wait_for
from tests.http.harness import ApiError, LiveGateway, create_body, threaded_gateway
from tests.unit.test_contract_stream import make_stream
from trainwire import motion

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

SCREENSHOTS = ROOT / "var" / "screenshots"
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1400,1000",
)


def _executable(variable: str, *names: str) -> str | None:
    for name in (os.environ.get(variable), *names):
        if name and (found := shutil.which(name)):
            return found
    return None


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WebDriver]:
    """One headless Chromium for the module."""
    if os.environ.get("TRAINWIRE_BROWSER_TESTS") == "0":
        pytest.skip("TRAINWIRE_BROWSER_TESTS=0: browser tests skipped on request")
    chromium = _executable("CHROMIUM", "chromium", "chromium-browser")
    driver = _executable("CHROMEDRIVER", "chromedriver", "/usr/lib/chromium/chromedriver")
    if chromium is None or driver is None:
        pytest.fail(
            "the browser tests need Chromium and its WebDriver, not found on PATH: run "
            "`make install` as root, or `sudo apt-get install chromium chromium-driver` "
            "(or set CHROMIUM and CHROMEDRIVER; TRAINWIRE_BROWSER_TESTS=0 skips these tests)",
            pytrace=False,
        )
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path_factory.mktemp('chromium')}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    log = tmp_path_factory.getbasetemp() / "chromedriver.log"
    chrome = webdriver.Chrome(service=Service(driver, log_output=str(log)), options=options)
    chrome.set_page_load_timeout(TIMEOUT)
    chrome.set_script_timeout(TIMEOUT)
    try:
        yield chrome
    finally:
        chrome.quit()


@pytest.fixture(scope="module")
def gw() -> Iterator[LiveGateway]:
    """One gateway (fake trainer, 8 slots) for the module."""
    with running_fake(slots=8) as fake, threaded_gateway((fake.address,)) as served:
        served.fake = fake  # type: ignore[attr-defined]
        yield served


@pytest.fixture
def page(browser: WebDriver, gw: LiveGateway) -> Iterator[WebDriver]:
    """The browser; after the test, no JavaScript error may have been logged."""
    browser.get_log("browser")  # drop what earlier tests left
    yield browser
    errors = [
        entry["message"] for entry in browser.get_log("browser") if entry["source"] == "javascript"
    ]
    browser.get("about:blank")  # close the run view's streams before the next test
    assert not errors, errors


@contextlib.contextmanager
def active_run(gw: LiveGateway, **kwargs: Any) -> Iterator[dict[str, Any]]:
    """A run that is stopped on exit if it is still going."""
    run = gw.create(**kwargs)
    try:
        yield run
    finally:
        with contextlib.suppress(ApiError):
            gw.api("POST", f"/v1/runs/{run['id']}:stop")


def wait_until(
    driver: WebDriver, condition: Callable[[], Any], what: str, timeout: float = TIMEOUT
) -> Any:
    """Waits for ``condition()`` to be truthy; returns it. (Selenium's own wait, which retries
    through the driver's transient errors, with the suite's ``TIMEOUT``; ``JOB_TIMEOUT`` for a
    wait that spans a run to its end.)"""
    return WebDriverWait(driver, timeout, poll_frequency=0.05).until(
        lambda _: condition(), message=f"timed out waiting for {what}"
    )


def wait_api(gw: LiveGateway, run_id: str, check: Callable[[dict[str, Any]], bool]) -> dict:
    """Waits (``wait_for``) until the run, read over the JSON API, passes ``check``."""

    def there() -> dict[str, Any] | None:
        run = gw.run(run_id)
        return run if check(run) else None

    return wait_for(there, f"run {run_id} to get there")


def attr(driver: WebDriver, element_id: str, name: str) -> str:
    return driver.find_element(By.ID, element_id).get_attribute(name) or ""


def curve(driver: WebDriver) -> dict[str, int]:
    """The curve's counters: points drawn, last episode drawn, gaps and duplicates seen."""
    values = driver.execute_script(
        "const d = document.getElementById('curve').dataset;"
        "return [d.episodes, d.last, d.gaps, d.duplicates];"
    )
    return dict(zip(("episodes", "last", "gaps", "duplicates"), map(int, values), strict=True))


def assert_every_episode_once(driver: WebDriver) -> dict[str, int]:
    """Points 1..N, each once: the page accepts episode n only after n - 1 (else it counts a gap
    or a duplicate), so N points whose last is N are exactly 1..N."""
    c = curve(driver)
    assert c["episodes"] == c["last"] and c["gaps"] == 0 and c["duplicates"] == 0, c
    return c


def open_run(driver: WebDriver, gw: LiveGateway, run_id: str) -> None:
    driver.get(f"{gw.url}/#/runs/{run_id}")


def state_badge(driver: WebDriver) -> str:
    return attr(driver, "run-state", "data-state")


def counter(driver: WebDriver) -> int:
    return int(attr(driver, "episode-counter", "data-episode") or 0)


def screenshot(driver: WebDriver, name: str) -> Path:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / name
    assert driver.save_screenshot(str(path)), path
    return path


# -- tests -----------------------------------------------------------------------------------


def test_the_page_lists_a_running_run_and_it_updates_live(page: WebDriver, gw: LiveGateway) -> None:
    with active_run(gw, max_episodes=3000, episodes_per_second=20, display_name="listed") as run:
        page.get(gw.url + "/")
        row = f"#runs tr[data-run-id='{run['id']}']"

        def row_state() -> tuple[str, int, str]:
            # One script, so the row cannot be replaced (the table is redrawn every second)
            # between finding it and reading it.
            found = page.execute_script(
                "const r = document.querySelector(arguments[0]);"
                "return r ? [r.dataset.state, r.dataset.episode, r.textContent] : null;",
                row,
            )
            return (found[0], int(found[1]), found[2]) if found else ("", 0, "")

        wait_until(page, lambda: row_state()[0] == "RUNNING", "the row RUNNING")
        _, episode, text = row_state()
        assert "listed" in text and "/3000" in text
        wait_until(page, lambda: row_state()[1] > episode + 5, "the row to move")


def test_creating_a_run_through_the_form_starts_it(page: WebDriver, gw: LiveGateway) -> None:
    page.get(gw.url + "/")
    form = page.find_element(By.ID, "new-run")
    wait_until(page, lambda: len(Select(form.find_element(By.NAME, "clip")).options) == 3, "clips")
    Select(form.find_element(By.NAME, "clip")).select_by_value("walk")
    for name, value in (("episodes", "40"), ("rate", "-1"), ("seed", "3"), ("name", "from form")):
        field = form.find_element(By.NAME, name)
        field.clear()
        field.send_keys(value)
    form.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
    wait_until(page, lambda: "#/runs/" in page.current_url, "the run view")
    run_id = page.current_url.rsplit("/", 1)[1]
    run = gw.run(run_id)
    assert run["displayName"] == "from form"
    assert run["task"]["imitation"]["clipName"] == "walk" and run["config"]["maxEpisodes"] == 40
    wait_until(page, lambda: state_badge(page) == "DONE", "the run DONE")
    wait_until(page, lambda: curve(page)["episodes"] == 40, "40 points")
    assert_every_episode_once(page)


def test_the_form_shows_every_bad_field(page: WebDriver, gw: LiveGateway) -> None:
    page.get(gw.url + "/")
    form = page.find_element(By.ID, "new-run")
    form.find_element(By.CSS_SELECTOR, "input[value=grpo]").click()
    field = form.find_element(By.NAME, "episodes")
    field.clear()
    field.send_keys("0")
    form.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
    error = page.find_element(By.ID, "form-error")
    wait_until(page, error.is_displayed, "the form's error")
    assert "config.max_episodes" in error.text and "task.grpo.model_path" in error.text


def test_a_finished_300_episode_run_draws_exactly_300_points(
    page: WebDriver, gw: LiveGateway
) -> None:
    run = gw.create(max_episodes=300, display_name="stickman learns to wave")
    wait_api(gw, run["id"], lambda r: r["state"] == "STATE_DONE")
    open_run(page, gw, run["id"])
    wait_until(page, lambda: curve(page)["episodes"] == 300, "300 points")
    assert assert_every_episode_once(page)["last"] == 300
    assert state_badge(page) == "DONE" and counter(page) == 300
    wait_until(page, lambda: attr(page, "avatar", "data-episode") == "300", "the last motion")
    wait_until(page, lambda: attr(page, "link", "data-state") == "finished", "the stream's end")
    draws, seconds = avatar_draws(page, at_least=10)
    # Redrawn at the clip's 30 frames per second, not at every display refresh (60 Hz here).
    assert draws / seconds <= 36, f"{draws} avatar pictures in {seconds:.2f} s"
    screenshot(page, "run-view.png")


def avatar_draws(driver: WebDriver, at_least: int) -> tuple[int, float]:
    """Counts the avatar canvas's redraws (its ``clearRect`` calls) until there are
    ``at_least``; returns them with the seconds (the page's clock) they took."""
    driver.execute_script(
        """
        const ctx = document.getElementById("avatar").getContext("2d");
        const clear = ctx.clearRect.bind(ctx);
        window.avatarDraws = { count: 0, since: performance.now() };
        ctx.clearRect = (...args) => { window.avatarDraws.count += 1; return clear(...args); };
        """
    )
    wait_until(
        driver,
        lambda: driver.execute_script("return window.avatarDraws.count") >= at_least,
        f"{at_least} avatar pictures",
    )
    draws, millis = driver.execute_script(
        "return [window.avatarDraws.count, performance.now() - window.avatarDraws.since]"
    )
    return int(draws), millis / 1000


def test_opened_mid_run_it_fills_in_from_episode_1_and_keeps_growing(
    page: WebDriver, gw: LiveGateway
) -> None:
    with active_run(gw, max_episodes=3000, episodes_per_second=30) as run:
        before = wait_api(gw, run["id"], lambda r: int(r.get("episode", 0)) >= 60)
        open_run(page, gw, run["id"])
        wait_until(page, lambda: curve(page)["episodes"] >= int(before["episode"]), "history")
        start = assert_every_episode_once(page)["episodes"]
        wait_until(page, lambda: curve(page)["episodes"] >= start + 30, "live growth")
        assert_every_episode_once(page)
        assert attr(page, "link", "data-state") == "live"
        screenshot(page, "run-view-live.png")


def test_a_reload_and_a_cut_stream_leave_no_gap_and_no_duplicate(
    page: WebDriver, gw: LiveGateway
) -> None:
    with active_run(gw, max_episodes=3000, episodes_per_second=30) as run:
        open_run(page, gw, run["id"])
        wait_until(page, lambda: curve(page)["episodes"] >= 30, "30 points")
        page.refresh()
        wait_until(page, lambda: curve(page)["episodes"] >= 40, "the history again")
        assert_every_episode_once(page)
        assert attr(page, "link", "data-reconnects") == "0"
        gw.restart_http()  # every event stream breaks; the page resumes after its last id
        wait_until(page, lambda: attr(page, "link", "data-reconnects") == "1", "a reconnect")
        cut_at = assert_every_episode_once(page)["episodes"]
        wait_until(page, lambda: curve(page)["episodes"] >= cut_at + 30, "growth after the cut")
        gw.api("POST", f"/v1/runs/{run['id']}:stop")
        wait_until(page, lambda: attr(page, "link", "data-state") == "finished", "the end")
        final = gw.run(run["id"])
        assert final["state"] == "STATE_STOPPED"
        assert assert_every_episode_once(page)["last"] == int(final["episode"])


def test_pause_resume_speed_and_stop_from_the_page(page: WebDriver, gw: LiveGateway) -> None:
    with active_run(gw, max_episodes=3000, episodes_per_second=20) as run:
        open_run(page, gw, run["id"])
        wait_until(page, lambda: state_badge(page) == "RUNNING" and counter(page) > 5, "running")
        page.find_element(By.ID, "pause").click()
        wait_until(page, lambda: state_badge(page) == "PAUSED", "PAUSED")
        time.sleep(0.5)  # an episode already on the wire may still land
        held = counter(page)
        time.sleep(1.5)  # 30 episodes' worth at 20/s
        assert counter(page) == held, "the counter moved while paused"
        assert gw.run(run["id"])["state"] == "STATE_PAUSED"
        page.find_element(By.ID, "resume").click()
        wait_until(page, lambda: counter(page) > held + 5, "the counter to move again")
        page.execute_script(
            "const s = document.getElementById('speed');"
            "s.value = String(Math.log10(4)); s.dispatchEvent(new Event('change'));"
        )
        wait_api(gw, run["id"], lambda r: r["speed"] == 4)
        wait_until(page, lambda: attr(page, "speed-value", "value") == "\u00d74.0", "\u00d74.0")
        page.find_element(By.ID, "stop").click()
        wait_until(page, lambda: state_badge(page) == "STOPPED", "STOPPED")
        assert gw.run(run["id"])["state"] == "STATE_STOPPED"
        assert not page.find_element(By.ID, "run-error").is_displayed()


# Holds the answers of the run view's once-a-second GET of its run (not the stream's) until
# ``release()``; counts them as they are read.
_HOLD_RUN_POLLS = """
const original = window.fetch;
const held = [];
window.polls = { sent: 0, read: 0, release: () => held.splice(0).forEach((go) => go()) };
window.fetch = (path, init) => {
  const answer = original(path, init);
  if (!/^\\/v1\\/runs\\/[^/:]+$/.test(path) || (init && init.method !== "GET")) return answer;
  window.polls.sent += 1;
  return answer.then((response) => new Promise((go) => held.push(() => {
    const json = response.json.bind(response);
    response.json = () => json().finally(() => { window.polls.read += 1; });
    go(response);
  })));
};
"""


def test_a_poll_answered_after_the_run_ended_does_not_bring_it_back(
    page: WebDriver, gw: LiveGateway
) -> None:
    # A slow gateway answers a poll sent before the stop after the stream told the page that the
    # run ended: the page keeps the end (its state, no controls) rather than RUNNING again.
    with active_run(gw, max_episodes=3000, episodes_per_second=20) as run:
        open_run(page, gw, run["id"])
        wait_until(page, lambda: state_badge(page) == "RUNNING" and counter(page) > 5, "running")
        page.execute_script(_HOLD_RUN_POLLS)
        wait_until(page, lambda: page.execute_script("return window.polls.sent") > 0, "a poll")
        gw.api("POST", f"/v1/runs/{run['id']}:stop")
        wait_until(page, lambda: state_badge(page) == "STOPPED", "STOPPED from the stream")
        sent = page.execute_script("window.polls.release(); return window.polls.sent")
        wait_until(page, lambda: page.execute_script("return window.polls.read") >= sent, "read")
        assert state_badge(page) == "STOPPED"
        assert not page.find_element(By.ID, "hp-card").is_displayed()
        assert not page.find_element(By.ID, "stop").is_enabled()


def test_a_grpo_run_shows_its_curve_and_what_the_model_saw(
    page: WebDriver, gw: LiveGateway
) -> None:
    # The fake trainer's GRPO steps carry two samples each (scripted_samples): a JPEG thumbnail,
    # an answer (one with markup: model output, shown as text, never as elements), the expected
    # answer and the rewards.
    gw.fake.push(Script(motion=True))  # type: ignore[attr-defined]
    body = create_body(max_episodes=12)
    body["task"] = {"grpo": {"modelPath": "tiny-vlm", "datasetPath": "shapes.jsonl"}}
    run = gw.api("POST", "/v1/runs", body)["run"]
    open_run(page, gw, run["id"])
    wait_until(page, lambda: state_badge(page) == "DONE", "the run DONE")
    wait_until(page, lambda: curve(page)["episodes"] == 12, "12 points")
    assert_every_episode_once(page)
    card = page.find_element(By.ID, "completions-card")
    assert card.is_displayed() and not page.find_element(By.ID, "avatar-card").is_displayed()
    wait_until(page, lambda: attr(page, "completions-note", "textContent") == "episode 12", "12")
    assert attr(page, "samples", "data-episode") == "12"
    assert attr(page, "completions-title", "textContent") == "Samples"
    rows = page.find_elements(By.CSS_SELECTOR, "#samples tbody tr")
    cells = [[td.text for td in row.find_elements(By.TAG_NAME, "td")] for row in rows]
    expected = scripted_samples(12)
    assert [c[1:3] for c in cells] == [[s.completion, s.solution] for s in expected]
    assert [c[3].splitlines() for c in cells] == [
        ["2.00", "exact_match 1.00", "format 1.00"],
        ["0.00", "exact_match 0.00", "format 0.00"],
    ]
    assert not page.find_elements(By.CSS_SELECTOR, "#samples b, #completions-card answer")
    assert not page.find_elements(By.CSS_SELECTOR, "#completions li")  # the table replaces it
    # Real pictures: each thumbnail decoded by the browser, at its own size.
    sizes = page.execute_script(
        "return [...document.querySelectorAll('#samples img.thumb')]"
        ".map((img) => [img.complete, img.naturalWidth, img.naturalHeight, img.title]);"
    )
    assert sizes == [[True, 24, 16, s.prompt] for s in expected], sizes
    assert "grpo" in attr(page, "run-task", "textContent")
    assert "tiny-vlm" in attr(page, "run-task", "textContent")
    screenshot(page, "run-view-grpo.png")


def test_a_trainer_that_sends_no_samples_shows_its_completions(
    page: WebDriver, gw: LiveGateway
) -> None:
    stream = make_stream([0.1, 0.2, 0.3], kind="grpo")
    for episode in stream:
        episode.grpo.sample_completions.append(f"<i>answer {episode.episode}</i>")
    gw.fake.push(Script(stream=tuple(stream)))  # type: ignore[attr-defined]
    body = create_body(max_episodes=3)
    body["task"] = {"grpo": {"modelPath": "tiny-vlm", "datasetPath": "shapes.jsonl"}}
    run = gw.api("POST", "/v1/runs", body)["run"]
    open_run(page, gw, run["id"])
    wait_until(page, lambda: attr(page, "completions-note", "textContent") == "episode 3", "3")
    shown = [item.text for item in page.find_elements(By.CSS_SELECTOR, "#completions li")]
    assert shown == ["<i>answer 3</i>"]
    assert attr(page, "completions-title", "textContent") == "Sample completions"
    assert not page.find_element(By.ID, "samples").is_displayed()


def test_an_error_run_shows_its_message(page: WebDriver, gw: LiveGateway) -> None:
    message = "The stickman tripped over its own feet at episode 5."
    gw.fake.push(Script(abort_after=5, localized=message))  # type: ignore[attr-defined]
    run = gw.create(max_episodes=100)
    open_run(page, gw, run["id"])
    banner = page.find_element(By.ID, "run-error")
    wait_until(page, banner.is_displayed, "the error banner")
    assert banner.text == message and state_badge(page) == "ERROR"
    assert_every_episode_once(page)


def test_the_page_poses_the_rig_as_trainwire_motion_does(page: WebDriver, gw: LiveGateway) -> None:
    page.get(gw.url + "/")
    rig, clip = motion.STICKMAN, motion.builtin_clip("wave")
    bones = [{"parent": b.parent, "length": b.length} for b in rig.bones]
    angles = list(clip.frame(17))
    segments = page.execute_async_script(
        "const [bones, angles, done] = arguments;"
        "import('/static/draw.js').then((m) => done(m.forwardKinematics(bones, angles)));",
        bones,
        angles,
    )
    expected = motion.forward_kinematics(rig, angles)
    assert len(segments) == len(expected)
    for got, want in zip(segments, expected, strict=True):
        assert all(math.isclose(g, w, abs_tol=1e-9) for g, w in zip(got, want, strict=True))

"""Takes the README's picture of the gateway's page (``docs/images/page.png``), from nothing.

It starts a trainer and a gateway as subprocesses on free localhost ports, with a temporary
SQLite database, data root and checkpoint store; creates runs through the ``trainwire`` client
(a GRPO run on the offline tiny VLM, built into the temporary data root, then an imitation
run); opens the page in headless Chromium (Debian's ``chromium`` and ``chromium-driver``, as the
browser tests drive it) with a 1280x800 viewport; photographs the runs list, then clicks the
imitation run's row and, once its curve has ``--episodes`` points and its avatar moves,
photographs the run view. The picture is the two one above the other, 1280 px wide: the runs
list cut below its last card, then the run view's whole 1280x800 viewport; written to ``--out``
as an optimized PNG (palette colours only when no pixel changes visibly).

Everything it starts (both services, Chromium) is stopped before it returns, whatever happens;
nothing is downloaded; it fails, saying why, when a service does not start, a run does not get
where it must in time, the page shows an error banner, or the page logs a JavaScript error.

Usage: ``.venv/bin/python scripts/page_screenshot.py [--out PATH] [--no-grpo]``
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from PIL import Image, ImageChops
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from trainwire.client import (
    TERMINAL_STATES,
    GatewayClient,
    grpo_task,
    imitation_task,
    state_name,
    train_config,
)

ROOT = Path(__file__).resolve().parent.parent
WIDTH, HEIGHT = 1280, 800
#: Bound on every wait: a service starting, a run reaching its episodes, the page drawing.
TIMEOUT = 90.0
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
    "--hide-scrollbars",
    f"--window-size={WIDTH},{HEIGHT}",
)
#: The GRPO demo of ``DEMO=grpo make run`` (scripts/run.sh), under the data root.
TINY_VLM = "models/tiny-vlm"
COLOURS = "datasets/colours/train.jsonl"
#: The most a palette may change any channel of any pixel (out of 255).
PALETTE_ERROR = 16

T = TypeVar("T")


class Failed(Exception):
    """The picture could not be taken; the message says why."""


def wait_for(condition: Callable[[], T | None], what: str, timeout: float = TIMEOUT) -> T:
    """Polls ``condition`` until it returns something other than ``None``/``False``."""
    deadline = time.monotonic() + timeout
    while True:
        found = condition()
        if found is not None and found is not False:
            return found
        if time.monotonic() > deadline:
            raise Failed(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.2)


# -- services --------------------------------------------------------------------------------


@contextlib.contextmanager
def service(module: str, name: str, log: Path, *args: str) -> Iterator[dict[str, str]]:
    """Runs ``python -m MODULE ARGS`` (output to ``log``) in a process group of its own, yields
    what its ready lines (``NAME listening on HOST:PORT``, ``NAME http on URL``) say
    (``listening``: HOST:PORT; ``http``: the page's URL, where it has one), and on exit stops it
    and every process it started (SIGTERM, then SIGKILL)."""
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", module, *args],
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:

        def ready() -> dict[str, str] | None:
            text = log.read_text(errors="replace")
            found = re.search(rf"^{name} listening on (\S+)$", text, re.MULTILINE)
            if process.poll() is not None:
                raise Failed(f"{name} exited with {process.returncode}; its log:\n{text[-3000:]}")
            if found is None:
                return None
            lines = {"listening": found.group(1)}
            if http := re.search(rf"^{name} http on (\S+)$", text, re.MULTILINE):
                lines["http"] = http.group(1)
            return lines

        yield wait_for(ready, f"{name} to listen (log {log})")
    finally:
        stop_group(process)


def stop_group(process: subprocess.Popen[bytes]) -> None:
    """Stops ``process`` and its process group: SIGTERM, then SIGKILL after 20 s."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)
    # Whatever the service left in its group (job processes) goes too.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)


def build_grpo_data(data: Path, log: Path) -> None:
    """The tiny VLM and the colour dataset of the GRPO demo, under ``data``."""
    with log.open("ab") as out:
        for module, target in (
            ("trainer_service.tools.make_tiny_vlm", TINY_VLM),
            ("trainer_service.tools.make_demo_dataset", str(Path(COLOURS).parent)),
        ):
            subprocess.run(
                [sys.executable, "-m", module, str(data / target)],
                cwd=ROOT,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                check=True,
                timeout=TIMEOUT,
            )


def episode_of(client: GatewayClient, run_id: str) -> int:
    """The run's latest episode; fails if the run has ended (it must still be running)."""
    run = client.get_run(run_id)
    if run.state in TERMINAL_STATES:
        detail = run.error_message or run.state_detail
        raise Failed(f"run {run_id} ended early: {state_name(run.state)} {detail}")
    return int(run.episode)


# -- the browser -----------------------------------------------------------------------------


def executable(variable: str, *names: str) -> str:
    for name in (os.environ.get(variable), *names):
        if name and (found := shutil.which(name)):
            return found
    raise Failed(
        f"no {names[0]} on PATH: `sudo apt-get install chromium chromium-driver` "
        f"(or set {variable})"
    )


@contextlib.contextmanager
def chromium(profile: Path, log: Path) -> Iterator[webdriver.Chrome]:
    """Headless Chromium with a ``WIDTH`` x ``HEIGHT`` viewport; quit on exit."""
    options = webdriver.ChromeOptions()
    options.binary_location = executable("CHROMIUM", "chromium", "chromium-browser")
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={profile}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = executable("CHROMEDRIVER", "chromedriver", "/usr/lib/chromium/chromedriver")
    browser = webdriver.Chrome(service=Service(driver, log_output=str(log)), options=options)
    try:
        browser.set_page_load_timeout(TIMEOUT)
        browser.set_script_timeout(TIMEOUT)
        # The window's size is not the viewport's: fix the viewport itself.
        browser.execute_cdp_cmd(
            "Emulation.setDeviceMetricsOverride",
            {"width": WIDTH, "height": HEIGHT, "deviceScaleFactor": 1, "mobile": False},
        )
        yield browser
    finally:
        browser.quit()


def page_wait(browser: webdriver.Chrome, condition: Callable[[], Any], what: str) -> Any:
    return WebDriverWait(browser, TIMEOUT, poll_frequency=0.1).until(
        lambda _: condition(), message=f"timed out waiting for {what}"
    )


def script(browser: webdriver.Chrome, source: str, *args: Any) -> Any:
    return browser.execute_script(source, *args)


def check_page(browser: webdriver.Chrome) -> None:
    """No JavaScript error logged, no error banner shown."""
    errors = [
        entry["message"] for entry in browser.get_log("browser") if entry["source"] == "javascript"
    ]
    if errors:
        raise Failed(f"the page logged JavaScript errors: {errors}")
    banner = script(
        browser,
        "const b = document.getElementById('run-error');"
        "return b && !b.hidden ? b.textContent : null;",
    )
    if banner:
        raise Failed(f"the page shows an error banner: {banner}")


def screenshot(browser: webdriver.Chrome, height: int = HEIGHT) -> Image.Image:
    """The viewport, cut to its top ``height`` pixels."""
    image = Image.open(io.BytesIO(browser.get_screenshot_as_png())).convert("RGB")
    if image.size != (WIDTH, HEIGHT):
        raise Failed(f"the screenshot is {image.size[0]}x{image.size[1]}, not {WIDTH}x{HEIGHT}")
    return image.crop((0, 0, WIDTH, min(height, HEIGHT)))


def photograph(
    browser: webdriver.Chrome, url: str, run_id: str, grpo_id: str | None, episodes: int
) -> Image.Image:
    """The runs list (cut below its last card), then the run view after clicking ``run_id``'s
    row, one above the other."""
    browser.get(url + "/")
    ids = [run_id] if grpo_id is None else [run_id, grpo_id]
    page_wait(
        browser,
        lambda: script(
            browser,
            "return arguments[0].every(id => {"
            "  const r = document.querySelector(`#runs tr[data-run-id='${id}']`);"
            "  return r && r.dataset.state === 'RUNNING' && Number(r.dataset.episode) > 0; })"
            " && document.querySelectorAll('#trainers li').length > 0;",
            ids,
        ),
        "the runs list to show the runs RUNNING and the trainer",
    )
    time.sleep(1.0)  # the list redraws every second: let the rows settle on fresh numbers
    check_page(browser)
    # Down to the lowest card's bottom edge, with a margin.
    bottom = script(
        browser,
        "return Math.max(...[...document.querySelectorAll('#runs-view .card')]"
        ".map(c => c.getBoundingClientRect().bottom));",
    )
    runs_list = screenshot(browser, int(bottom) + 16)

    browser.find_element(By.CSS_SELECTOR, f"#runs tr[data-run-id='{run_id}'] td.muted").click()
    page_wait(
        browser,
        lambda: script(
            browser,
            "const c = document.getElementById('curve').dataset;"
            "const a = document.getElementById('avatar');"
            "return !document.getElementById('run-view').hidden"
            " && document.getElementById('run-state').dataset.state === 'RUNNING'"
            " && Number(c.episodes) >= arguments[0] && Number(c.gaps) === 0"
            " && !document.getElementById('avatar-card').hidden && Number(a.dataset.episode) > 0;",
            episodes,
        ),
        f"the run view to draw {episodes} episodes and the avatar",
    )
    time.sleep(1.0)  # the avatar's animation and the curve's last redraw
    check_page(browser)
    run_view = screenshot(browser)

    picture = Image.new("RGB", (WIDTH, runs_list.height + run_view.height), "white")
    picture.paste(runs_list, (0, 0))
    picture.paste(run_view, (0, runs_list.height))
    return picture


def save(picture: Image.Image, out: Path) -> int:
    """Writes ``picture`` as an optimized PNG, with a 256-colour palette when that changes no
    pixel's channel by more than ``PALETTE_ERROR`` (small accents such as the link dot keep
    their colour); returns its size in bytes."""
    image: Image.Image = picture
    palette = picture.quantize(colors=256, method=Image.Quantize.FASTOCTREE)
    if max(ImageChops.difference(picture, palette.convert("RGB")).tobytes()) <= PALETTE_ERROR:
        image = palette
    out.parent.mkdir(parents=True, exist_ok=True)
    image.save(out, format="PNG", optimize=True)
    return out.stat().st_size


# -- main ------------------------------------------------------------------------------------


def take(out: Path, grpo: bool, episodes: int, work: Path) -> None:
    data, checkpoints = work / "data", work / "checkpoints"
    data.mkdir()
    started = time.monotonic()
    if grpo:
        build_grpo_data(data, work / "build.log")
    with contextlib.ExitStack() as stack:
        trainer = stack.enter_context(
            service(
                "trainer_service",
                "trainer",
                work / "trainer.log",
                *("--host", "127.0.0.1", "--port", "0", "--slots", "2", "--device", "cpu"),
                *("--data-root", str(data), "--checkpoint-store", str(checkpoints)),
            )
        )
        gateway = stack.enter_context(
            service(
                "gateway",
                "gateway",
                work / "gateway.log",
                *("--host", "127.0.0.1", "--port", "0", "--http-port", "0"),
                *("--trainer", trainer["listening"], "--db", str(work / "trainwire.sqlite3")),
                *("--migrate", "--checkpoint-store", str(checkpoints)),
            )
        )
        if "http" not in gateway:
            raise Failed("the gateway printed no `gateway http on URL` line")
        client = stack.enter_context(GatewayClient(gateway["listening"], timeout=30.0))
        grpo_id = None
        if grpo:
            # First: its processes take a while to import TRL and load the model.
            grpo_id = client.create_run(
                grpo_task(model=TINY_VLM, dataset=COLOURS, reward_functions=["exact_match"]),
                train_config(max_episodes=200, seed=0),
                episodes_per_second=20,
                display_name="demo: a tiny VLM learns to name colours",
            ).id
            wait_for(lambda: episode_of(client, grpo_id) >= 2, f"GRPO run {grpo_id} to train")
        run_id = client.create_run(
            imitation_task(clip="wave"),
            train_config(max_episodes=1000, seed=0),
            episodes_per_second=20,
            display_name="demo: stickman learns to wave",
        ).id
        wait_for(lambda: episode_of(client, run_id) >= episodes, f"run {run_id} to train")
        browser = stack.enter_context(chromium(work / "chromium", work / "chromedriver.log"))
        picture = photograph(browser, gateway["http"], run_id, grpo_id, episodes)
        size = save(picture, out)
    print(
        f"wrote {out} ({picture.width}x{picture.height}, {size} bytes) "
        f"in {time.monotonic() - started:.0f} s"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", type=Path, default=ROOT / "docs" / "images" / "page.png", help="the PNG to write"
    )
    parser.add_argument(
        "--no-grpo", dest="grpo", action="store_false", help="no GRPO run (faster: no TRL)"
    )
    parser.add_argument(
        "--episodes", type=int, default=120, help="episodes on the curve before the picture"
    )
    args = parser.parse_args(argv)
    # A SIGTERM unwinds like Ctrl+C does, so the services and the browser are stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    with tempfile.TemporaryDirectory(prefix="trainwire-page-") as work:
        try:
            take(args.out, args.grpo, args.episodes, Path(work))
        except (Failed, subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
            print(f"page_screenshot: {exc}", file=sys.stderr)
            for log in sorted(Path(work).glob("*.log")):
                tail = log.read_text(errors="replace")[-2000:]
                print(f"--- {log.name} (last lines)\n{tail}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

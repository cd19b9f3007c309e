"""The page against a gateway with ``--auth-tokens``, in headless Chromium: it asks for a token
once, keeps it in sessionStorage, and the run view's event stream carries it."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from selenium.common.exceptions import TimeoutException
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support import expected_conditions
from selenium.webdriver.support.ui import WebDriverWait

from tests.fakes.fake_trainer import running_fake
from tests.fakes.waiting import TIMEOUT
from tests.http.harness import LiveGateway, threaded_gateway
from tests.http.test_browser import browser, curve, wait_until  # noqa: F401 (fixture)
from tests.security_fixtures import Tokens

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def secured(tmp_path: Path) -> Iterator[tuple[LiveGateway, Tokens]]:
    tokens = Tokens.make(tmp_path / "tokens")
    with (
        running_fake(slots=2) as fake,
        threaded_gateway((fake.address,), auth_tokens=str(tokens.path)) as served,
    ):
        yield served, tokens


def _create(url: str, token: str) -> str:
    body = {"task": {"imitation": {"clipName": "wave"}}, "config": {"maxEpisodes": 30},
            "episodesPerSecond": -1}  # fmt: skip
    request = urllib.request.Request(
        url + "/v1/runs",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=TIMEOUT) as response:
        return str(json.load(response)["run"]["id"])


def test_the_page_asks_for_a_token_once_and_streams_with_it(
    browser: WebDriver,  # noqa: F811
    secured: tuple[LiveGateway, Tokens],
) -> None:
    gw, tokens = secured
    run_id = _create(gw.url, tokens.by_role["operator"])
    browser.get(f"{gw.url}/#/runs/{run_id}")
    try:
        WebDriverWait(browser, TIMEOUT).until(expected_conditions.alert_is_present())
        prompt = browser.switch_to.alert
        assert "needs a token" in prompt.text
        prompt.send_keys(tokens.by_role["viewer"])
        prompt.accept()
        with pytest.raises(TimeoutException):  # once: the other requests reuse the token
            WebDriverWait(browser, 2).until(expected_conditions.alert_is_present())
        stored = browser.execute_script("return sessionStorage.getItem('trainwire.token')")
        assert stored == tokens.by_role["viewer"]
        wait_until(browser, lambda: curve(browser)["episodes"] == 30, "30 points over SSE")
    finally:
        browser.get("about:blank")

"""Runs as experiments on the page, in a real browser (headless Chromium, with the fixtures of
tests/http/test_browser.py) against a real gateway: labels and the display name edited in the
run view, the run list's filter box, sortable columns and pages, the compare route
(``#/compare?runs=ID,ID``) opened from the list's selection, the metric picker, a fork's parent
drawn before the fork point, and live hyperparameters set from the page and marked on the curve.

Most tests run over the fake trainer (its episodes carry the metrics ``loss`` and
``reward_std``). Forks and live hyperparameters need checkpoints and episodes that carry their
hyperparameters: those run over the in-memory trainer (``MemoryConnector``) behind a second
gateway. The charts say what they draw in data attributes (``data-metric``, ``data-points``,
``data-runs``, ``data-parent-points``, ``data-markers``); the tests wait on them.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import parse_qs, quote, urlsplit

import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import Select

from tests.fakes.memory_trainer import MemoryConnector, MemoryTrainer
from tests.fakes.waiting import JOB_TIMEOUT, wait_for
from tests.http.harness import LiveGateway, create_body, threaded_gateway
from tests.http.test_browser import (  # noqa: F401 (fixtures)
    active_run,
    attr,
    browser,
    gw,
    open_run,
    page,
    screenshot,
    wait_api,
    wait_until,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


# -- helpers ---------------------------------------------------------------------------------


def dataset(driver: WebDriver, element_id: str) -> dict[str, str]:
    """An element's data attributes (read in one script)."""
    found: dict[str, str] = driver.execute_script(
        "const n = document.getElementById(arguments[0]); return n ? {...n.dataset} : {};",
        element_id,
    )
    return found


def number(driver: WebDriver, element_id: str, name: str) -> int:
    """A data attribute as a number (``name`` as in the markup: ``metric-points``)."""
    key = re.sub(r"-(\w)", lambda m: m[1].upper(), name)
    return int(dataset(driver, element_id).get(key) or 0)


def create(gw: LiveGateway, **fields: Any) -> dict[str, Any]:  # noqa: F811
    """Creates an imitation run: ``create_body``'s arguments, plus ``seed``, ``labels``,
    ``checkpoint_every`` and ``fork_from`` ({runId, episode})."""
    seed = fields.pop("seed", None)
    every = fields.pop("checkpoint_every", None)
    body = create_body(**fields)
    if seed is not None:
        body["config"]["seed"] = str(seed)
    if every is not None:
        body["config"]["checkpointEvery"] = every
    return gw.api("POST", "/v1/runs", body)["run"]


def done(gw: LiveGateway, run: dict[str, Any]) -> dict[str, Any]:  # noqa: F811
    return wait_for(
        lambda: (r := gw.run(run["id"]))["state"] == "STATE_DONE" and r,
        f"run {run['id']} DONE",
        timeout=JOB_TIMEOUT,
    )


def rows(driver: WebDriver) -> list[str]:
    """The run ids of the list's rows, in order."""
    found: list[str] = driver.execute_script(
        "return [...document.querySelectorAll('#runs tbody tr')].map((r) => r.dataset.runId);"
    )
    return found


def hash_query(driver: WebDriver) -> dict[str, list[str]]:
    fragment = urlsplit(driver.current_url).fragment
    return parse_qs(fragment.partition("?")[2])


def type_into(driver: WebDriver, element_id: str, text: str, enter: bool = True) -> None:
    field = driver.find_element(By.ID, element_id)
    field.clear()
    field.send_keys(text + (Keys.ENTER if enter else ""))


def shown(driver: WebDriver, element_id: str) -> bool:
    return driver.find_element(By.ID, element_id).is_displayed()


def options(driver: WebDriver, element_id: str) -> list[str]:
    found: list[str] = driver.execute_script(
        "return [...document.getElementById(arguments[0]).options].map((o) => o.value);",
        element_id,
    )
    return found


@pytest.fixture(scope="module")
def mem() -> Iterator[LiveGateway]:
    """A gateway over the in-memory trainer: checkpoints (so runs can be forked) and episodes
    that carry their live hyperparameters as metrics."""
    trainer = MemoryTrainer("memory:1", slots_total=8, hyperparameter_metrics=True)
    connector = MemoryConnector([trainer])
    with threaded_gateway(connector.addresses, connector=connector) as served:
        served.connector = connector  # type: ignore[attr-defined]
        yield served


# -- labels and the display name ---------------------------------------------------------------


def test_the_name_and_labels_are_edited_in_the_run_view_through_the_api(
    page: WebDriver,  # noqa: F811
    gw: LiveGateway,  # noqa: F811
) -> None:
    run = done(gw, create(gw, max_episodes=20, display_name="before", labels={"team": "vision"}))
    run_id = run["id"]
    open_run(page, gw, run_id)
    chip = "#run-labels li[data-key='{}']"
    wait_until(page, lambda: page.find_elements(By.CSS_SELECTOR, chip.format("team")), "a chip")
    assert page.find_element(By.CSS_SELECTOR, chip.format("team")).text.startswith("team=vision")

    type_into(page, "label-input", "sweep=lr-high")
    wait_api(gw, run_id, lambda r: r.get("labels") == {"team": "vision", "sweep": "lr-high"})
    wait_until(page, lambda: page.find_elements(By.CSS_SELECTOR, chip.format("sweep")), "the chip")
    assert attr(page, "label-input", "value") == ""

    page.find_element(By.CSS_SELECTOR, "#run-labels button[data-key='team']").click()
    wait_api(gw, run_id, lambda r: r.get("labels") == {"sweep": "lr-high"})
    wait_until(page, lambda: not page.find_elements(By.CSS_SELECTOR, chip.format("team")), "gone")

    # A bad key: the gateway's refusal, naming it, next to the field; the labels unchanged.
    type_into(page, "label-input", "bad key=x")
    wait_until(page, lambda: shown(page, "labels-error"), "the labels' error")
    error = page.find_element(By.ID, "labels-error").text
    assert "run.labels[bad key]" in error, error
    assert gw.run(run_id)["labels"] == {"sweep": "lr-high"}
    type_into(page, "label-input", "no-equals-sign")
    wait_until(page, lambda: "key=value" in page.find_element(By.ID, "labels-error").text, "hint")

    page.find_element(By.ID, "rename").click()
    wait_until(page, lambda: shown(page, "name-input"), "the name field")
    assert attr(page, "name-input", "value") == "before"
    type_into(page, "name-input", "after")
    wait_api(gw, run_id, lambda r: r.get("displayName") == "after")
    wait_until(page, lambda: page.find_element(By.ID, "run-title").text == "after", "the title")
    assert not shown(page, "name-form") and not shown(page, "name-error")
    screenshot(page, "run-view-labels.png")

    page.get(gw.url + "/")  # the list shows the name and the labels
    row = f"#runs tr[data-run-id='{run_id}']"
    wait_until(page, lambda: page.find_elements(By.CSS_SELECTOR, row), "the row")
    text = page.find_element(By.CSS_SELECTOR, row).text
    assert "after" in text and "sweep=lr-high" in text, text


# -- search: the filter box, sortable columns, pages --------------------------------------------


@pytest.fixture
def tagged(gw: LiveGateway) -> tuple[str, list[dict[str, Any]]]:  # noqa: F811
    """Three finished runs of this test alone (label ``suite``), with different bests (3, 6
    and 20 episodes of the fake's curve) and labels ``lr`` high, low, high."""
    suite = f"s{uuid.uuid4().hex[:10]}"
    made = [
        create(gw, max_episodes=n, labels={"suite": suite, "lr": lr})
        for n, lr in ((3, "high"), (6, "low"), (20, "high"))
    ]
    gw.api("GET", "/v1/runs?filter=" + quote(f'labels.suite = "{suite}"'))
    return suite, [done(gw, run) for run in made]


def test_the_filter_box_searches_and_the_address_keeps_the_search(
    page: WebDriver,  # noqa: F811
    gw: LiveGateway,  # noqa: F811
    tagged: tuple[str, list[dict[str, Any]]],
) -> None:
    suite, (low3, low6, high20) = tagged
    page.get(gw.url + "/")
    query = f'labels.suite = "{suite}" AND labels.lr = "high"'
    type_into(page, "filter", query)
    wait_until(page, lambda: hash_query(page).get("filter") == [query], "the filter in the hash")
    wanted = {low3["id"], high20["id"]}
    wait_until(page, lambda: set(rows(page)) == wanted, "the runs the filter selects")

    page.refresh()  # the address keeps the search
    wait_until(page, lambda: set(rows(page)) == wanted, "the same runs after a reload")
    assert attr(page, "filter", "value") == query

    type_into(page, "filter", "best_reward >")  # malformed: the gateway names the position
    wait_until(page, lambda: shown(page, "filter-error"), "the filter's error")
    error = page.find_element(By.ID, "filter-error").text
    assert "filter" in error, error
    assert rows(page) == [] and attr(page, "filter", "aria-invalid") == "true"
    assert not shown(page, "runs-empty")
    screenshot(page, "runs-filter-error.png")

    type_into(page, "filter", f'labels.suite = "{suite}" AND labels.lr = "low"')
    wait_until(page, lambda: rows(page) == [low6["id"]], "the low run")
    assert not shown(page, "filter-error") and not attr(page, "filter", "aria-invalid")


def test_a_column_header_sorts_the_list_and_pages_keep_the_order(
    page: WebDriver,  # noqa: F811
    gw: LiveGateway,  # noqa: F811
    tagged: tuple[str, list[dict[str, Any]]],
) -> None:
    suite, runs = tagged
    gw.api("GET", "/v1/runs?orderBy=best_reward")
    best_first = [r["id"] for r in sorted(runs, key=lambda r: -r["bestReward"])]
    assert len({r["bestReward"] for r in runs}) == 3
    page.get(f"{gw.url}/#/?filter={quote(f'labels.suite = {chr(34)}{suite}{chr(34)}')}")
    wait_until(page, lambda: len(rows(page)) == 3, "the suite's runs")

    header = "#runs th[data-order='best_reward']"
    page.find_element(By.CSS_SELECTOR, header).click()
    wait_until(page, lambda: hash_query(page).get("orderBy") == ["best_reward desc"], "desc")
    wait_until(page, lambda: rows(page) == best_first, "best first")
    assert page.find_element(By.CSS_SELECTOR, header).get_attribute("aria-sort") == "descending"
    page.find_element(By.CSS_SELECTOR, header).click()
    wait_until(page, lambda: rows(page) == best_first[::-1], "best last")
    assert hash_query(page)["orderBy"] == ["best_reward"]

    # Two a page: the next page goes on in the same order, the previous one comes back.
    page.get(page.current_url + "&pageSize=2")
    wait_until(page, lambda: rows(page) == best_first[::-1][:2], "the first page")
    page.find_element(By.ID, "runs-next").click()
    wait_until(page, lambda: rows(page) == best_first[::-1][2:], "the second page")
    assert attr(page, "runs-page", "textContent") == "page 2"
    assert not page.find_element(By.ID, "runs-next").is_enabled()
    page.find_element(By.ID, "runs-prev").click()
    wait_until(page, lambda: rows(page) == best_first[::-1][:2], "the first page again")


# -- compare -----------------------------------------------------------------------------------


def test_the_compare_route_overlays_the_runs_and_shows_the_settings_that_differ(
    page: WebDriver,  # noqa: F811
    gw: LiveGateway,  # noqa: F811
) -> None:
    made = [
        create(gw, max_episodes=40, seed=1, clip="wave", display_name="one", labels={"team": "a"}),
        create(gw, max_episodes=40, seed=2, clip="walk", display_name="two", labels={"team": "b"}),
        create(gw, max_episodes=40, seed=3, clip="wave", labels={"team": "a", "only": "c"}),
    ]
    runs = [done(gw, run) for run in made]
    ids = [r["id"] for r in runs]
    page.get(f"{gw.url}/#/compare?runs={','.join(ids)}")

    # 40 episodes a run: one bucket each, every one drawn.
    wait_until(page, lambda: number(page, "compare-chart", "points") == 120, "120 points")
    assert dataset(page, "compare-chart")["runs"] == "3"
    assert dataset(page, "compare-chart")["metric"] == "reward"
    legend = page.find_elements(By.CSS_SELECTOR, "#compare-legend li")
    assert [li.get_attribute("data-run-id") for li in legend] == ids
    assert len({li.get_attribute("data-colour") for li in legend}) == 3
    assert legend[0].text.startswith("one") and legend[1].text.startswith("two")
    assert ids[2] in legend[2].text and "best 0.950" in legend[2].text

    def fields() -> dict[str, list[str]]:
        found: dict[str, list[str]] = page.execute_script(
            "const out = {};"
            "for (const r of document.querySelectorAll('#compare-diff tbody tr'))"
            "  out[r.dataset.field] = [...r.querySelectorAll('td')].map((c) => c.textContent);"
            "return out;"
        )
        return found

    differ = wait_until(page, lambda: fields(), "the table")
    assert differ == {
        "task.imitation.clip_name": ["wave", "walk", "wave"],
        "config.seed": ["1", "2", "3"],
        "labels.only": ["\u2013", "\u2013", "c"],
        "labels.team": ["a", "b", "a"],
    }, differ
    page.find_element(By.ID, "compare-all").click()
    every = fields()
    assert every["task.kind"] == ["imitation"] * 3 and every["config.max_episodes"] == ["40"] * 3
    order = page.execute_script(
        "return [...document.querySelectorAll('#compare-diff tbody tr')]"
        ".map((r) => r.dataset.field);"
    )
    assert order[:3] == ["task.kind", "task.imitation.clip_name", "task.imitation.rig_name"], order
    page.find_element(By.ID, "compare-all").click()

    # The metric picker offers the episodes' metrics and charts the one picked.
    wait_until(page, lambda: "loss" in options(page, "compare-metric"), "the metrics offered")
    assert options(page, "compare-metric") == ["", "loss", "reward_std"]
    Select(page.find_element(By.ID, "compare-metric")).select_by_value("loss")
    wait_until(
        page,
        lambda: (
            dataset(page, "compare-chart").get("metric") == "loss"
            and number(page, "compare-chart", "points") == 120
        ),
        "the loss of every run",
    )
    screenshot(page, "compare.png")


def test_the_run_lists_selection_opens_the_comparison(
    page: WebDriver,  # noqa: F811
    gw: LiveGateway,  # noqa: F811
) -> None:
    runs = [done(gw, create(gw, max_episodes=10)) for _ in range(2)]
    ids = [r["id"] for r in runs]
    page.get(gw.url + "/")
    wait_until(page, lambda: set(ids) <= set(rows(page)), "the rows")
    assert not page.find_element(By.ID, "compare-button").is_enabled()
    for run_id in ids:  # one script each: the table is redrawn every second
        page.execute_script(
            "document.querySelector(`#runs input.pick[data-run-id='${arguments[0]}']`).click();",
            run_id,
        )
    wait_until(page, lambda: attr(page, "compare-button", "data-selected") == "2", "2 selected")
    time.sleep(1.2)  # a redraw of the table keeps the selection
    checked = page.execute_script(
        "return [...document.querySelectorAll('#runs input.pick:checked')]"
        ".map((b) => b.dataset.runId);"
    )
    assert sorted(checked) == sorted(ids)
    assert "#/runs/" not in page.current_url  # a box's click does not open the run
    screenshot(page, "runs-selected.png")
    page.find_element(By.ID, "compare-button").click()
    wait_until(page, lambda: "#/compare?" in page.current_url, "the compare route")
    assert sorted(hash_query(page)["runs"][0].split(",")) == sorted(ids)
    wait_until(page, lambda: number(page, "compare-chart", "runs") == 2, "two runs drawn")
    assert number(page, "compare-chart", "points") == 20

    # A run that is not there says so in its legend entry; the others are drawn.
    page.get(f"{gw.url}/#/compare?runs={ids[0]},no-such-run")
    missing = "#compare-legend li[data-run-id='no-such-run'] .field-error"

    def missing_text() -> str:  # read in one script: the legend may be redrawn meanwhile
        text = page.execute_script(
            "return document.querySelector(arguments[0])?.textContent", missing
        )
        return str(text or "")

    wait_until(page, lambda: missing_text(), "the missing run")
    assert "no-such-run" in missing_text()
    wait_until(page, lambda: number(page, "compare-chart", "points") == 10, "the other run")
    assert number(page, "compare-chart", "runs") == 1


# -- every metric ------------------------------------------------------------------------------


def test_the_metric_picker_charts_any_metric_of_the_episodes(
    page: WebDriver,  # noqa: F811
    gw: LiveGateway,  # noqa: F811
) -> None:
    run = done(gw, create(gw, max_episodes=300))
    open_run(page, gw, run["id"])
    wait_until(page, lambda: number(page, "curve", "episodes") == 300, "the curve")
    assert dataset(page, "curve")["metric"] == "reward"
    wait_until(page, lambda: "loss" in options(page, "metric-picker"), "the metrics offered")
    assert options(page, "metric-picker") == ["", "loss", "reward_std"]

    Select(page.find_element(By.ID, "metric-picker")).select_by_value("loss")
    wait_until(
        page,
        lambda: (
            dataset(page, "curve").get("metric") == "loss"
            and number(page, "curve", "metric-points") == 300
        ),
        "the loss of every episode",
    )
    assert number(page, "curve", "points") == 300
    asked: list[str] = page.execute_script(
        "return performance.getEntriesByType('resource').map((e) => e.name)"
        ".filter((u) => u.includes('/curve?'));"
    )
    assert any("metrics=loss" in url for url in asked), asked
    screenshot(page, "run-view-metric.png")
    Select(page.find_element(By.ID, "metric-picker")).select_by_value("")
    wait_until(page, lambda: dataset(page, "curve").get("metric") == "reward", "the reward again")

    # Live episodes bring their metrics along.
    with active_run(gw, max_episodes=3000, episodes_per_second=30) as live:
        wait_api(gw, live["id"], lambda r: int(r.get("episode", 0)) >= 20)
        open_run(page, gw, live["id"])
        wait_until(page, lambda: "loss" in options(page, "metric-picker"), "the metrics offered")
        Select(page.find_element(By.ID, "metric-picker")).select_by_value("loss")
        start = wait_until(
            page,
            lambda: (
                dataset(page, "curve").get("metric") == "loss"
                and number(page, "curve", "metric-points")
            ),
            "the loss so far",
        )
        wait_until(
            page, lambda: number(page, "curve", "metric-points") >= start + 30, "the loss live"
        )
        info = dataset(page, "curve")
        assert info["metricPoints"] == info["points"], info
        assert (info["gaps"], info["duplicates"]) == ("0", "0"), info


# -- hyperparameter changes --------------------------------------------------------------------


def test_hyperparameter_changes_are_marked_where_the_bucket_means_change(
    page: WebDriver,  # noqa: F811
    gw: LiveGateway,  # noqa: F811
) -> None:
    page.get(gw.url + "/")
    # 10 buckets of 10 episodes: the learning rate goes 0.03 -> 0.01 inside bucket 5 (its
    # mean between), the temperature 1 -> 0.7 at episode 71 (a bucket's first).
    found = page.execute_async_script(
        "const done = arguments[0];"
        "import('/static/draw.js').then(({ CurveBuckets, Curve, hyperparameterChanges }) => {"
        "  const b = new CurveBuckets();"
        "  for (let i = 0; i < 10; i += 1) {"
        "    const lr = i < 4 ? 0.03 : i === 4 ? 0.02 : 0.01;"
        "    const metrics = {"
        "      learning_rate: lr, temperature: i < 7 ? 1 : 0.7, loss: 1 / (i + 1) };"
        "    b.push(10 * i + 1, 10 * i + 10, 0, 1, 0.5, 1, metrics);"
        "  }"
        "  const changes = hyperparameterChanges(b);"
        "  const node = document.createElement('div');"
        "  node.style.width = '800px';"
        "  document.body.append(node);"
        "  const curve = new Curve(node, { onZoom: () => {}, onReset: () => {} });"
        "  curve.show(b);"
        "  requestAnimationFrame(() => requestAnimationFrame(() => {"
        "    const markers = [...node.querySelectorAll('.hp-marker')].map((m) =>"
        "      [m.dataset.name, m.dataset.episode, m.querySelector('.hp-handle').title]);"
        "    const count = node.dataset.markers;"
        "    curve.destroy(); node.remove();"
        "    done({ changes, markers, count });"
        "  }));"
        "});"
    )
    assert found["changes"] == [
        {"name": "learning_rate", "from": 0.03, "to": 0.01, "first": 41, "last": 50},
        {"name": "temperature", "from": 1, "to": 0.7, "first": 71, "last": 71},
    ]
    assert found["count"] == "2"
    assert found["markers"] == [
        ["learning_rate", "41", "learning_rate 0.03000 \u2192 0.01000 between episodes 41 and 50"],
        ["temperature", "71", "temperature 1.000 \u2192 0.7000 from episode 71"],
    ]


def test_the_form_sets_a_live_learning_rate_and_the_curve_marks_the_change(
    page: WebDriver,  # noqa: F811
    mem: LiveGateway,
) -> None:
    with active_run(mem, max_episodes=100000, episodes_per_second=20) as run:
        run_id = run["id"]
        open_run(page, mem, run_id)
        wait_until(page, lambda: shown(page, "hp-card"), "the hyperparameters' form")
        field = "#hp-form input[name='learningRate']"
        wait_until(
            page,
            lambda: (
                page.find_element(By.CSS_SELECTOR, field).get_attribute("placeholder") == "0.03000"
            ),
            "the current learning rate",
        )
        assert not page.find_element(By.CSS_SELECTOR, "#hp-form input[name='beta']").is_displayed()

        def submit(value: str) -> None:
            box = page.find_element(By.CSS_SELECTOR, field)
            box.clear()
            box.send_keys(value + Keys.ENTER)

        submit("-1")  # the gateway refuses it, naming the field
        wait_until(page, lambda: shown(page, "hp-error"), "the form's error")
        assert "learning_rate" in page.find_element(By.ID, "hp-error").text
        submit("0.005")
        wait_until(page, lambda: not shown(page, "hp-error"), "no error")
        wait_until(page, lambda: "0.005" in attr(page, "hp-note", "textContent"), "the note")
        calls = mem.connector.hyperparameter_calls(run_id)  # type: ignore[attr-defined]
        assert calls, "the trainer was never asked"

        # The episodes after the change carry it: the curve marks where it happened.
        marker = "#curve .hp-marker[data-name='learning_rate']"
        title, episode = wait_until(
            page,
            lambda: page.execute_script(
                "const m = document.querySelector(arguments[0]);"
                "return m && [m.querySelector('.hp-handle').title, m.dataset.episode];",
                marker,
            ),
            "a marker",
        )
        assert title.startswith("learning_rate 0.03000 \u2192 0.005000"), title
        changed_at = int(episode)
        assert 1 < changed_at <= int(mem.run(run_id)["episode"])
        latest = page.execute_script(
            "const d = [...document.querySelectorAll('#metrics div')]"
            ".find((row) => row.querySelector('dt').textContent === 'learning_rate');"
            "return d ? d.querySelector('dd').textContent : null;"
        )
        assert latest == "0.005000", latest
        Select(page.find_element(By.ID, "metric-picker")).select_by_value("learning_rate")
        wait_until(
            page,
            lambda: (
                dataset(page, "curve").get("metric") == "learning_rate"
                and number(page, "curve", "metric-points") > 0
            ),
            "the learning rate charted",
        )
        screenshot(page, "run-view-hyperparameters.png")
        mem.api("POST", f"/v1/runs/{run_id}:stop")
        wait_until(page, lambda: not shown(page, "hp-card"), "no form on a finished run")


# -- forks -------------------------------------------------------------------------------------


def test_a_fork_draws_its_parents_curve_dimmed_up_to_the_fork_point(
    page: WebDriver,  # noqa: F811
    mem: LiveGateway,
) -> None:
    parent = done(mem, create(mem, max_episodes=60, checkpoint_every=10, display_name="parent"))
    fork = create(mem, max_episodes=120, forkFrom={"runId": parent["id"], "episode": "50"}, seed=8)
    fork = done(mem, fork)
    assert fork["forkFrom"] == {"runId": parent["id"], "episode": "50"}
    open_run(page, mem, fork["id"])
    wait_until(page, lambda: number(page, "curve", "parent-points") == 50, "the parent's curve")
    wait_until(page, lambda: number(page, "curve", "episodes") == 120, "the fork's own")
    info = dataset(page, "curve")
    assert (info["first"], info["points"], info["gaps"], info["duplicates"]) == (
        "51",
        "70",
        "0",
        "0",
    ), info
    assert "dimmed: the parent up to episode 50" in attr(page, "curve-note", "textContent")
    assert shown(page, "run-fork")
    assert page.find_element(By.ID, "run-fork").text == f"forked from {parent['id']} at episode 50"
    screenshot(page, "run-view-fork.png")

    # A metric too: the parent's up to the fork, the fork's after it.
    wait_until(page, lambda: "loss" in options(page, "metric-picker"), "the metrics offered")
    Select(page.find_element(By.ID, "metric-picker")).select_by_value("loss")
    wait_until(
        page,
        lambda: (
            dataset(page, "curve").get("metric") == "loss"
            and number(page, "curve", "metric-points") == 70
            and number(page, "curve", "parent-points") == 50
        ),
        "the loss of both",
    )

    page.find_element(By.ID, "run-parent").click()
    wait_until(page, lambda: page.current_url.endswith(f"#/runs/{parent['id']}"), "the parent")
    wait_until(page, lambda: number(page, "curve", "episodes") == 60, "the parent's view")
    assert not shown(page, "run-fork") and number(page, "curve", "parent-points") == 0

    # Compared, they line up by episode: the fork's curve starts after the fork point.
    page.get(f"{mem.url}/#/compare?runs={parent['id']},{fork['id']}")
    wait_until(page, lambda: number(page, "compare-chart", "points") == 60 + 70, "both curves")
    fields = page.execute_script(
        "return [...document.querySelectorAll('#compare-diff tbody tr')]"
        ".map((r) => r.dataset.field);"
    )
    assert "fork_from" in fields and "config.max_episodes" in fields, fields

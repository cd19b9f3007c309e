// The compare view, `#/compare?runs=ID,ID,...`: the runs' curves on one chart (the mean reward,
// or the mean of a metric, per bucket of each run's curve), a legend of the runs in their
// colours, and a table of the settings that differ between them (task, config, labels, fork).
//
// Each run's curve comes from GET /v1/runs/{id}/curve (about one bucket per pixel, whatever
// the run's length); the metrics to offer come from each run's latest episode. While a run is
// active its curve is asked for again every few seconds.

import { api, latestEpisode, runPath } from "./api.js";
import { $, FINAL, badge, el, fieldError, fixed, link, num, precise, stateName, taskKind } from "./dom.js";
import { CompareChart, Curve, CurveBuckets, RUN_COLOURS } from "./draw.js";

const REFRESH_MS = 2000;
const GROUPS = ["task", "config", "labels", "fork_from"];

const snake = (name) => name.replace(/[A-Z]/g, (c) => `_${c.toLowerCase()}`);

function flatten(value, path, out) {
  if (value == null) return;
  if (Array.isArray(value)) {
    out[path] = value.length > 8 ? `[${value.length} values]` : value.map((v) => (typeof v === "object" ? JSON.stringify(v) : String(v))).join(", ");
  } else if (typeof value === "object") {
    for (const [key, v] of Object.entries(value)) flatten(v, `${path}.${snake(key)}`, out);
  } else {
    out[path] = String(value);
  }
}

/**
 * A run's settings as flat fields named as the filter names them ("task.imitation.clip_name":
 * "wave", "config.seed": "7", "labels.team": "vision"); a field at its default is absent (the
 * JSON mapping leaves it out).
 */
export function settings(run) {
  const out = {};
  const task = run.task || {};
  const kind = taskKind(task);
  out["task.kind"] = kind || "?";
  const body = { ...(task[kind] || {}) };
  // A custom rig or clip is its name: its bones and angles are no setting to read in a table.
  for (const key of ["rig", "clip"]) if (body[key] && typeof body[key] === "object") body[key] = body[key].name || "custom";
  flatten(body, `task.${kind}`, out);
  flatten(run.config || {}, "config", out);
  for (const [key, value] of Object.entries(run.labels || {})) out[`labels.${key}`] = value;
  if (run.forkFrom && run.forkFrom.runId) out.fork_from = `${run.forkFrom.runId} @ episode ${num(run.forkFrom.episode)}`;
  return out;
}

/** The fields of these settings in table order: task (kind first), config, labels, fork. */
function fieldOrder(all) {
  const keys = new Set();
  for (const fields of all) for (const key of Object.keys(fields)) keys.add(key);
  const rank = (key) => GROUPS.findIndex((group) => key === group || key.startsWith(`${group}.`));
  return [...keys].sort((a, b) => rank(a) - rank(b) || (a === "task.kind" ? -1 : b === "task.kind" ? 1 : a.localeCompare(b)));
}

export class CompareView {
  constructor() {
    $("#compare-metric").addEventListener("change", (e) => this.pick(e.target.value));
    $("#compare-all").addEventListener("change", () => this.table());
    this.chart = null;
    this.timer = null;
  }

  /**
   * Opens the comparison of these runs (the first RUN_COLOURS.length distinct ids).
   * @param {string[]} ids
   */
  async start(ids) {
    const opened = (this.opened = {});
    this.ids = [...new Set(ids)].slice(0, RUN_COLOURS.length);
    this.metric = "";
    this.runs = this.ids.map(() => null);
    this.errors = this.ids.map(() => "");
    this.buckets = this.ids.map(() => null);
    this.metricNames = new Set();
    $("#compare-view").hidden = false;
    link.set("idle", 0);
    $("#compare-metric").replaceChildren(el("option", { value: "", textContent: "reward" }));
    $("#compare-legend").replaceChildren();
    $("#compare-diff thead").replaceChildren();
    $("#compare-diff tbody").replaceChildren();
    $("#compare-same").hidden = true;
    const node = $("#compare-chart");
    Object.assign(node.dataset, { runs: "0", points: "0", metric: "reward" });
    const dropped = ids.length - this.ids.length;
    $("#compare-note").textContent = dropped > 0 ? `${dropped} more left out: at most ${RUN_COLOURS.length} runs at once` : "";
    fieldError($("#compare-status"), this.ids.length ? "" : "No runs to compare: select some on the runs page.");
    if (!this.ids.length) return;
    this.width = Curve.bucketsFor(node);
    await this.loadRuns();
    if (this.opened !== opened) return;
    this.makeChart();
    this.loadCurves();
    this.loadMetricNames();
    this.timer = setInterval(() => this.refresh(), REFRESH_MS);
  }

  stop() {
    this.opened = null;
    clearInterval(this.timer);
    if (this.chart) this.chart.destroy();
    this.chart = null;
    $("#compare-view").hidden = true;
  }

  /** Reads the runs again; redraws the legend and the table. */
  async loadRuns() {
    const opened = this.opened;
    const replies = await Promise.allSettled(this.ids.map((id) => api("GET", runPath(id))));
    if (this.opened !== opened) return;
    replies.forEach((reply, i) => {
      if (reply.status === "fulfilled") {
        this.runs[i] = reply.value.run;
        this.errors[i] = "";
      } else {
        this.errors[i] = reply.reason.message;
      }
    });
    this.legend();
    this.table();
  }

  /** The title of run i: its display name, else its id. */
  label(i) {
    const run = this.runs[i];
    return (run && run.displayName) || this.ids[i];
  }

  legend() {
    const items = this.ids.map((id, i) => {
      const run = this.runs[i];
      const colour = RUN_COLOURS[i];
      const swatch = el("span", { class: "swatch", style: { background: colour } });
      const name = el("a", { href: `#/runs/${encodeURIComponent(id)}`, textContent: this.label(i) });
      const parts = [swatch, name, " ", el("code", { class: "muted", textContent: id })];
      if (run) {
        const state = el("span", { class: "badge" });
        badge(state, run);
        const episode = num(run.episode);
        const figures = episode ? `episode ${episode} \u00b7 reward ${fixed(run.reward)} \u00b7 best ${fixed(run.bestReward)}` : "no episodes yet";
        parts.push(" ", state, el("span", { class: "muted small figures", textContent: figures }));
      }
      if (this.errors[i]) parts.push(el("span", { class: "field-error", textContent: this.errors[i] }));
      parts.push(el("span", { class: "at small" }));
      const points = this.buckets[i] ? this.buckets[i].values(this.metric).filter((v) => v != null).length : 0;
      return el("li", { dataset: { runId: id, colour, points: String(points) } }, ...parts);
    });
    $("#compare-legend").replaceChildren(...items);
  }

  /** The settings that differ between the runs found (every setting with "all fields"). */
  table() {
    const found = this.ids.map((id, i) => [id, i]).filter(([, i]) => this.runs[i]);
    const all = found.map(([, i]) => settings(this.runs[i]));
    const everything = $("#compare-all").checked;
    const fields = fieldOrder(all).filter((key) => everything || new Set(all.map((s) => s[key] ?? "")).size > 1);
    const head = el(
      "tr",
      {},
      el("th", { textContent: "Field" }),
      ...found.map(([id, i]) => el("th", { dataset: { runId: id } }, el("span", { class: "swatch", style: { background: RUN_COLOURS[i] } }), " ", this.label(i))),
    );
    const rows = fields.map((key) => {
      const values = all.map((s) => s[key]);
      const differs = new Set(values.map((v) => v ?? "")).size > 1;
      return el(
        "tr",
        { dataset: { field: key }, class: differs ? "differs" : "" },
        el("th", { scope: "row", textContent: key }),
        ...values.map((v, k) => el("td", { textContent: v ?? "\u2013", class: v == null ? "muted" : "", dataset: { runId: found[k][0] } })),
      );
    });
    $("#compare-diff thead").replaceChildren(head);
    $("#compare-diff tbody").replaceChildren(...rows);
    $("#compare-same").hidden = rows.length > 0 || found.length < 2;
  }

  makeChart() {
    if (this.chart) this.chart.destroy();
    const runs = this.ids.map((id, i) => ({ label: this.label(i), colour: RUN_COLOURS[i] }));
    this.chart = new CompareChart($("#compare-chart"), {
      runs,
      metric: this.metric,
      onCursor: (episode, values) => {
        const items = document.querySelectorAll("#compare-legend li");
        values.forEach((value, i) => {
          const at = items[i] && $(".at", items[i]);
          if (at) at.textContent = episode && value != null ? `episode ${episode}: ${precise(value)}` : "";
        });
      },
    });
    this.chart.show(this.buckets);
  }

  /** Asks for each run's curve (`only`: the indexes of the runs to ask for again). */
  async loadCurves(only = null) {
    const opened = this.opened;
    const metric = this.metric;
    const query = `buckets=${this.width}${metric ? `&metrics=${encodeURIComponent(metric)}` : ""}`;
    const asked = this.ids.map((id, i) => i).filter((i) => this.runs[i] && (!only || only.includes(i)));
    const replies = await Promise.allSettled(asked.map((i) => api("GET", runPath(this.ids[i], `/curve?${query}`))));
    if (this.opened !== opened || this.metric !== metric) return;
    const failed = [];
    replies.forEach((reply, k) => {
      if (reply.status === "fulfilled") this.buckets[asked[k]] = CurveBuckets.fromReply(reply.value);
      else failed.push(`${this.ids[asked[k]]}: ${reply.reason.message}`);
    });
    fieldError($("#compare-status"), failed.length ? `cannot load the curve of ${failed.join("; ")}` : "");
    this.chart.show(this.buckets);
    this.legend();
  }

  /** Offers every metric the runs' latest episodes carry. */
  async loadMetricNames() {
    const opened = this.opened;
    const episodes = await Promise.all(
      this.runs.map((run) => (run ? latestEpisode(run.id, num(run.episode), num(run.forkFrom && run.forkFrom.episode)) : null)),
    );
    if (this.opened !== opened) return;
    for (const episode of episodes) for (const name of Object.keys((episode && episode.metrics) || {})) this.metricNames.add(name);
    const picker = $("#compare-metric");
    const names = [...this.metricNames].sort();
    picker.replaceChildren(el("option", { value: "", textContent: "reward" }), ...names.map((name) => el("option", { value: name, textContent: name })));
    picker.value = this.metric;
    picker.dataset.metrics = names.join(",");
  }

  /** Charts another metric ("": the reward). */
  pick(metric) {
    if (!this.chart || metric === this.metric) return;
    this.metric = metric;
    this.buckets = this.ids.map(() => null);
    this.makeChart();
    this.legend();
    this.loadCurves();
  }

  /** While a run is active: its figures and its curve again. */
  async refresh() {
    const active = this.ids.map((id, i) => i).filter((i) => this.runs[i] && !FINAL.has(stateName(this.runs[i])));
    if (!active.length) {
      clearInterval(this.timer);
      return;
    }
    await this.loadRuns();
    if (this.opened) await this.loadCurves(active);
  }
}

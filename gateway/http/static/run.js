// The run view: a run's learning curve (the reward or any metric, its parent's curve before a
// fork, its hyperparameter changes), avatar or completions, controls, name and labels, and
// the form that changes its hyperparameters while it trains.
//
// It draws a run of any length in about the same time: it loads the run's curve in buckets
// (about one per pixel of the chart), then follows the event stream from the curve's last
// episode on, adding live episodes to the chart and merging them as they pile up. The curve's
// first request asks for the reward only; metrics are asked for once they are wanted: the one
// picked, and the hyperparameters once the episodes show that they carry them.

import { api, describe, downloadUrl, eventsUrl, runPath } from "./api.js";
import { $, FINAL, badge, el, fieldError, fixed, link, num, precise, speedText, stateName, taskKind, taskText } from "./dom.js";
import { Avatar, Curve, CurveBuckets, HYPERPARAMETERS } from "./draw.js";
import { firstCurvePath } from "./early.js";

/** A metric's name as text with a line break allowed after each "/" (`rewards/<wbr>exact_match/<wbr>mean`). */
function breakable(name) {
  return name.split(/(?<=\/)/).flatMap((part, i) => (i ? [el("wbr"), part] : [part]));
}

/** One GRPO sample as a table row: the image the model saw (a thumbnail; the prompt as its
 * tooltip), its answer, the expected answer and its reward (each reward function's below it). */
function sampleRow(sample) {
  const picture = sample.image
    ? el("img", { class: "thumb", src: `data:${sample.imageType};base64,${sample.image}`, alt: "the image the model saw", title: sample.prompt || "" })
    : el("span", { class: "muted", textContent: "\u2013", title: sample.prompt || "" });
  const parts = Object.keys(sample.rewards || {})
    .sort()
    .map((name) => `${name} ${fixed(num(sample.rewards[name]), 2)}`);
  const reward = el("td", { class: "num", title: parts.join("\n") }, el("div", { textContent: fixed(num(sample.reward), 2) }));
  reward.append(...parts.map((part) => el("div", { class: "muted rewards", textContent: part })));
  return el(
    "tr",
    {},
    el("td", {}, picture),
    el("td", {}, el("pre", { class: "answer", textContent: sample.completion || "" })),
    el("td", { class: "expected", textContent: sample.solution || "\u2013" }),
    reward,
  );
}

/** Calls `fn` once the browser has painted what the page drew so far: after the next frame. */
function afterPaint(fn) {
  requestAnimationFrame(() => setTimeout(fn, 0));
}

/** Follows a run's event stream after an episode; resumes after the last episode it saw,
 * exactly once. */
class RunStream {
  constructor(runId, after, handlers) {
    this.runId = runId;
    this.handlers = handlers;
    this.last = after; // the last episode accepted
    this.reconnects = 0;
    this.gaps = 0;
    this.duplicates = 0;
    this.dropped = false;
    this.closed = false;
    this.source = null;
    this.retry = null;
    link.set("connecting", 0);
    this.open();
  }

  open() {
    const source = new EventSource(eventsUrl(this.runId, this.last));
    this.source = source;
    source.onopen = () => {
      if (this.dropped) this.reconnects += 1;
      this.dropped = false;
      link.set("live", this.reconnects);
    };
    source.addEventListener("episode", (e) => this.episode(JSON.parse(e.data)));
    source.addEventListener("caught_up", () => this.handlers.caughtUp());
    source.addEventListener("finished", (e) => {
      this.close();
      link.set("finished", this.reconnects);
      this.handlers.finished(JSON.parse(e.data));
    });
    source.onerror = () => {
      if (this.closed) return;
      this.dropped = true;
      link.set("reconnecting", this.reconnects);
      // EventSource reconnects by itself (with Last-Event-ID) unless the server answered an
      // error status: then it gives up, and the page resumes after its last episode.
      if (source.readyState === EventSource.CLOSED) this.reopen();
    };
  }

  reopen() {
    clearTimeout(this.retry);
    if (this.source) this.source.close();
    this.retry = setTimeout(() => this.open(), 1000);
  }

  episode(episode) {
    const n = num(episode.episode);
    if (n <= this.last) {
      this.duplicates += 1;
      this.handlers.anomaly();
      return;
    }
    if (n !== this.last + 1) {
      this.gaps += 1; // never expected: resume after the last one accepted
      this.handlers.anomaly();
      this.reopen();
      return;
    }
    this.last = n;
    this.handlers.episode(episode, n);
  }

  close() {
    this.closed = true;
    clearTimeout(this.retry);
    if (this.source) this.source.close();
  }
}

/** The run's display name and labels, edited in place: UpdateRun (PATCH with a field mask of
 * the one field changed); the gateway's refusal is shown next to that field. */
class RunLabels {
  constructor(view) {
    this.view = view;
    this.shown = null; // the labels drawn, as JSON: redrawn only when they change
    $("#rename").addEventListener("click", () => this.editName(true));
    $("#name-cancel").addEventListener("click", () => this.editName(false));
    $("#name-form").addEventListener("submit", (e) => {
      e.preventDefault();
      this.saveName();
    });
    $("#label-form").addEventListener("submit", (e) => {
      e.preventDefault();
      this.addLabel();
    });
    $("#run-labels").addEventListener("click", (e) => {
      const button = e.target.closest("button[data-key]");
      if (button) this.removeLabel(button.dataset.key);
    });
  }

  reset() {
    this.shown = null;
    this.editName(false);
    $("#run-labels").replaceChildren();
    $("#label-input").value = "";
    fieldError($("#name-error"), "");
    fieldError($("#labels-error"), "");
  }

  show(run) {
    const labels = run.labels || {};
    const keys = Object.keys(labels).sort();
    const json = JSON.stringify(keys.map((k) => [k, labels[k]]));
    if (json === this.shown) return; // (a chip's button redrawn under the mouse loses its click)
    this.shown = json;
    const chips = keys.map((key) => {
      const remove = el("button", { type: "button", class: "chip-remove", textContent: "\u00d7", title: `Remove label ${key}`, dataset: { key } });
      remove.setAttribute("aria-label", `Remove label ${key}`);
      return el("li", { class: "chip", dataset: { key, value: labels[key] } }, el("span", { textContent: `${key}=${labels[key]}` }), remove);
    });
    $("#run-labels").replaceChildren(...chips);
  }

  editName(on) {
    $("#name-form").hidden = !on;
    $("#rename").hidden = on;
    if (!on) return;
    fieldError($("#name-error"), "");
    const input = $("#name-input");
    input.value = (this.view.run && this.view.run.displayName) || "";
    input.focus();
  }

  async saveName() {
    const run = await this.patch("display_name", { displayName: $("#name-input").value.trim() }, $("#name-error"));
    if (run) this.editName(false);
  }

  async addLabel() {
    const text = $("#label-input").value.trim();
    const at = text.indexOf("=");
    if (at <= 0) {
      fieldError($("#labels-error"), "Write the label as key=value.");
      return;
    }
    const labels = { ...((this.view.run && this.view.run.labels) || {}) };
    labels[text.slice(0, at).trim()] = text.slice(at + 1).trim();
    if (await this.patch("labels", { labels }, $("#labels-error"))) $("#label-input").value = "";
  }

  async removeLabel(key) {
    const labels = { ...((this.view.run && this.view.run.labels) || {}) };
    delete labels[key];
    await this.patch("labels", { labels }, $("#labels-error"));
  }

  /** Sets one field of the run; the run after, or null (the error shown in `errorNode`). */
  async patch(mask, body, errorNode) {
    fieldError(errorNode, "");
    const runId = this.view.runId;
    try {
      const reply = await api("PATCH", runPath(runId, `?updateMask=${mask}`), body);
      if (this.view.runId === runId) this.view.update(reply.run);
      return reply.run;
    } catch (err) {
      fieldError(errorNode, describe(err));
      return null;
    }
  }
}

/** Changes a RUNNING or PAUSED run's learning rate (and a GRPO run's temperature and beta)
 * from its next optimizer step: SetRunHyperparameters, the fields left empty unchanged. */
class HyperparameterForm {
  constructor(view) {
    this.view = view;
    this.form = $("#hp-form");
    this.form.addEventListener("submit", (e) => {
      e.preventDefault();
      this.submit();
    });
  }

  reset() {
    this.form.reset();
    $("#hp-card").hidden = true;
    fieldError($("#hp-error"), "");
    $("#hp-note").textContent = "";
  }

  /** Shown while the run can change; the current values (the latest episode's, else the
   * task's) as placeholders. */
  show(run, metrics) {
    const state = stateName(run);
    $("#hp-card").hidden = !(state === "RUNNING" || state === "PAUSED");
    const kind = taskKind(run.task);
    const task = (run.task && run.task[kind]) || {};
    for (const label of this.form.querySelectorAll("label[data-kind]")) label.hidden = label.dataset.kind !== kind;
    const current = {
      learningRate: metrics.learning_rate ?? task.learningRate,
      temperature: metrics.temperature ?? task.temperature,
      beta: metrics.beta ?? task.beta,
    };
    for (const [name, value] of Object.entries(current)) {
      this.form.elements[name].placeholder = value == null ? "unchanged" : precise(value);
    }
  }

  async submit() {
    const body = {};
    for (const name of ["learningRate", "temperature", "beta"]) {
      const input = this.form.elements[name];
      if (!input.closest("label").hidden && input.value.trim() !== "") body[name] = Number(input.value);
    }
    if (!Object.keys(body).length) {
      fieldError($("#hp-error"), "Fill in a value to change.");
      return;
    }
    fieldError($("#hp-error"), "");
    const runId = this.view.runId;
    try {
      const reply = await api("POST", runPath(runId, ":setHyperparameters"), body);
      if (this.view.runId !== runId) return;
      this.form.reset();
      const names = { learningRate: "learning rate", temperature: "temperature", beta: "beta" };
      const words = Object.entries(body).map(([k, v]) => `${names[k]} ${v}`);
      $("#hp-note").textContent = `${words.join(", ")} from the next step`;
      this.view.update(reply.run);
    } catch (err) {
      fieldError($("#hp-error"), describe(err));
    }
  }
}

export class RunView {
  constructor() {
    $("#pause").addEventListener("click", () => this.control("pause"));
    $("#resume").addEventListener("click", () => this.control("resume"));
    $("#stop").addEventListener("click", () => this.control("stop"));
    const speed = $("#speed");
    speed.addEventListener("input", () => ($("#speed-value").textContent = speedText(this.sliderSpeed())));
    speed.addEventListener("change", () => this.setSpeed(this.sliderSpeed()));
    $("#metric-picker").addEventListener("change", (e) => this.pick(e.target.value));
    this.labels = new RunLabels(this);
    this.hyperparameters = new HyperparameterForm(this);
  }

  /** The slider is logarithmic (0.1..20); its speed is rounded to two significant digits. */
  sliderSpeed() {
    return Math.min(20, Math.max(0.1, Number((10 ** Number($("#speed").value)).toPrecision(2))));
  }

  /**
   * Opens a run.
   * @param {string} runId
   * @param {number} since performance.now() when the view was asked for (0: the page's load)
   */
  async start(runId, since) {
    const opened = (this.opened = {}); // this opening, until the next start or stop
    this.runId = runId;
    this.run = null;
    this.final = false;
    this.pendingMotion = null; // [detail, episode] of the latest episode with a motion
    this.completionsEpisode = 0;
    this.latest = 0; // the latest episode the stream brought
    this.latestMetrics = {}; // its metrics
    this.zoom = null; // the zoom asked for last, while the chart shows a range
    this.metric = ""; // the metric charted ("": the reward)
    this.metricNames = new Set(); // every metric the episodes carry, as seen so far
    this.fetched = new Set(); // the metrics the whole run's buckets were asked with
    this.fetching = null; // the metrics being asked for now
    this.fork = null; // {runId, episode} of a fork's parent
    this.parent = null; // the parent's buckets up to the fork point
    this.timer = null;
    $("#run-view").hidden = false;
    $("#run-title").textContent = runId;
    $("#run-id").textContent = runId;
    for (const id of ["#run-task", "#run-detail", "#curve-note", "#avatar-note", "#completions-note"]) $(id).textContent = "";
    $("#run-error").hidden = true;
    $("#run-fork").hidden = true;
    $("#avatar-card").hidden = true;
    $("#completions-card").hidden = true;
    $("#completions").replaceChildren();
    $("#samples tbody").replaceChildren();
    $("#samples").hidden = true;
    this.completionsEpisode = 0;
    $("#metrics").replaceChildren();
    $("#metric-picker").replaceChildren(el("option", { value: "", textContent: "reward" }));
    this.labels.reset();
    this.hyperparameters.reset();
    this.counter(0);
    const curveNode = $("#curve");
    Object.assign(curveNode.dataset, { first: "0", episodes: "0", last: "0", gaps: "0", duplicates: "0", metric: "reward" });
    delete curveNode.dataset.points; // set again by the first drawing, with data-first-paint-ms
    delete curveNode.dataset.firstPaintMs;
    this.width = Curve.bucketsFor(curveNode);
    // The run and its curve at once (early.js asked for both as the page loaded): the first
    // drawing waits for the slower, not for both.
    const curveReply = api("GET", firstCurvePath(runId, this.width));
    curveReply.catch(() => {}); // awaited below, unless the run turns out not to exist
    let run;
    try {
      run = (await api("GET", runPath(runId))).run;
    } catch (err) {
      $("#run-title").textContent = "Run not found";
      this.showError(err.message);
      return;
    }
    if (this.opened !== opened) return; // left meanwhile
    if (run.forkFrom && run.forkFrom.runId) this.fork = { runId: run.forkFrom.runId, episode: num(run.forkFrom.episode) };
    this.update(run);
    if (this.fork) this.loadParent();
    if (run.task && run.task.grpo) $("#completions-card").hidden = false;
    let failed = null;
    try {
      this.buckets = CurveBuckets.fromReply(await curveReply);
    } catch (err) {
      this.buckets = new CurveBuckets(); // the live episodes still draw
      failed = err;
    }
    if (this.opened !== opened) return;
    this.makeCurve(since);
    this.curve.show(this.buckets, this.parent);
    if (failed) $("#curve-note").textContent = `cannot load the curve: ${failed.message}`;
    else this.curveNote();
    // The avatar's rig and clip once the curve is on the screen: they wait for the first paint,
    // the paint never waits for them (its episodes' motions wait in pendingMotion meanwhile).
    if (run.task && run.task.imitation) afterPaint(() => this.opened === opened && this.loadAvatar(runId));
    const covered = this.buckets.lastEpisode || num(run.episode);
    this.counter(covered);
    if (covered) {
      $("#stat-reward").textContent = fixed(num(run.reward));
      $("#stat-best").textContent = fixed(num(run.bestReward));
    }
    // The stream starts at the curve's last episode, which the chart already has: the one
    // episode replayed brings its reward, metrics and detail to the rest of the view. A fork's
    // episodes follow its fork point.
    const after = Math.max(this.fork ? this.fork.episode : 0, covered - 1);
    this.stream = new RunStream(runId, after, {
      episode: (episode, n) => this.episode(episode, n),
      caughtUp: () => {},
      finished: (final) => {
        this.final = true;
        this.update(final);
      },
      anomaly: () => {
        curveNode.dataset.gaps = String(this.stream.gaps);
        curveNode.dataset.duplicates = String(this.stream.duplicates);
      },
    });
    this.timer = setInterval(() => this.poll(), 1000);
  }

  stop() {
    this.runId = null;
    this.opened = this.zoom = null;
    clearInterval(this.timer);
    if (this.stream) this.stream.close();
    if (this.curve) this.curve.destroy();
    if (this.avatar) this.avatar.destroy();
    this.stream = this.curve = this.avatar = this.buckets = this.parent = null;
    link.set("idle", 0);
    $("#run-view").hidden = true;
  }

  /** A chart of the metric picked (the reward's band, mean and best, or the metric's mean). */
  makeCurve(since = 0) {
    if (this.curve) this.curve.destroy();
    this.curve = new Curve($("#curve"), {
      onZoom: (first, last) => this.zoomTo(first, last),
      onReset: () => this.zoomOut(),
      since,
      metric: this.metric,
      parentLabel: this.fork ? `parent ${this.fork.runId}` : "",
    });
  }

  /** Charts another metric ("": the reward), over the whole run. */
  pick(metric) {
    if (!this.curve || metric === this.metric) return;
    this.metric = metric;
    this.zoom = null;
    this.makeCurve();
    this.curve.show(this.buckets, this.parent);
    this.curveNote();
    if (this.fork) this.loadParent();
    this.want();
  }

  /** The metrics the whole run's buckets should hold: the one charted and the hyperparameters
   * the episodes carry (their changes are marked). */
  wanted() {
    const names = HYPERPARAMETERS.filter((name) => this.metricNames.has(name));
    if (this.metric && !names.includes(this.metric)) names.push(this.metric);
    return names.sort();
  }

  /** Asks for the whole run's curve again if it lacks a metric wanted; the live episodes
   * beyond it are kept. */
  async want() {
    const names = this.wanted();
    if (names.every((name) => this.fetched.has(name))) return;
    const key = names.join(",");
    if (this.fetching === key) return;
    this.fetching = key;
    const opened = this.opened;
    try {
      const reply = await api("GET", runPath(this.runId, `/curve?buckets=${this.width}&metrics=${encodeURIComponent(key)}`));
      if (this.opened !== opened || !this.curve) return;
      const fresh = CurveBuckets.fromReply(reply);
      fresh.appendAfter(this.buckets);
      this.buckets = fresh;
      this.fetched = new Set(names);
      if (this.zoom) this.zoomTo(this.zoom.first, this.zoom.last);
      else {
        this.curve.show(this.buckets, this.parent);
        this.curveNote();
      }
    } catch (err) {
      if (this.opened === opened) $("#curve-note").textContent = `cannot load the curve of ${key}: ${err.message}`;
    } finally {
      if (this.fetching === key) this.fetching = null;
    }
  }

  /** A fork's parent's curve up to the fork point (with the metric charted), drawn dimmed
   * before the run's own. */
  async loadParent() {
    const { runId, episode } = this.fork;
    const metric = this.metric;
    const opened = this.opened;
    const query = `buckets=${this.width}&lastEpisode=${episode}${metric ? `&metrics=${encodeURIComponent(metric)}` : ""}`;
    try {
      const reply = await api("GET", runPath(runId, `/curve?${query}`));
      if (this.opened !== opened || this.metric !== metric) return;
      this.parent = CurveBuckets.fromReply(reply);
      if (this.curve && !this.zoom) {
        this.curve.show(this.buckets, this.parent);
        this.curveNote();
      }
    } catch (err) {
      if (this.opened === opened) $("#run-fork-note").textContent = ` (its curve: ${err.message})`;
    }
  }

  /** Shows episodes first..last in finer buckets (a drag across the chart). While zoomed in,
   * live episodes go on into the whole run's buckets, drawn again on zooming out. */
  async zoomTo(first, last) {
    if (this.fork) first = Math.max(first, this.fork.episode + 1); // the parent's are not this run's
    if (last < first) return;
    const zoom = (this.zoom = { first, last });
    $("#curve-note").textContent = `loading episodes ${first}\u2013${last}\u2026`;
    const names = this.wanted();
    const metrics = names.length ? `&metrics=${encodeURIComponent(names.join(","))}` : "";
    const query = `buckets=${this.width}&firstEpisode=${first}&lastEpisode=${last}${metrics}`;
    try {
      const reply = await api("GET", runPath(this.runId, `/curve?${query}`));
      if (this.zoom !== zoom || !this.curve) return; // zoomed elsewhere or out meanwhile
      this.curve.show(CurveBuckets.fromReply(reply));
      this.curveNote();
    } catch (err) {
      if (this.zoom !== zoom || !this.curve) return;
      this.zoom = null; // the chart still shows the whole run, and follows it again
      this.curve.show(this.buckets, this.parent);
      $("#curve-note").textContent = `cannot zoom in: ${err.message}`;
    }
  }

  /** Shows the whole run again (a double click on the chart). */
  zoomOut() {
    if (!this.zoom || !this.curve) return;
    this.zoom = null;
    this.curve.show(this.buckets, this.parent);
    this.curveNote();
  }

  /** What the chart shows and how to change it. */
  curveNote() {
    const shown = this.curve.shown;
    if (!shown.length && !this.zoom) {
      $("#curve-note").textContent = "no episodes yet";
      return;
    }
    const per = shown.length ? (shown.lastEpisode - shown.firstEpisode + 1) / shown.length : 1;
    let what = "one point per episode";
    if (per >= 1.5 && this.metric) what = `line: the mean ${this.metric} of ~${Math.round(per)} episodes`;
    else if (per >= 1.5) what = `band: min\u2013max of ~${Math.round(per)} episodes, line: their mean`;
    const parts = [what];
    if (this.fork && !this.zoom) parts.push(`dimmed: the parent up to episode ${this.fork.episode}`);
    parts.push(this.zoom ? `episodes ${shown.firstEpisode}\u2013${shown.lastEpisode}, double-click to zoom out` : "drag to zoom in");
    $("#curve-note").textContent = parts.join(" \u00b7 ");
  }

  async loadAvatar(runId) {
    try {
      const motion = await api("GET", runPath(runId, "/motion"));
      if (this.runId !== runId) return;
      this.avatar = new Avatar($("#avatar"), motion.rig, motion.clip);
      if (this.pendingMotion) this.avatar.setLearned(...this.pendingMotion);
      $("#avatar-card").hidden = false;
      this.motionNote(this.latest);
    } catch (err) {
      $("#avatar-note").textContent = `no avatar: ${err.message}`;
    }
  }

  counter(n) {
    const node = $("#episode-counter");
    const max = this.run ? num(this.run.config && this.run.config.maxEpisodes) : 0;
    node.dataset.episode = String(n);
    node.textContent = max ? `${n} / ${max}` : String(n);
  }

  episode(episode, n) {
    if (n > this.buckets.lastEpisode) {
      this.buckets.add(n, num(episode.reward), num(episode.bestReward), episode.metrics);
      const merge = this.buckets.length > 4 * this.width;
      if (merge) this.buckets.compact(this.width);
      if (!this.zoom) {
        this.curve.changed();
        if (merge || this.buckets.length === 1) this.curveNote();
      }
    }
    this.latest = n;
    this.counter(n);
    $("#stat-reward").textContent = fixed(num(episode.reward));
    $("#stat-best").textContent = fixed(num(episode.bestReward));
    // A long run keeps the detail of a sample of its episodes. For one without, the avatar and
    // the completions keep the latest they have, under that episode's number, and say that
    // this one kept none: never another episode's detail shown as this one's.
    if (episode.imitation) {
      this.pendingMotion = [episode.imitation, n];
      if (this.avatar) this.avatar.setLearned(episode.imitation, n);
    }
    if (this.avatar) this.motionNote(n);
    if (episode.grpo) this.completions(episode.grpo, n);
    else if (this.run && this.run.task && this.run.task.grpo) this.completionsNote(n);
    if (episode.metrics) this.metrics(episode.metrics);
  }

  /** The avatar's note: which episode's motion it shows, if the latest episode kept none. */
  motionNote(latest) {
    const shown = this.pendingMotion ? this.pendingMotion[1] : 0;
    let note = shown ? `episode ${shown}` : "no learned motion yet";
    if (latest && shown !== latest) {
      // Trainers send a motion every few episodes (and the store may thin them out).
      note = shown
        ? `showing episode ${shown}, the latest with a motion (episode ${latest} has none)`
        : `episode ${latest} has no motion`;
    }
    $("#avatar-note").textContent = note;
  }

  /** A GRPO episode's detail: its samples as a table (thumbnail, answer, expected answer,
   * reward), or, from a trainer that sends none, its completions as a list. Model output and
   * dataset text are shown as text, never as markup. */
  completions(grpo, n) {
    const samples = grpo.samples || [];
    const texts = grpo.sampleCompletions || [];
    $("#samples tbody").replaceChildren(...samples.map(sampleRow));
    $("#samples").hidden = !samples.length;
    $("#samples").dataset.episode = String(n);
    $("#completions").replaceChildren(...(samples.length ? [] : texts.map((text) => el("li", {}, el("pre", { textContent: text })))));
    $("#completions-title").textContent = samples.length || !texts.length ? "Samples" : "Sample completions";
    this.completionsEpisode = n;
    this.completionsNote(n);
  }

  /** The completions' note: which episode they are from, if the latest episode kept none. */
  completionsNote(latest) {
    const shown = this.completionsEpisode;
    let note = `episode ${shown}`;
    if (shown !== latest) {
      note = `episode ${latest}: no samples kept for this episode` + (shown ? ` (showing episode ${shown})` : "");
    }
    $("#completions-note").textContent = note;
  }

  /** The latest episode's metrics: listed, offered to the chart's picker, and the
   * hyperparameters among them asked for to mark their changes. */
  metrics(metrics) {
    this.latestMetrics = metrics;
    const keys = Object.keys(metrics).sort();
    const rows = keys.map((key) => el("div", {}, el("dt", { title: key }, ...breakable(key)), el("dd", { textContent: precise(metrics[key]) })));
    $("#metrics").replaceChildren(...rows);
    const fresh = keys.filter((key) => !this.metricNames.has(key));
    if (!fresh.length) return;
    for (const key of fresh) this.metricNames.add(key);
    const picker = $("#metric-picker");
    const names = [...this.metricNames].sort();
    picker.replaceChildren(el("option", { value: "", textContent: "reward" }), ...names.map((name) => el("option", { value: name, textContent: name })));
    picker.value = this.metric;
    if (this.run) this.hyperparameters.show(this.run, metrics);
    if (fresh.some((key) => HYPERPARAMETERS.includes(key))) this.want();
  }

  async poll() {
    const runId = this.runId;
    try {
      const run = (await api("GET", runPath(runId))).run;
      // The stream's end is the run's last word: an answer to a poll sent before it (a slow
      // gateway) must not bring back the state and the controls of a run still going.
      if (this.runId === runId && !this.final) this.update(run);
      if (this.final || FINAL.has(stateName(run))) clearInterval(this.timer);
    } catch (err) {
      $("#run-detail").textContent = `cannot reach the gateway: ${err.message}`;
    }
  }

  update(run) {
    this.run = run;
    const state = stateName(run);
    $("#run-title").textContent = run.displayName || `Run ${run.id}`;
    $("#run-task").textContent = taskText(run.task);
    badge($("#run-state"), run);
    $("#run-detail").textContent = run.stateDetail || "";
    this.labels.show(run);
    this.hyperparameters.show(run, this.latestMetrics);
    if (this.fork) {
      const parent = $("#run-parent");
      parent.href = `#/runs/${encodeURIComponent(this.fork.runId)}`;
      parent.textContent = this.fork.runId;
      $("#run-fork-episode").textContent = String(this.fork.episode);
      $("#run-fork").hidden = false;
    }
    const checkpoint = num(run.checkpointEpisode);
    const download = $("#download-model");
    download.hidden = !checkpoint;
    if (checkpoint) {
      download.href = downloadUrl(run.id, checkpoint);
      download.dataset.episode = String(checkpoint);
      download.textContent = `Download model (episode ${checkpoint})`;
    }
    this.counter(num($("#episode-counter").dataset.episode));
    const active = !FINAL.has(state);
    $("#pause").disabled = state !== "RUNNING";
    $("#resume").disabled = state !== "PAUSED";
    $("#stop").disabled = !active;
    $("#speed").disabled = !active;
    if (document.activeElement !== $("#speed")) {
      $("#speed").value = String(Math.log10(num(run.speed) || 1));
      $("#speed-value").textContent = speedText(run.speed);
    }
    if (state === "ERROR") this.showError(run.errorMessage || "The run failed.");
  }

  showError(message) {
    const banner = $("#run-error");
    banner.textContent = message;
    banner.hidden = false;
  }

  async control(action) {
    try {
      this.update((await api("POST", runPath(this.runId, `:${action}`))).run);
    } catch (err) {
      $("#run-detail").textContent = err.message;
    }
  }

  async setSpeed(speed) {
    try {
      this.update((await api("POST", runPath(this.runId, ":setSpeed"), { speed })).run);
    } catch (err) {
      $("#run-detail").textContent = err.message;
    }
  }
}

// Trainwire's page: the runs table, the New-run form and the run view.
//
// It talks to the gateway's JSON API (the protobuf JSON mapping: int64 fields arrive as strings,
// fields at their default are left out) and follows a run over server-sent events. Requests go
// through `api()` and streams through `eventsUrl()`: the one place each to add a bearer token.
//
// The run view draws a run of any length in about the same time: it loads the run's curve in
// buckets (about one per pixel of the chart), then follows the event stream from the curve's
// last episode on, adding live episodes to the chart and merging them as they pile up.

import { Avatar, Curve, CurveBuckets } from "./draw.js";

// -- the API ---------------------------------------------------------------------------------

class ApiError extends Error {
  constructor(error) {
    super(error.message || `HTTP ${error.code}`);
    this.error = error;
  }

  /** The message and every field violation of a google.rpc.BadRequest detail. */
  describe() {
    const lines = [this.message];
    for (const detail of this.error.details || []) {
      for (const v of detail.fieldViolations || []) lines.push(`\u2022 ${v.field}: ${v.description}`);
    }
    return lines.join("\n");
  }
}

// A gateway started with --auth-tokens answers 401 without a token: the page asks for one once,
// keeps it for this tab only (sessionStorage, gone when the tab closes) and sends it on every
// request and stream from then on.
const TOKEN_KEY = "trainwire.token";

function storedToken() {
  try {
    return sessionStorage.getItem(TOKEN_KEY) || "";
  } catch {
    return "";
  }
}

/** Headers every request carries: the bearer token, once there is one. */
function authHeaders() {
  const token = storedToken();
  return token ? { Authorization: `Bearer ${token}` } : {};
}

/** Asks for a token after a 401 (unless another request already got a new one since `sent`
 * went out); true when there is one to retry with. */
function askToken(sent, error) {
  const now = storedToken();
  if (now && now !== sent) return true;
  const why = sent ? "The gateway did not accept the token." : "This gateway needs a token.";
  const token = (window.prompt(`${why}\n${error.message || ""}\n\nToken:`) || "").trim();
  if (!token) return false;
  try {
    sessionStorage.setItem(TOKEN_KEY, token);
  } catch {
    return false;
  }
  return true;
}

async function api(method, path, body) {
  for (let attempt = 0; ; attempt += 1) {
    const sent = storedToken();
    const init = { method, headers: { Accept: "application/json", ...authHeaders() } };
    if (method === "POST") {
      init.headers["Content-Type"] = "application/json";
      init.body = JSON.stringify(body || {});
    }
    const response = await fetch(path, init);
    const data = await response.json().catch(() => ({}));
    if (response.ok) return data;
    const error = data.error || { code: response.status, message: response.statusText };
    if (response.status === 401 && attempt < 3 && askToken(sent, error)) continue;
    throw new ApiError(error);
  }
}

/** The event stream of a run after an episode. EventSource sends no headers, so the token
 * travels in the URL (RFC 6750's access_token; the gateway takes it on this route only, keeps
 * no access log and the page sends no Referer). */
function eventsUrl(runId, after) {
  const token = storedToken();
  const auth = token ? `&access_token=${encodeURIComponent(token)}` : "";
  return `/v1/runs/${encodeURIComponent(runId)}/events?after=${after}${auth}`;
}

/** The download of a run's checkpoint (the tar of the trained model and its training state).
 * A link sends no headers either: the token travels like the event stream's. */
function downloadUrl(runId, episode) {
  const token = storedToken();
  const auth = token ? `?access_token=${encodeURIComponent(token)}` : "";
  return `/v1/runs/${encodeURIComponent(runId)}/checkpoints/${episode}:download${auth}`;
}

// -- small helpers ---------------------------------------------------------------------------

const $ = (selector, root = document) => root.querySelector(selector);
const FINAL = new Set(["DONE", "STOPPED", "ERROR"]);

function el(tag, props = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(props)) {
    if (key === "dataset") Object.assign(node.dataset, value);
    else if (key === "class") node.className = value;
    else node[key] = value;
  }
  node.append(...children);
  return node;
}

const stateName = (run) => (run.state || "STATE_UNSPECIFIED").replace(/^STATE_/, "");
const num = (value) => Number(value || 0);
const fixed = (value, digits = 3) => (value === undefined ? "\u2013" : Number(value).toFixed(digits));

function speedText(speed) {
  const s = num(speed) || 1;
  return `\u00d7${s < 1 ? s.toFixed(2) : s.toFixed(1)}`;
}

function ageText(createTime) {
  if (!createTime) return "";
  const seconds = Math.max(0, (Date.now() - Date.parse(createTime)) / 1000);
  if (seconds < 60) return `${Math.floor(seconds)} s`;
  if (seconds < 3600) return `${Math.floor(seconds / 60)} min`;
  if (seconds < 86400) return `${Math.floor(seconds / 3600)} h`;
  return `${Math.floor(seconds / 86400)} d`;
}

function taskText(task) {
  if (task && task.imitation) {
    const t = task.imitation;
    const rig = t.rigName || (t.rig ? t.rig.name || "custom rig" : "stickman");
    const clip = t.clipName || (t.clip ? t.clip.name || "custom clip" : "?");
    return `imitation \u00b7 ${rig} / ${clip}`;
  }
  if (task && task.grpo) return `grpo \u00b7 ${task.grpo.modelPath || "?"}`;
  return "?";
}

function badge(node, run) {
  const state = stateName(run);
  node.textContent = state;
  node.dataset.state = state;
}

/** The link indicator in the header: connecting, live, reconnecting (with a count), finished. */
const link = {
  set(state, reconnects) {
    const node = $("#link");
    node.dataset.state = state;
    node.dataset.reconnects = String(reconnects);
    const words = { connecting: "connecting\u2026", live: "live", reconnecting: "reconnecting\u2026", finished: "finished", idle: "" };
    node.textContent = words[state] + (reconnects ? ` \u00b7 ${reconnects} reconnect${reconnects > 1 ? "s" : ""}` : "");
  },
};

// -- runs view -------------------------------------------------------------------------------

class RunsView {
  constructor() {
    this.timer = null;
    this.form = $("#new-run");
    this.form.addEventListener("submit", (e) => this.submit(e));
    this.form.addEventListener("change", (e) => {
      if (e.target.name === "kind") this.showKind();
    });
    this.fillClips();
  }

  async fillClips() {
    const select = this.form.elements.clip;
    try {
      const motions = await api("GET", "/v1/motions");
      select.replaceChildren(...motions.clips.map((name) => el("option", { value: name, textContent: name })));
    } catch (err) {
      select.replaceChildren(el("option", { value: "wave", textContent: "wave" }));
    }
  }

  showKind() {
    const kind = this.form.elements.kind.value;
    for (const set of this.form.querySelectorAll("fieldset[data-kind]")) set.hidden = set.dataset.kind !== kind;
    this.form.elements.episodes.value = kind === "grpo" ? 20 : 300;
  }

  start() {
    $("#runs-view").hidden = false;
    link.set("idle", 0);
    this.refresh();
    this.timer = setInterval(() => this.refresh(), 1000);
  }

  stop() {
    clearInterval(this.timer);
    $("#runs-view").hidden = true;
  }

  async refresh() {
    try {
      const reply = await api("GET", "/v1/runs?pageSize=100");
      this.render(reply.runs || []);
      $("#runs-status").textContent = "";
    } catch (err) {
      $("#runs-status").textContent = `cannot list runs: ${err.message}`;
    }
  }

  render(runs) {
    const rows = runs.map((run) => {
      const episode = num(run.episode);
      const max = num(run.config && run.config.maxEpisodes);
      const share = max ? Math.min(100, (100 * episode) / max) : 0;
      const state = el("span", { class: "badge" });
      badge(state, run);
      const fill = el("span");
      fill.style.width = `${share}%`;
      const row = el(
        "tr",
        { dataset: { runId: run.id, state: stateName(run), episode: String(episode) } },
        el("td", {}, el("a", { href: `#/runs/${run.id}`, textContent: run.displayName || run.id })),
        el("td", { class: "muted", textContent: taskText(run.task) }),
        el("td", {}, state),
        el("td", {}, el("div", { class: "progress" }, el("div", { class: "bar" }, fill), `${episode}/${max}`)),
        el("td", { class: "num", textContent: episode ? fixed(run.reward) : "\u2013" }),
        el("td", { class: "num", textContent: episode ? fixed(run.bestReward) : "\u2013" }),
        el("td", { class: "num", textContent: speedText(run.speed) }),
        el("td", { class: "num muted", textContent: ageText(run.createTime) }),
      );
      row.addEventListener("click", (e) => {
        if (e.target.tagName !== "A") location.hash = `#/runs/${run.id}`;
      });
      return row;
    });
    $("#runs tbody").replaceChildren(...rows);
    $("#runs-empty").hidden = runs.length > 0;
  }

  async submit(event) {
    event.preventDefault();
    const f = this.form.elements;
    const kind = f.kind.value;
    const task =
      kind === "grpo"
        ? {
            grpo: {
              modelPath: f.model.value.trim(),
              datasetPath: f.dataset.value.trim(),
              rewardFunctions: f.rewards.value.split(",").map((s) => s.trim()).filter(Boolean),
            },
          }
        : { imitation: { rigName: "stickman", clipName: f.clip.value } };
    const request = {
      task,
      config: { maxEpisodes: Number(f.episodes.value), seed: String(Math.trunc(Number(f.seed.value) || 0)) },
      episodesPerSecond: Number(f.rate.value),
      displayName: f.name.value.trim(),
      requestId: crypto.randomUUID ? crypto.randomUUID() : `${Date.now()}-${Math.random()}`,
    };
    const error = $("#form-error");
    error.hidden = true;
    try {
      const reply = await api("POST", "/v1/runs", request);
      location.hash = `#/runs/${reply.run.id}`;
    } catch (err) {
      error.textContent = err instanceof ApiError ? err.describe() : String(err);
      error.hidden = false;
    }
  }
}

// -- run view --------------------------------------------------------------------------------

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

class RunView {
  constructor() {
    $("#pause").addEventListener("click", () => this.control("pause"));
    $("#resume").addEventListener("click", () => this.control("resume"));
    $("#stop").addEventListener("click", () => this.control("stop"));
    const speed = $("#speed");
    speed.addEventListener("input", () => ($("#speed-value").textContent = speedText(this.sliderSpeed())));
    speed.addEventListener("change", () => this.setSpeed(this.sliderSpeed()));
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
    this.zoom = null; // the zoom asked for last, while the chart shows a range
    this.timer = null;
    $("#run-view").hidden = false;
    $("#run-title").textContent = runId;
    $("#run-id").textContent = runId;
    for (const id of ["#run-task", "#run-detail", "#curve-note", "#avatar-note", "#completions-note"]) $(id).textContent = "";
    $("#run-error").hidden = true;
    $("#avatar-card").hidden = true;
    $("#completions-card").hidden = true;
    $("#completions").replaceChildren();
    $("#metrics").replaceChildren();
    this.counter(0);
    const curveNode = $("#curve");
    Object.assign(curveNode.dataset, { first: "0", episodes: "0", last: "0", gaps: "0", duplicates: "0" });
    delete curveNode.dataset.points; // set again by the first drawing, with data-first-paint-ms
    delete curveNode.dataset.firstPaintMs;
    this.width = Curve.bucketsFor(curveNode);
    const path = `/v1/runs/${encodeURIComponent(runId)}`;
    // The run and its curve at once: the first drawing waits for the slower, not for both.
    const curveReply = api("GET", `${path}/curve?buckets=${this.width}`);
    curveReply.catch(() => {}); // awaited below, unless the run turns out not to exist
    let run;
    try {
      run = (await api("GET", path)).run;
    } catch (err) {
      $("#run-title").textContent = "Run not found";
      this.showError(err.message);
      return;
    }
    if (this.opened !== opened) return; // left meanwhile
    this.update(run);
    if (run.task && run.task.imitation) this.loadAvatar(runId);
    if (run.task && run.task.grpo) $("#completions-card").hidden = false;
    let failed = null;
    try {
      this.buckets = CurveBuckets.fromReply(await curveReply);
    } catch (err) {
      this.buckets = new CurveBuckets(); // the live episodes still draw
      failed = err;
    }
    if (this.opened !== opened) return;
    this.curve = new Curve(curveNode, {
      onZoom: (first, last) => this.zoomTo(first, last),
      onReset: () => this.zoomOut(),
      since,
    });
    this.curve.show(this.buckets);
    if (failed) $("#curve-note").textContent = `cannot load the curve: ${failed.message}`;
    else this.curveNote();
    const covered = this.buckets.lastEpisode || num(run.episode);
    this.counter(covered);
    if (covered) {
      $("#stat-reward").textContent = fixed(num(run.reward));
      $("#stat-best").textContent = fixed(num(run.bestReward));
    }
    // The stream starts at the curve's last episode, which the chart already has: the one
    // episode replayed brings its reward, metrics and detail to the rest of the view.
    this.stream = new RunStream(runId, Math.max(0, covered - 1), {
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
    this.stream = this.curve = this.avatar = this.buckets = null;
    link.set("idle", 0);
    $("#run-view").hidden = true;
  }

  /** Shows episodes first..last in finer buckets (a drag across the chart). While zoomed in,
   * live episodes go on into the whole run's buckets, drawn again on zooming out. */
  async zoomTo(first, last) {
    const zoom = (this.zoom = { first, last });
    $("#curve-note").textContent = `loading episodes ${first}\u2013${last}\u2026`;
    const query = `buckets=${this.width}&firstEpisode=${first}&lastEpisode=${last}`;
    try {
      const reply = await api("GET", `/v1/runs/${encodeURIComponent(this.runId)}/curve?${query}`);
      if (this.zoom !== zoom || !this.curve) return; // zoomed elsewhere or out meanwhile
      this.curve.show(CurveBuckets.fromReply(reply));
      this.curveNote();
    } catch (err) {
      if (this.zoom !== zoom || !this.curve) return;
      this.zoom = null; // the chart still shows the whole run, and follows it again
      this.curve.changed();
      $("#curve-note").textContent = `cannot zoom in: ${err.message}`;
    }
  }

  /** Shows the whole run again (a double click on the chart). */
  zoomOut() {
    if (!this.zoom || !this.curve) return;
    this.zoom = null;
    this.curve.show(this.buckets);
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
    const what = per < 1.5 ? "one point per episode" : `band: min\u2013max of ~${Math.round(per)} episodes, line: their mean`;
    const how = this.zoom ? `episodes ${shown.firstEpisode}\u2013${shown.lastEpisode}, double-click to zoom out` : "drag to zoom in";
    $("#curve-note").textContent = `${what} \u00b7 ${how}`;
  }

  async loadAvatar(runId) {
    try {
      const motion = await api("GET", `/v1/runs/${encodeURIComponent(runId)}/motion`);
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
      this.buckets.add(n, num(episode.reward), num(episode.bestReward));
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
    if (episode.grpo) this.completions(episode.grpo.sampleCompletions || [], n);
    else if (this.run && this.run.task && this.run.task.grpo) this.completionsNote(n);
    if (episode.metrics) this.metrics(episode.metrics);
  }

  /** The avatar's note: which episode's motion it shows, if the latest episode kept none. */
  motionNote(latest) {
    const shown = this.pendingMotion ? this.pendingMotion[1] : 0;
    let note = shown ? `episode ${shown}` : "no learned motion yet";
    if (latest && shown !== latest) {
      note = `episode ${latest}: no motion kept for this episode` + (shown ? ` (showing episode ${shown})` : "");
    }
    $("#avatar-note").textContent = note;
  }

  completions(texts, n) {
    $("#completions").replaceChildren(...texts.map((text) => el("li", {}, el("pre", { textContent: text }))));
    this.completionsEpisode = n;
    this.completionsNote(n);
  }

  /** The completions' note: which episode they are from, if the latest episode kept none. */
  completionsNote(latest) {
    const shown = this.completionsEpisode;
    let note = `episode ${shown}`;
    if (shown !== latest) {
      note = `episode ${latest}: no completions kept for this episode` + (shown ? ` (showing episode ${shown})` : "");
    }
    $("#completions-note").textContent = note;
  }

  metrics(metrics) {
    const rows = Object.keys(metrics)
      .sort()
      .map((key) => el("div", {}, el("dt", { textContent: key }), el("dd", { textContent: Number(metrics[key]).toPrecision(4) })));
    $("#metrics").replaceChildren(...rows);
  }

  async poll() {
    const runId = this.runId;
    try {
      const run = (await api("GET", `/v1/runs/${encodeURIComponent(runId)}`)).run;
      if (this.runId === runId) this.update(run);
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
    const checkpoint = num(run.checkpointEpisode);
    const link = $("#download-model");
    link.hidden = !checkpoint;
    if (checkpoint) {
      link.href = downloadUrl(run.id, checkpoint);
      link.dataset.episode = String(checkpoint);
      link.textContent = `Download model (episode ${checkpoint})`;
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
      this.update((await api("POST", `/v1/runs/${encodeURIComponent(this.runId)}:${action}`)).run);
    } catch (err) {
      $("#run-detail").textContent = err.message;
    }
  }

  async setSpeed(speed) {
    try {
      this.update((await api("POST", `/v1/runs/${encodeURIComponent(this.runId)}:setSpeed`, { speed })).run);
    } catch (err) {
      $("#run-detail").textContent = err.message;
    }
  }
}

// -- routing ---------------------------------------------------------------------------------

const runsView = new RunsView();
const runView = new RunView();
let current = null;

function route(event) {
  if (current) current.stop();
  const match = location.hash.match(/^#\/runs\/([^/]+)$/);
  if (match) {
    current = runView;
    // The page's first view counts from the navigation that loaded it (performance.now()'s 0).
    runView.start(decodeURIComponent(match[1]), event ? performance.now() : 0);
  } else {
    current = runsView;
    runsView.start();
  }
}

window.addEventListener("hashchange", route);
route();

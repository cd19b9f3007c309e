// The pictures of runs: a run's learning curve and several runs' curves overlaid (uPlot) and,
// for imitation runs, the avatar (canvas).
//
// A curve draws buckets of episodes (`CurveBuckets`): per bucket a band from the smallest to
// the largest reward, the mean reward as a line and the running best reward, or the mean of
// one metric of the episodes. However long the run, the chart holds a bounded number of
// buckets: the gateway summarises the history (GET /v1/runs/{id}/curve) and live episodes are
// merged once they pile up. A forked run's chart also draws its parent's curve up to the fork
// point, dimmed, and a run's chart marks where a hyperparameter changed. The run chart's
// element carries, after every drawing:
//
//   data-first, data-episodes  the first and the last episode the chart covers (data-last
//                              repeats data-episodes);
//   data-points                how many buckets it draws;
//   data-metric                what it draws: "reward" or a metric's name;
//   data-metric-points         the buckets with a value of that (the reward: all of them);
//   data-parent-points         the parent's buckets drawn (0 unless a fork);
//   data-markers               the hyperparameter changes marked;
//   data-first-paint-ms        milliseconds from opening the view to its first drawing (set once);
//   data-drawn-at              performance.now() of the latest drawing,
//
// and the comparison chart's `data-runs` (runs with a point drawn), `data-points` (points drawn
// in all) and `data-metric`, so people and tests can check them.

import { bucketsFor } from "./early.js";
import uPlot from "./vendor/uplot/uPlot.esm.js";

const COLOURS = {
  band: "rgba(147, 197, 253, 0.45)",
  edge: "#93c5fd",
  mean: "#2563eb",
  best: "#f59e0b",
  parent: "rgba(100, 116, 139, 0.45)",
  target: "#cbd5e1",
  learned: "#2563eb",
};

/** Colours of the runs a comparison overlays, in order (then again). */
export const RUN_COLOURS = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#ca8a04", "#db2777", "#4b5563", "#65a30d"];

/** The metrics a run's episodes carry its live hyperparameters in. */
export const HYPERPARAMETERS = ["learning_rate", "temperature", "beta"];

const fmt = (digits) => (u, v) => (v == null ? "\u2013" : v.toFixed(digits));
const sig = (u, v) => (v == null ? "\u2013" : Number(v).toPrecision(4));
const GRID = { stroke: "#eef0f3" };

/**
 * Contiguous buckets of a run's episodes, in order, as parallel arrays: a bucket covers
 * episodes first[i]..last[i] and holds their smallest, largest and mean reward, the running
 * best reward at its last episode (a CurveBucket of the gateway's API) and, in `metrics`, a
 * column per metric of the episodes' means (null where a bucket has none).
 */
export class CurveBuckets {
  constructor() {
    this.first = [];
    this.last = [];
    this.min = [];
    this.max = [];
    this.mean = [];
    this.best = [];
    this.metrics = {};
  }

  /** Buckets of a GetRunCurveResponse in the protobuf JSON mapping (int64 fields are strings,
   * a field at 0 is left out, an empty run is `{}`). */
  static fromReply(reply) {
    const buckets = new CurveBuckets();
    for (const b of reply.buckets || []) {
      const first = Number(b.firstEpisode || 0);
      const [min, max, mean, best] = [b.rewardMin, b.rewardMax, b.rewardMean, b.bestReward].map((v) => Number(v || 0));
      buckets.push(first, Number(b.lastEpisode || first), min, max, mean, best, b.metricsMean);
    }
    return buckets;
  }

  get length() {
    return this.first.length;
  }

  /** The first episode covered (0 when empty). */
  get firstEpisode() {
    return this.length ? this.first[0] : 0;
  }

  /** The last episode covered (0 when empty). */
  get lastEpisode() {
    return this.length ? this.last[this.length - 1] : 0;
  }

  push(first, last, min, max, mean, best, metrics = {}) {
    const n = this.length;
    this.first.push(first);
    this.last.push(last);
    this.min.push(min);
    this.max.push(max);
    this.mean.push(mean);
    this.best.push(best);
    for (const [name, value] of Object.entries(metrics || {})) {
      if (!this.metrics[name]) this.metrics[name] = new Array(n).fill(null);
      this.metrics[name].push(Number(value));
    }
    for (const column of Object.values(this.metrics)) if (column.length === n) column.push(null);
  }

  /** Appends one episode (its reward, running best and metrics) as a bucket of its own. */
  add(episode, reward, best, metrics) {
    this.push(episode, episode, reward, reward, reward, best, metrics);
  }

  /** Appends the buckets of `other` that follow this one's last episode (the live episodes a
   * fresh curve from the gateway does not cover yet). */
  appendAfter(other) {
    const names = Object.keys(other.metrics);
    for (let i = 0; i < other.length; i += 1) {
      if (other.first[i] <= this.lastEpisode) continue;
      const metrics = {};
      for (const name of names) if (other.metrics[name][i] != null) metrics[name] = other.metrics[name][i];
      this.push(other.first[i], other.last[i], other.min[i], other.max[i], other.mean[i], other.best[i], metrics);
    }
  }

  /**
   * Merges neighbours so that about `target` buckets remain (at most 2 * target + 1): a bucket
   * absorbs the next while both together span no more than the covered range / target
   * episodes. Means are weighted by episodes (a metric's by the episodes of the buckets that
   * have it); the best is the later bucket's.
   */
  compact(target) {
    const n = this.length;
    if (!n) return;
    const metrics = Object.values(this.metrics);
    const span = Math.ceil((this.lastEpisode - this.firstEpisode + 1) / Math.max(1, target));
    let w = 0; // buckets kept so far; bucket w - 1 is the one growing
    for (let r = 0; r < n; r += 1) {
      const size = this.last[r] - this.first[r] + 1;
      const open = w - 1;
      if (w && this.last[r] - this.first[open] + 1 <= span) {
        const had = this.last[open] - this.first[open] + 1;
        this.mean[open] = (this.mean[open] * had + this.mean[r] * size) / (had + size);
        for (const column of metrics) {
          if (column[open] == null) column[open] = column[r];
          else if (column[r] != null) column[open] = (column[open] * had + column[r] * size) / (had + size);
        }
        this.last[open] = this.last[r];
        this.min[open] = Math.min(this.min[open], this.min[r]);
        this.max[open] = Math.max(this.max[open], this.max[r]);
        this.best[open] = this.best[r];
      } else {
        for (const column of [this.first, this.last, this.min, this.max, this.mean, this.best, ...metrics]) column[w] = column[r];
        w += 1;
      }
    }
    for (const column of [this.first, this.last, this.min, this.max, this.mean, this.best, ...metrics]) column.length = w;
  }

  /** Each bucket's middle episode, where the charts draw it. */
  middles() {
    return this.first.map((f, i) => (f + this.last[i]) / 2);
  }

  /** The columns uPlot draws: each bucket at its middle episode; reward min, max, mean, best.
   * Copies, so that buckets added before the next drawing never show half-way in the chart. */
  columns() {
    return [this.middles(), this.min.slice(), this.max.slice(), this.mean.slice(), this.best.slice()];
  }

  /** The means of a metric ("" or "reward": the reward's), null where a bucket has none. */
  values(metric) {
    if (!metric || metric === "reward") return this.mean.slice();
    const column = this.metrics[metric];
    return column ? column.slice() : new Array(this.length).fill(null);
  }
}

const same = (a, b) => Math.abs(a - b) <= 1e-9 * Math.max(Math.abs(a), Math.abs(b), 1e-300);
const between = (a, m, c) => !same(a, m) && !same(m, c) && (a < m) === (m < c);

/** How many times the slope on either side of it a move's slope must differ by to be a change. */
const JUMP = 1;
/** The slopes on each side of a move that say how the value moves there (their median). */
const SIDE = 3;

const median = (values) => {
  const sorted = [...values].sort((a, b) => a - b);
  const half = sorted.length >> 1;
  return sorted.length % 2 ? sorted[half] : (sorted[half - 1] + sorted[half]) / 2;
};

/**
 * Where a run's hyperparameters changed, from the means of their metrics per bucket: a
 * change between two buckets happened at the later one's first episode; a bucket whose mean
 * lies between its neighbours' holds the change somewhere inside it.
 *
 * A value may follow a schedule: the trainer reports the learning rate each step used, and
 * TRL's decays at every step. So a move is a change only where its slope (per episode) differs
 * by more than JUMP times from how the value moves on each side of it (the median slope of up
 * to SIDE neighbouring moves): a schedule moves alike from bucket to bucket, a change stands
 * out. A value that holds still between changes has slopes of 0 around each of its moves.
 * @param {CurveBuckets} buckets
 * @param {string[]} names the metrics to look at
 * @returns {{name: string, from: number, to: number, first: number, last: number}[]} the
 *   changes, in episode order: from one value to the next, within episodes first..last
 */
export function hyperparameterChanges(buckets, names = HYPERPARAMETERS) {
  const changes = [];
  const middles = buckets.middles();
  for (const name of names) {
    const column = buckets.metrics[name];
    if (!column) continue;
    const at = []; // the buckets with a value
    column.forEach((value, i) => value != null && at.push(i));
    const value = (k) => column[at[k]];
    const slope = (k, l) => (value(l) - value(k)) / Math.max(middles[at[l]] - middles[at[k]], 1e-9);
    const slopes = at.slice(1).map((_, k) => slope(k, k + 1)); // slopes[k]: from k to k + 1
    // Whether the move from the k-th bucket with a value to the l-th is a change.
    const jump = (k, l) => {
      if (same(value(k), value(l))) return false;
      const s = slope(k, l);
      const sides = [slopes.slice(Math.max(0, k - SIDE), k), slopes.slice(l, l + SIDE)];
      return sides.every((side) => !side.length || Math.abs(s - median(side)) > JUMP * Math.abs(median(side)));
    };
    for (let k = 1; k < at.length; k += 1) {
      const [p, i] = [at[k - 1], at[k]];
      if (same(column[p], column[i])) continue;
      const inside = buckets.last[i] > buckets.first[i];
      const into = jump(k - 1, k);
      // Inside the bucket: its mean moved off towards the next one's (or neither move is a
      // change, but both together are).
      if (inside && k + 1 < at.length && between(column[p], column[i], value(k + 1))) {
        if (into || (!jump(k, k + 1) && jump(k - 1, k + 1))) {
          changes.push({ name, from: column[p], to: value(k + 1), first: buckets.first[i], last: buckets.last[i] });
          k += 1; // that move is this change's
          continue;
        }
      }
      if (into) {
        const unsure = inside && k + 1 === at.length; // the last bucket: the change may be anywhere in it
        const first = buckets.first[i];
        changes.push({ name, from: column[p], to: column[i], first, last: unsure ? buckets.last[i] : first });
      }
    }
  }
  return changes.sort((a, b) => a.first - b.first);
}

/** A change's words, for its marker's tooltip. */
export function changeText(change) {
  const values = `${change.name} ${Number(change.from).toPrecision(4)} \u2192 ${Number(change.to).toPrecision(4)}`;
  if (change.first === change.last) return `${values} from episode ${change.first}`;
  return `${values} between episodes ${change.first} and ${change.last}`;
}

export class Curve {
  /**
   * The chart of a run's buckets. Dragging across it asks for a closer look at those episodes
   * (`onZoom(first, last)`), a double click for the whole run again (`onReset()`): what to draw
   * then is the caller's to fetch and `show`.
   * @param {HTMLElement} el where the chart goes
   * @param {{onZoom: function(number, number), onReset: function(), since: number,
   *   metric: string, parentLabel: string}} options
   *   `since`: the performance.now() the view opened at, for data-first-paint-ms; `metric`:
   *   the metric to draw ("": the reward); `parentLabel`: a fork's parent run's legend (a fork's
   *   chart draws the parent's curve before its own; "": not a fork)
   */
  constructor(el, { onZoom, onReset, since = 0, metric = "", parentLabel = "" }) {
    this.el = el;
    this.since = since;
    this.metric = metric;
    this.shown = new CurveBuckets();
    this.fork = Boolean(parentLabel);
    this.parent = null; // the parent's buckets up to the fork point, drawn before the run's
    this.changes = [];
    this._offset = 0; // the parent's buckets come first in the chart's columns
    this._frame = 0; // a drawing requested for the next animation frame
    const series = metric
      ? [{ label: metric, stroke: COLOURS.mean, width: 2, value: sig, points: { show: false } }]
      : [
          { label: "min", stroke: COLOURS.edge, width: 1, value: fmt(3), points: { show: false } },
          { label: "max", stroke: COLOURS.edge, width: 1, value: fmt(3), points: { show: false } },
          { label: "mean", stroke: COLOURS.mean, width: 2, value: fmt(3), points: { show: false } },
          { label: "best", stroke: COLOURS.best, width: 2, value: fmt(3), points: { show: false } },
        ];
    const opts = {
      width: Math.max(300, el.clientWidth),
      height: 320,
      scales: { x: { time: false } },
      series: [
        { label: "episodes", value: (u, v, s, i) => this._episodes(i) },
        ...series,
        ...(this.fork ? [{ label: parentLabel, stroke: COLOURS.parent, width: 2, value: metric ? sig : fmt(3), points: { show: false } }] : []),
      ],
      bands: metric ? [] : [{ series: [2, 1], fill: COLOURS.band }],
      axes: [
        { label: "episode", grid: GRID },
        { label: metric || "reward", grid: GRID, size: 64 },
      ],
      cursor: { drag: { x: true, y: false, setScale: false } },
      legend: { live: true },
      hooks: {
        draw: [(u) => this._drawn(u)],
        setSelect: [(u) => this._selected(u, onZoom)],
      },
    };
    el.replaceChildren();
    this.plot = new uPlot(opts, this._columns(), el);
    this._reset = () => onReset();
    this.plot.over.addEventListener("dblclick", this._reset);
    this._resize = new ResizeObserver(() => {
      this.plot.setSize({ width: Math.max(300, el.clientWidth), height: 320 });
    });
    this._resize.observe(el);
  }

  /** Buckets to ask the gateway for: about one per pixel of the chart, 50..10000. */
  static bucketsFor(el) {
    return bucketsFor(el);
  }

  /**
   * Draws these buckets (uPlot draws once the current task's code is done, in a microtask).
   * @param {CurveBuckets} buckets the run's
   * @param {CurveBuckets | null} parent a fork's parent's, up to the fork point
   */
  show(buckets, parent = null) {
    this.shown = buckets;
    this.parent = parent;
    cancelAnimationFrame(this._frame);
    this._frame = 0;
    this.plot.setData(this._columns());
  }

  /** Draws the shown buckets again at the next animation frame, after they grew: live
   * episodes arrive faster than frames. */
  changed() {
    if (!this._frame) this._frame = requestAnimationFrame(() => this.show(this.shown, this.parent));
  }

  /** The chart's columns: the parent's buckets (before the fork) then the run's, each series
   * null where the other's buckets are. */
  _columns() {
    const b = this.shown;
    const own = this.metric ? [b.values(this.metric)] : b.columns().slice(1);
    const x = b.middles();
    const p = this.parent;
    const cut = p ? p.middles().filter((m) => !x.length || m < b.firstEpisode).length : 0;
    this._offset = cut;
    this.changes = hyperparameterChanges(b);
    const pad = (n) => new Array(n).fill(null);
    if (!this.fork) return [x, ...own];
    if (!cut) return [x, ...own, pad(x.length)];
    return [
      [...p.middles().slice(0, cut), ...x],
      ...own.map((column) => [...pad(cut), ...column]),
      [...p.values(this.metric).slice(0, cut), ...pad(x.length)],
    ];
  }

  /** The legend's text for column i: its episode or its range of episodes. */
  _episodes(i) {
    if (i == null) return "\u2013";
    const own = i >= this._offset;
    const { first, last } = own ? this.shown : this.parent;
    const j = own ? i - this._offset : i;
    if (j >= first.length) return "\u2013";
    const range = first[j] === last[j] ? String(first[j]) : `${first[j]}\u2013${last[j]}`;
    return own ? range : `${range} (parent)`;
  }

  _drawn(u) {
    const b = this.shown;
    const data = this.el.dataset;
    data.first = String(b.firstEpisode);
    data.episodes = data.last = String(b.lastEpisode);
    data.points = String(b.length);
    data.metric = this.metric || "reward";
    data.metricPoints = String(b.values(this.metric).filter((v) => v != null).length);
    data.parentPoints = String(this._offset);
    data.markers = String(this.changes.length);
    this._mark(u);
    const now = performance.now();
    if (data.firstPaintMs === undefined) data.firstPaintMs = (now - this.since).toFixed(1);
    data.drawnAt = now.toFixed(1);
  }

  /** A vertical marker over the plot at each hyperparameter change, its words as a tooltip.
   * Markers of the same change are moved, not made again: a tooltip stays open while live
   * episodes redraw the chart. */
  _mark(u) {
    const old = new Map([...u.over.querySelectorAll(".hp-marker")].map((node) => [node.dataset.key, node]));
    for (const change of this.changes) {
      const text = changeText(change);
      const key = `${change.name} ${change.first} ${change.last} ${text}`;
      let marker = old.get(key);
      old.delete(key);
      if (!marker) {
        marker = document.createElement("div");
        marker.className = "hp-marker";
        Object.assign(marker.dataset, { key, name: change.name, episode: String(change.first), from: String(change.from), to: String(change.to) });
        const handle = document.createElement("span");
        handle.className = "hp-handle";
        handle.title = text;
        handle.setAttribute("aria-label", text);
        marker.append(handle);
        u.over.append(marker);
      }
      const x = u.valToPos((change.first + change.last) / 2, "x");
      marker.hidden = !(x >= 0 && x <= u.over.clientWidth);
      marker.style.left = `${x}px`;
    }
    for (const node of old.values()) node.remove();
  }

  _selected(u, onZoom) {
    const { left, width } = u.select;
    if (width <= 0) return;
    u.setSelect({ left: 0, top: 0, width: 0, height: 0 }, false);
    const first = Math.max(1, Math.ceil(u.posToVal(left, "x")));
    const last = Math.floor(u.posToVal(left + width, "x"));
    if (last >= first) onZoom(first, last);
  }

  destroy() {
    cancelAnimationFrame(this._frame);
    this._resize.disconnect();
    this.plot.over.removeEventListener("dblclick", this._reset);
    this.plot.destroy();
  }
}

/**
 * Several runs' curves on one chart: per run the mean of the reward or of one metric per
 * bucket, in the run's colour, at the episodes it covers (a fork's start after its fork point).
 */
export class CompareChart {
  /**
   * @param {HTMLElement} el where the chart goes
   * @param {{runs: {label: string, colour: string}[], metric: string,
   *   onCursor: function(string, (number|null)[])}} options `onCursor`: the episode under the
   *   mouse and each run's value there (null: none there), or "" when it leaves
   */
  constructor(el, { runs, metric = "", onCursor = () => {} }) {
    this.el = el;
    this.metric = metric;
    this.runs = runs;
    this.buckets = runs.map(() => new CurveBuckets());
    this.x = [];
    const opts = {
      width: Math.max(300, el.clientWidth),
      height: 360,
      scales: { x: { time: false } },
      series: [
        {},
        ...runs.map((run) => ({ label: run.label, stroke: run.colour, width: 2, spanGaps: true, value: sig, points: { show: false } })),
      ],
      axes: [
        { label: "episode", grid: GRID },
        { label: metric || "reward", grid: GRID, size: 64 },
      ],
      legend: { show: false },
      hooks: {
        draw: [() => this._drawn()],
        setCursor: [
          (u) => {
            const i = u.cursor.idx;
            if (i == null) onCursor("", runs.map(() => null));
            else onCursor(String(Math.round(this.x[i])), runs.map((_, k) => u.data[k + 1][i]));
          },
        ],
      },
    };
    el.replaceChildren();
    this.plot = new uPlot(opts, this._columns(), el);
    this._resize = new ResizeObserver(() => this.plot.setSize({ width: Math.max(300, el.clientWidth), height: 360 }));
    this._resize.observe(el);
  }

  /** Draws the runs' buckets (in the order of the runs given; null: none yet). */
  show(buckets) {
    this.buckets = buckets.map((b) => b || new CurveBuckets());
    this.plot.setData(this._columns());
  }

  /** One x column for all runs (every bucket's middle episode, in order) and per run its
   * values there, null at the other runs' buckets (the line spans them). */
  _columns() {
    const at = new Map();
    for (const b of this.buckets) for (const m of b.middles()) at.set(m, 0);
    this.x = [...at.keys()].sort((a, b) => a - b);
    this.x.forEach((m, i) => at.set(m, i));
    const columns = this.buckets.map((b) => {
      const column = new Array(this.x.length).fill(null);
      const values = b.values(this.metric);
      b.middles().forEach((m, i) => (column[at.get(m)] = values[i]));
      return column;
    });
    return [this.x.slice(), ...columns];
  }

  _drawn() {
    const counts = this.buckets.map((b) => b.values(this.metric).filter((v) => v != null).length);
    const data = this.el.dataset;
    data.metric = this.metric || "reward";
    data.runs = String(counts.filter(Boolean).length);
    data.points = String(counts.reduce((a, b) => a + b, 0));
    data.drawnAt = performance.now().toFixed(1);
  }

  destroy() {
    this._resize.disconnect();
    this.plot.destroy();
  }
}

/**
 * Every bone's segment [x0, y0, x1, y1] for one frame of joint angles: a bone starts where its
 * parent ends and points at its angle relative to its parent's direction (the root's, relative
 * to +x). The same kinematics as trainwire.motion.forward_kinematics (a browser test compares
 * them).
 * @param {{parent: number, length: number}[]} bones
 * @param {number[]} angles
 */
export function forwardKinematics(bones, angles) {
  const segments = [];
  const heading = [];
  bones.forEach((bone, i) => {
    let x0 = 0;
    let y0 = 0;
    let direction = angles[i];
    if (bone.parent >= 0) {
      const p = segments[bone.parent];
      x0 = p[2];
      y0 = p[3];
      direction += heading[bone.parent];
    }
    heading.push(direction);
    segments.push([x0, y0, x0 + bone.length * Math.cos(direction), y0 + bone.length * Math.sin(direction)]);
  });
  return segments;
}

function framesOf(angles, joints) {
  const frames = [];
  for (let i = 0; i + joints <= angles.length; i += joints) frames.push(angles.slice(i, i + joints));
  return frames;
}

/** Bones of a Rig message in the JSON mapping (defaults are omitted there). */
export function bonesOf(rig) {
  return (rig.bones || []).map((b) => ({ name: b.name || "", parent: b.parent ?? 0, length: b.length ?? 0 }));
}

export class Avatar {
  /**
   * The learned motion over the target, animated at the clip's frame rate: the canvas is
   * redrawn only when what it shows changes (the clip's frame, the learned motion or the
   * canvas's size), not on every display refresh (a 30 fps clip on a 60 Hz display would draw
   * each picture twice; on 120 Hz, four times).
   * @param {HTMLCanvasElement} canvas
   * @param {object} rig a Rig message (JSON mapping)
   * @param {object} clip a Clip message (JSON mapping)
   */
  constructor(canvas, rig, clip) {
    this.canvas = canvas;
    this.bones = bonesOf(rig);
    this.fps = clip.fps || 30;
    const joints = clip.jointCount || this.bones.length;
    this.target = framesOf(clip.angles || [], joints).map((f) => forwardKinematics(this.bones, f));
    this.learned = null;
    this._bounds = this._measure();
    this._drawn = ""; // what the canvas shows: frame, learned motion and size
    this._version = 0; // bumped when the learned motion changes
    this._start = performance.now();
    this._frame = requestAnimationFrame((t) => this._draw(t));
  }

  /** Shows the motion of an episode's imitation detail. */
  setLearned(detail, episode) {
    const joints = detail.jointCount || this.bones.length;
    const frames = framesOf(detail.angles || [], joints);
    if (!frames.length || joints !== this.bones.length) return;
    this.learned = frames.map((f) => forwardKinematics(this.bones, f));
    this._bounds = this._measure();
    this._version += 1;
    this.canvas.dataset.episode = String(episode);
  }

  _measure() {
    let [x0, y0, x1, y1] = [Infinity, Infinity, -Infinity, -Infinity];
    for (const pose of [...this.target, ...(this.learned || [])]) {
      for (const s of pose) {
        x0 = Math.min(x0, s[0], s[2]);
        x1 = Math.max(x1, s[0], s[2]);
        y0 = Math.min(y0, s[1], s[3]);
        y1 = Math.max(y1, s[1], s[3]);
      }
    }
    return Number.isFinite(x0) ? [x0, y0, x1, y1] : [-1, -1, 1, 1];
  }

  _draw(now) {
    this._frame = requestAnimationFrame((t) => this._draw(t));
    const { canvas } = this;
    const dpr = window.devicePixelRatio || 1;
    const w = canvas.clientWidth;
    const h = canvas.clientHeight;
    if (!w || !h || !this.target.length) return;
    // (A frame's timestamp may precede the moment the avatar was made: clamp at 0.)
    const frame = Math.floor((Math.max(0, now - this._start) / 1000) * this.fps) % this.target.length;
    const drawn = `${frame} ${this._version} ${w} ${h} ${dpr}`;
    if (drawn === this._drawn) return;
    this._drawn = drawn;
    if (canvas.width !== Math.round(w * dpr) || canvas.height !== Math.round(h * dpr)) {
      canvas.width = Math.round(w * dpr);
      canvas.height = Math.round(h * dpr);
    }
    const ctx = canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, w, h);
    const [bx0, by0, bx1, by1] = this._bounds;
    const margin = 24;
    const scale = Math.min((w - 2 * margin) / Math.max(bx1 - bx0, 1e-6), (h - 2 * margin) / Math.max(by1 - by0, 1e-6));
    const ox = w / 2 - ((bx0 + bx1) / 2) * scale;
    const oy = h / 2 + ((by0 + by1) / 2) * scale; // y points up
    const px = (x, y) => [ox + x * scale, oy - y * scale];

    ctx.strokeStyle = "#e5e7eb";
    ctx.lineWidth = 1;
    ctx.beginPath();
    ctx.moveTo(margin / 2, oy - by0 * scale + 6);
    ctx.lineTo(w - margin / 2, oy - by0 * scale + 6);
    ctx.stroke();

    this._figure(ctx, this.target[frame], px, COLOURS.target, 7);
    if (this.learned) {
      const i = Math.min(this.learned.length - 1, Math.floor((frame * this.learned.length) / this.target.length));
      this._figure(ctx, this.learned[i], px, COLOURS.learned, 3.5);
    }
  }

  _figure(ctx, pose, px, colour, width) {
    ctx.strokeStyle = colour;
    ctx.fillStyle = colour;
    ctx.lineWidth = width;
    ctx.lineCap = "round";
    ctx.lineJoin = "round";
    this.bones.forEach((bone, i) => {
      const [a, b] = [px(pose[i][0], pose[i][1]), px(pose[i][2], pose[i][3])];
      ctx.beginPath();
      ctx.moveTo(a[0], a[1]);
      ctx.lineTo(b[0], b[1]);
      ctx.stroke();
      if (bone.name === "head") {
        ctx.beginPath();
        ctx.arc(b[0], b[1], Math.max(4, Math.hypot(b[0] - a[0], b[1] - a[1]) * 0.45), 0, 2 * Math.PI);
        ctx.stroke();
      }
    });
  }

  destroy() {
    cancelAnimationFrame(this._frame);
  }
}

// The pictures of a run: its learning curve (uPlot) and, for imitation runs, the avatar (canvas).
//
// The curve draws buckets of episodes (`CurveBuckets`): per bucket a band from the smallest to
// the largest reward, the mean reward as a line and the running best reward. However long the
// run, the chart holds a bounded number of buckets: the gateway summarises the history
// (GET /v1/runs/{id}/curve) and live episodes are merged once they pile up. Its element
// carries, after every drawing:
//
//   data-first, data-episodes  the first and the last episode the chart covers (data-last
//                              repeats data-episodes);
//   data-points                how many buckets it draws;
//   data-first-paint-ms        milliseconds from opening the view to its first drawing (set once);
//   data-drawn-at              performance.now() of the latest drawing,
//
// so people and tests can check it.

import uPlot from "./vendor/uplot/uPlot.esm.js";

const COLOURS = {
  band: "rgba(147, 197, 253, 0.45)",
  edge: "#93c5fd",
  mean: "#2563eb",
  best: "#f59e0b",
  target: "#cbd5e1",
  learned: "#2563eb",
};

const fmt = (digits) => (u, v) => (v == null ? "\u2013" : v.toFixed(digits));

/**
 * Contiguous buckets of a run's episodes, in order, as parallel arrays: a bucket covers
 * episodes first[i]..last[i] and holds their smallest, largest and mean reward and the running
 * best reward at its last episode (a CurveBucket of the gateway's API).
 */
export class CurveBuckets {
  constructor() {
    this.first = [];
    this.last = [];
    this.min = [];
    this.max = [];
    this.mean = [];
    this.best = [];
  }

  /** Buckets of a GetRunCurveResponse in the protobuf JSON mapping (int64 fields are strings,
   * a field at 0 is left out, an empty run is `{}`). */
  static fromReply(reply) {
    const buckets = new CurveBuckets();
    for (const b of reply.buckets || []) {
      const first = Number(b.firstEpisode || 0);
      const [min, max, mean, best] = [b.rewardMin, b.rewardMax, b.rewardMean, b.bestReward].map((v) => Number(v || 0));
      buckets.push(first, Number(b.lastEpisode || first), min, max, mean, best);
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

  push(first, last, min, max, mean, best) {
    this.first.push(first);
    this.last.push(last);
    this.min.push(min);
    this.max.push(max);
    this.mean.push(mean);
    this.best.push(best);
  }

  /** Appends one episode as a bucket of its own. */
  add(episode, reward, best) {
    this.push(episode, episode, reward, reward, reward, best);
  }

  /**
   * Merges neighbours so that about `target` buckets remain (at most 2 * target + 1): a bucket
   * absorbs the next while both together span no more than the covered range / target
   * episodes. Means are weighted by episodes; the best is the later bucket's.
   */
  compact(target) {
    const n = this.length;
    if (!n) return;
    const span = Math.ceil((this.lastEpisode - this.firstEpisode + 1) / Math.max(1, target));
    let w = 0; // buckets kept so far; bucket w - 1 is the one growing
    for (let r = 0; r < n; r += 1) {
      const size = this.last[r] - this.first[r] + 1;
      const open = w - 1;
      if (w && this.last[r] - this.first[open] + 1 <= span) {
        const had = this.last[open] - this.first[open] + 1;
        this.mean[open] = (this.mean[open] * had + this.mean[r] * size) / (had + size);
        this.last[open] = this.last[r];
        this.min[open] = Math.min(this.min[open], this.min[r]);
        this.max[open] = Math.max(this.max[open], this.max[r]);
        this.best[open] = this.best[r];
      } else {
        this.first[w] = this.first[r];
        this.last[w] = this.last[r];
        this.min[w] = this.min[r];
        this.max[w] = this.max[r];
        this.mean[w] = this.mean[r];
        this.best[w] = this.best[r];
        w += 1;
      }
    }
    for (const column of [this.first, this.last, this.min, this.max, this.mean, this.best]) column.length = w;
  }

  /** The columns uPlot draws: each bucket at its middle episode; reward min, max, mean, best.
   * Copies, so that buckets added before the next drawing never show half-way in the chart. */
  columns() {
    const x = this.first.map((f, i) => (f + this.last[i]) / 2);
    return [x, this.min.slice(), this.max.slice(), this.mean.slice(), this.best.slice()];
  }
}

export class Curve {
  /**
   * The chart of a run's buckets. Dragging across it asks for a closer look at those episodes
   * (`onZoom(first, last)`), a double click for the whole run again (`onReset()`): what to draw
   * then is the caller's to fetch and `show`.
   * @param {HTMLElement} el where the chart goes
   * @param {{onZoom: function(number, number), onReset: function(), since: number}} options
   *   `since`: the performance.now() the view opened at, for data-first-paint-ms
   */
  constructor(el, { onZoom, onReset, since = 0 }) {
    this.el = el;
    this.since = since;
    this.shown = new CurveBuckets();
    this._frame = 0; // a drawing requested for the next animation frame
    const opts = {
      width: Math.max(300, el.clientWidth),
      height: 320,
      scales: { x: { time: false } },
      series: [
        { label: "episodes", value: (u, v, s, i) => this._episodes(i) },
        { label: "min", stroke: COLOURS.edge, width: 1, value: fmt(3), points: { show: false } },
        { label: "max", stroke: COLOURS.edge, width: 1, value: fmt(3), points: { show: false } },
        { label: "mean", stroke: COLOURS.mean, width: 2, value: fmt(3), points: { show: false } },
        { label: "best", stroke: COLOURS.best, width: 2, value: fmt(3), points: { show: false } },
      ],
      bands: [{ series: [2, 1], fill: COLOURS.band }],
      axes: [
        { label: "episode", grid: { stroke: "#eef0f3" } },
        { label: "reward", grid: { stroke: "#eef0f3" }, size: 56 },
      ],
      cursor: { drag: { x: true, y: false, setScale: false } },
      legend: { live: true },
      hooks: {
        draw: [() => this._drawn()],
        setSelect: [(u) => this._selected(u, onZoom)],
      },
    };
    el.replaceChildren();
    this.plot = new uPlot(opts, this.shown.columns(), el);
    this._reset = () => onReset();
    this.plot.over.addEventListener("dblclick", this._reset);
    this._resize = new ResizeObserver(() => {
      this.plot.setSize({ width: Math.max(300, el.clientWidth), height: 320 });
    });
    this._resize.observe(el);
  }

  /** Buckets to ask the gateway for: about one per pixel of the chart, 50..10000. */
  static bucketsFor(el) {
    return Math.min(10000, Math.max(50, Math.round(el.clientWidth)));
  }

  /** Draws these buckets (uPlot draws once the current task's code is done, in a microtask). */
  show(buckets) {
    this.shown = buckets;
    cancelAnimationFrame(this._frame);
    this._frame = 0;
    this.plot.setData(buckets.columns());
  }

  /** Draws the shown buckets again at the next animation frame, after they grew: live
   * episodes arrive faster than frames. */
  changed() {
    if (!this._frame) this._frame = requestAnimationFrame(() => this.show(this.shown));
  }

  /** The legend's text for bucket i: its episode or its range of episodes. */
  _episodes(i) {
    const { first, last } = this.shown;
    if (i == null || i >= first.length) return "\u2013";
    return first[i] === last[i] ? String(first[i]) : `${first[i]}\u2013${last[i]}`;
  }

  _drawn() {
    const b = this.shown;
    const data = this.el.dataset;
    data.first = String(b.firstEpisode);
    data.episodes = data.last = String(b.lastEpisode);
    data.points = String(b.length);
    const now = performance.now();
    if (data.firstPaintMs === undefined) data.firstPaintMs = (now - this.since).toFixed(1);
    data.drawnAt = now.toFixed(1);
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
   * The learned motion over the target, animated at the clip's frame rate.
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

    // (A frame's timestamp may precede the moment the avatar was made: clamp at 0.)
    const frame = Math.floor((Math.max(0, now - this._start) / 1000) * this.fps) % this.target.length;
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

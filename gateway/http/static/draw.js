// The pictures of a run: its learning curve (uPlot) and, for imitation runs, the avatar (canvas).
//
// The curve draws reward, its rolling mean and the best reward, as `trainwire plot` does. Its
// element carries data-episodes (points drawn), data-last (the last episode drawn) and
// data-drawn-at (performance.now() of that drawing), so people and tests can check it.

import uPlot from "./vendor/uplot/uPlot.esm.js";

const COLOURS = { reward: "#93c5fd", mean: "#2563eb", best: "#f59e0b", target: "#cbd5e1", learned: "#2563eb" };

/** Episodes in the rolling mean: a twentieth of the run, 3..50 (as the CLI's plot). */
export function rollingWindow(maxEpisodes) {
  return Math.min(50, Math.max(3, Math.floor(maxEpisodes / 20)));
}

const fmt = (digits) => (u, v) => (v == null ? "\u2013" : v.toFixed(digits));

export class Curve {
  /**
   * @param {HTMLElement} el where the chart goes
   * @param {number} window episodes in the rolling mean
   */
  constructor(el, window) {
    this.el = el;
    this.window = window;
    this.x = [];
    this.reward = [];
    this.mean = [];
    this.best = [];
    this._sum = 0;
    this._scheduled = false;
    const opts = {
      width: Math.max(300, el.clientWidth),
      height: 320,
      scales: { x: { time: false } },
      series: [
        { label: "episode", value: (u, v) => (v == null ? "\u2013" : String(v)) },
        { label: "reward", stroke: COLOURS.reward, width: 1, value: fmt(3) },
        { label: `mean of ${window}`, stroke: COLOURS.mean, width: 2.5, value: fmt(3) },
        { label: "best", stroke: COLOURS.best, width: 2, value: fmt(3) },
      ],
      axes: [
        { label: "episode", grid: { stroke: "#eef0f3" } },
        { label: "reward", grid: { stroke: "#eef0f3" }, size: 56 },
      ],
      legend: { live: true },
      hooks: { draw: [(u) => this._drawn(u)] },
    };
    el.replaceChildren();
    this.plot = new uPlot(opts, this._data(), el);
    this._resize = new ResizeObserver(() => {
      this.plot.setSize({ width: Math.max(300, el.clientWidth), height: 320 });
    });
    this._resize.observe(el);
  }

  _data() {
    return [this.x, this.reward, this.mean, this.best];
  }

  _drawn(u) {
    const xs = u.data[0];
    this.el.dataset.episodes = String(xs.length);
    this.el.dataset.last = String(xs.length ? xs[xs.length - 1] : 0);
    this.el.dataset.drawnAt = performance.now().toFixed(1);
  }

  /** Adds one episode (numbers as the JSON mapping gives them); drawn at the next frame. */
  push(episode, reward, best) {
    const i = this.x.length;
    this.x.push(episode);
    this.reward.push(reward);
    this.best.push(best);
    this._sum += reward;
    if (i >= this.window) this._sum -= this.reward[i - this.window];
    this.mean.push(this._sum / Math.min(i + 1, this.window));
    if (!this._scheduled) {
      this._scheduled = true;
      requestAnimationFrame(() => {
        this._scheduled = false;
        this.plot.setData(this._data());
      });
    }
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

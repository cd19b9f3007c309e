// What every view of the page shares: building elements, showing runs' fields as text, and the
// connection indicator in the header.

export const $ = (selector, root = document) => root.querySelector(selector);
export const FINAL = new Set(["DONE", "STOPPED", "ERROR"]);

export function el(tag, props = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(props)) {
    if (key === "dataset") Object.assign(node.dataset, value);
    else if (key === "class") node.className = value;
    else if (key === "style") Object.assign(node.style, value);
    else node[key] = value;
  }
  node.append(...children);
  return node;
}

export const stateName = (run) => (run.state || "STATE_UNSPECIFIED").replace(/^STATE_/, "");
export const num = (value) => Number(value || 0);
export const fixed = (value, digits = 3) => (value === undefined ? "\u2013" : Number(value).toFixed(digits));

/** A metric's value in four significant digits. */
export const precise = (value) => (value == null ? "\u2013" : Number(value).toPrecision(4));

export function speedText(speed) {
  const s = num(speed) || 1;
  return `\u00d7${s < 1 ? s.toFixed(2) : s.toFixed(1)}`;
}

export function ageText(createTime) {
  if (!createTime) return "";
  const seconds = Math.max(0, (Date.now() - Date.parse(createTime)) / 1000);
  if (seconds < 60) return `${Math.floor(seconds)} s`;
  if (seconds < 3600) return `${Math.floor(seconds / 60)} min`;
  if (seconds < 86400) return `${Math.floor(seconds / 3600)} h`;
  return `${Math.floor(seconds / 86400)} d`;
}

export function taskText(task) {
  if (task && task.imitation) {
    const t = task.imitation;
    const rig = t.rigName || (t.rig ? t.rig.name || "custom rig" : "stickman");
    const clip = t.clipName || (t.clip ? t.clip.name || "custom clip" : "?");
    return `imitation \u00b7 ${rig} / ${clip}`;
  }
  if (task && task.grpo) return `grpo \u00b7 ${task.grpo.modelPath || "?"}`;
  return "?";
}

/** The task's kind: "imitation", "grpo" or "". */
export const taskKind = (task) => (task && task.imitation ? "imitation" : task && task.grpo ? "grpo" : "");

export function badge(node, run) {
  const state = stateName(run);
  node.textContent = state;
  node.dataset.state = state;
}

/** A run's labels as chips, sorted by key. */
export function labelChips(labels) {
  return Object.keys(labels || {})
    .sort()
    .map((key) => el("span", { class: "chip", textContent: `${key}=${labels[key]}`, dataset: { key } }));
}

/** The link indicator in the header: connecting, live, reconnecting (with a count), finished. */
export const link = {
  set(state, reconnects) {
    const node = $("#link");
    node.dataset.state = state;
    node.dataset.reconnects = String(reconnects);
    const words = { connecting: "connecting\u2026", live: "live", reconnecting: "reconnecting\u2026", finished: "finished", idle: "" };
    node.textContent = words[state] + (reconnects ? ` \u00b7 ${reconnects} reconnect${reconnects > 1 ? "s" : ""}` : "");
  },
};

/** Shows an error's text in a field's error element (empty text hides it). */
export function fieldError(node, text) {
  node.textContent = text || "";
  node.hidden = !text;
}

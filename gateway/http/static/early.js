// The first view's requests, started as soon as the page's HTML is parsed: a module of its own
// that imports nothing, so it runs while the rest of the page's modules still load and compile.
// Opening a run (#/runs/ID), it asks for the run and its curve at once; the run view takes
// those replies (api.js's `api()` uses a reply started here for the same GET, once) instead of
// asking again when it starts.
//
// It also holds what both it and the views need, so that they agree: the route of a run, a
// run's API path, the bucket count of a chart and the headers that carry the token.

const TOKEN_KEY = "trainwire.token";

/** The token the gateway asked for, kept for this tab only ("" when there is none). */
export function storedToken() {
  try {
    return sessionStorage.getItem(TOKEN_KEY) || "";
  } catch {
    return "";
  }
}

/** Keeps a token for this tab; false when the browser will not store it. */
export function storeToken(token) {
  try {
    sessionStorage.setItem(TOKEN_KEY, token);
    return true;
  } catch {
    return false;
  }
}

/** The headers of a JSON API call: the bearer token, once there is one. */
export function apiHeaders() {
  const token = storedToken();
  return { Accept: "application/json", ...(token ? { Authorization: `Bearer ${token}` } : {}) };
}

/** The path of a run's resource (`/v1/runs/{id}` and what follows). */
export const runPath = (runId, rest = "") => `/v1/runs/${encodeURIComponent(runId)}${rest}`;

/** The run a URL hash opens (#/runs/ID), or "" for the other views. */
export function runOfHash(hash) {
  const found = hash.match(/^#\/runs\/([^/?]+)$/);
  return found ? decodeURIComponent(found[1]) : "";
}

/** Buckets to ask the gateway for: about one per pixel of the chart, 50..10000. */
export function bucketsFor(node) {
  return Math.min(10000, Math.max(50, Math.round(node.clientWidth)));
}

/** The run view's first curve request, for a chart of `width` buckets. */
export const firstCurvePath = (runId, width) => runPath(runId, `/curve?buckets=${width}`);

const started = new Map(); // path -> the fetch's promise, until taken

/** The reply of a GET this module started for `path`, once (null otherwise): the caller reads
 * it as its own request's. */
export function takeStarted(path) {
  const reply = started.get(path);
  started.delete(path);
  return reply || null;
}

function start() {
  const runId = runOfHash(location.hash);
  if (!runId) return;
  // The chart's width as the run view will measure it: the view shown, its layout as it starts.
  const view = document.getElementById("run-view");
  const hidden = view.hidden;
  view.hidden = false;
  const width = bucketsFor(document.getElementById("curve"));
  view.hidden = hidden;
  for (const path of [runPath(runId), firstCurvePath(runId, width)]) {
    const reply = fetch(path, { headers: apiHeaders() });
    reply.catch(() => {}); // the view reads the failure when it takes the reply
    started.set(path, reply);
  }
}

start();

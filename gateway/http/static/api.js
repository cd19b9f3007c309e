// The gateway's JSON API as the page calls it (the protobuf JSON mapping: int64 fields arrive as
// strings, fields at their default are left out).
//
// Requests go through `api()` and streams through `eventsUrl()`: the one place each to add a
// bearer token.

import { apiHeaders, runPath, storeToken, storedToken, takeStarted } from "./early.js";

export { runPath };

export class ApiError extends Error {
  constructor(error) {
    super(error.message || `HTTP ${error.code}`);
    this.error = error;
  }

  /** The gRPC status name of the error (INVALID_ARGUMENT, NOT_FOUND, ...), when it says one. */
  get status() {
    return this.error.status || "";
  }

  /** Every field violation of a google.rpc.BadRequest detail: [{field, description}]. */
  violations() {
    const found = [];
    for (const detail of this.error.details || []) found.push(...(detail.fieldViolations || []));
    return found;
  }

  /** The message and every field violation it does not already say. */
  describe() {
    const said = (v) => this.message.includes(v.field) && this.message.includes(v.description);
    const more = this.violations().filter((v) => !said(v));
    return [this.message, ...more.map((v) => `\u2022 ${v.field}: ${v.description}`)].join("\n");
  }
}

/** What to show for an error of a call: every bad field when the gateway named them. */
export const describe = (err) => (err instanceof ApiError ? err.describe() : String(err.message || err));

// A gateway started with --auth-tokens answers 401 without a token: the page asks for one once,
// keeps it for this tab only (sessionStorage, gone when the tab closes; early.js holds it) and
// sends it on every request and stream from then on.

/** Asks for a token after a 401 (unless another request already got a new one since `sent`
 * went out); true when there is one to retry with. */
function askToken(sent, error) {
  const now = storedToken();
  if (now && now !== sent) return true;
  const why = sent ? "The gateway did not accept the token." : "This gateway needs a token.";
  const token = (window.prompt(`${why}\n${error.message || ""}\n\nToken:`) || "").trim();
  return Boolean(token) && storeToken(token);
}

/** One call of the JSON API; the reply's JSON, or an ApiError. POST and PATCH send `body`. A GET
 * that early.js started while the page loaded is not sent again: its reply is this one's. */
export async function api(method, path, body) {
  for (let attempt = 0; ; attempt += 1) {
    const sent = storedToken();
    const init = { method, headers: apiHeaders() };
    if (method === "POST" || method === "PATCH") {
      init.headers["Content-Type"] = "application/json";
      init.body = JSON.stringify(body || {});
    }
    const response = await ((attempt === 0 && method === "GET" && takeStarted(path)) || fetch(path, init));
    const data = await response.json().catch(() => ({}));
    if (response.ok) return data;
    const error = data.error || { code: response.status, message: response.statusText };
    if (response.status === 401 && attempt < 3 && askToken(sent, error)) continue;
    throw new ApiError(error);
  }
}

/** The event stream of a run after an episode (`view`: "scalars" leaves every detail out).
 * EventSource sends no headers, so the token travels in the URL (RFC 6750's access_token; the
 * gateway takes it on this route only, keeps no access log and the page sends no Referer). */
export function eventsUrl(runId, after, view = "") {
  const token = storedToken();
  const auth = token ? `&access_token=${encodeURIComponent(token)}` : "";
  return runPath(runId, `/events?after=${after}${view ? `&view=${view}` : ""}${auth}`);
}

/** The download of a run's checkpoint (the tar of the trained model and its training state).
 * A link sends no headers either: the token travels like the event stream's. */
export function downloadUrl(runId, episode) {
  const token = storedToken();
  const auth = token ? `?access_token=${encodeURIComponent(token)}` : "";
  return runPath(runId, `/checkpoints/${episode}:download${auth}`);
}

/**
 * A run's latest episode without its detail (null if it has none yet or the stream fails):
 * the stream after the one before it brings exactly that one. The page learns a run's metric
 * names from it.
 * @param {string} runId
 * @param {number} last the run's last episode
 * @param {number} after the episode before its first (a fork's episodes follow its fork point)
 */
export function latestEpisode(runId, last, after = 0) {
  return new Promise((resolve) => {
    if (!last) {
      resolve(null);
      return;
    }
    const source = new EventSource(eventsUrl(runId, Math.max(after, last - 1), "scalars"));
    const done = (episode) => {
      source.close();
      resolve(episode);
    };
    source.addEventListener("episode", (e) => done(JSON.parse(e.data)));
    source.addEventListener("caught_up", () => done(null));
    source.addEventListener("finished", () => done(null));
    source.onerror = () => done(null);
  });
}

// Trainwire's page: routes the URL's hash to its views.
//
//   #/ (or #/?filter=…&orderBy=…)   the runs, searched and sorted, and the New-run form
//   #/runs/ID                       one run
//   #/compare?runs=ID,ID,...        runs side by side
//
// The views talk to the gateway's JSON API (api.js) and follow runs over server-sent events.

import { CompareView } from "./compare.js";
import { runOfHash } from "./early.js";
import { RunView } from "./run.js";
import { RunsView } from "./runs.js";
import { TrainersPanel } from "./trainers.js";

const runsView = new RunsView();
const trainersPanel = new TrainersPanel(); // shown with the runs view
const runView = new RunView();
const compareView = new CompareView();
let current = null;

/** The query of the hash (what follows its "?"). */
function hashQuery(hash) {
  const at = hash.indexOf("?");
  return new URLSearchParams(at < 0 ? "" : hash.slice(at + 1));
}

function route(event) {
  if (current) current.stop();
  trainersPanel.stop();
  const hash = location.hash;
  const runId = runOfHash(hash);
  if (runId) {
    current = runView;
    // The page's first view counts from the navigation that loaded it (performance.now()'s 0).
    runView.start(runId, event ? performance.now() : 0);
  } else if (/^#\/compare(\?|$)/.test(hash)) {
    current = compareView;
    const ids = (hashQuery(hash).get("runs") || "").split(",").map((id) => id.trim());
    compareView.start(ids.filter(Boolean));
  } else {
    current = runsView;
    runsView.start(hashQuery(hash));
    trainersPanel.start();
  }
}

window.addEventListener("hashchange", route);
route();

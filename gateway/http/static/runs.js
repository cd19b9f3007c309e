// The runs view: the table of runs (a filter, sortable columns, pages, a selection to compare)
// and the New-run form.
//
// The filter (AIP-160), the order (AIP-132) and the page size live in the URL's hash,
// `#/?filter=…&orderBy=…&pageSize=…`, so a search can be bookmarked and shared; the gateway evaluates both, and what it refuses is
// shown under the filter box, with the field and position it names.

import { ApiError, api, describe } from "./api.js";
import { $, ageText, badge, el, fieldError, fixed, labelChips, link, num, speedText, stateName, taskText } from "./dom.js";

const PAGE_SIZE = 100; // unless the hash says otherwise
/** Columns whose first click sorts descending (highest, latest first). */
const NUMERIC = new Set(["episode", "reward", "best_reward", "create_time"]);

/** The order a header's click asks for: its field ascending, or descending if it was that. */
function nextOrder(current, field) {
  const [name, direction] = current.trim().split(/\s+/);
  if (name === field) return direction === "desc" ? field : `${field} desc`;
  return NUMERIC.has(field) ? `${field} desc` : field;
}

/** `k=v, k2=v2` as a labels map; throws on an entry without "=". */
export function parseLabels(text) {
  const labels = {};
  for (const part of text.split(",").map((s) => s.trim()).filter(Boolean)) {
    const at = part.indexOf("=");
    if (at <= 0) throw new Error(`write each label as key=value, not ${JSON.stringify(part)}`);
    labels[part.slice(0, at).trim()] = part.slice(at + 1).trim();
  }
  return labels;
}

export class RunsView {
  constructor() {
    this.timer = null;
    this.params = { filter: "", orderBy: "", pageSize: "" };
    this.pages = [""]; // the page tokens that led to the page shown (its own last)
    this.next = ""; // the next page's token ("" on the last page)
    this.selected = new Set();
    this.form = $("#new-run");
    this.form.addEventListener("submit", (e) => this.submit(e));
    this.form.addEventListener("change", (e) => {
      if (e.target.name === "kind") this.showKind();
    });
    $("#runs-filter").addEventListener("submit", (e) => {
      e.preventDefault();
      this.search({ ...this.params, filter: $("#filter").value.trim() });
    });
    for (const th of document.querySelectorAll("#runs th[data-order]")) {
      th.addEventListener("click", () => this.search({ ...this.params, orderBy: nextOrder(this.params.orderBy, th.dataset.order) }));
    }
    $("#runs-prev").addEventListener("click", () => this.page(-1));
    $("#runs-next").addEventListener("click", () => this.page(1));
    $("#clear-selection").addEventListener("click", () => this.clearSelection());
    $("#compare-button").addEventListener("click", () => {
      const ids = [...this.selected].map(encodeURIComponent).join(",");
      location.hash = `#/compare?runs=${ids}`;
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

  /**
   * Shows the list.
   * @param {URLSearchParams} query the hash's query: filter, orderBy, pageSize
   */
  start(query) {
    const params = { filter: query.get("filter") || "", orderBy: query.get("orderBy") || "", pageSize: query.get("pageSize") || "" };
    if (!this.same(params)) this.pages = [""];
    this.params = params;
    $("#filter").value = params.filter;
    for (const th of document.querySelectorAll("#runs th[data-order]")) {
      const [name, direction] = params.orderBy.trim().split(/\s+/);
      const sort = name === th.dataset.order ? (direction === "desc" ? "descending" : "ascending") : "none";
      th.setAttribute("aria-sort", sort);
    }
    $("#runs-view").hidden = false;
    link.set("idle", 0);
    this.refresh();
    this.timer = setInterval(() => this.refresh(), 1000);
  }

  stop() {
    clearInterval(this.timer);
    $("#runs-view").hidden = true;
  }

  /** Lists with a new filter or order (from the first page): through the hash, so that the
   * address keeps it. */
  search(params) {
    const query = new URLSearchParams();
    if (params.filter) query.set("filter", params.filter);
    if (params.orderBy) query.set("orderBy", params.orderBy);
    if (params.pageSize) query.set("pageSize", params.pageSize);
    const hash = query.toString() ? `#/?${query}` : "#/";
    if (hash === location.hash || (hash === "#/" && !location.hash)) {
      this.pages = [""];
      this.refresh();
    } else {
      location.hash = hash;
    }
  }

  page(step) {
    if (step > 0 && this.next) this.pages.push(this.next);
    else if (step < 0 && this.pages.length > 1) this.pages.pop();
    else return;
    this.refresh();
  }

  async refresh() {
    const query = new URLSearchParams({ pageSize: this.params.pageSize || String(PAGE_SIZE) });
    const token = this.pages[this.pages.length - 1];
    if (token) query.set("pageToken", token);
    if (this.params.filter) query.set("filter", this.params.filter);
    if (this.params.orderBy) query.set("orderBy", this.params.orderBy);
    const asked = { ...this.params, token };
    try {
      const reply = await api("GET", `/v1/runs?${query}`);
      if (!this.current(asked)) return; // the search changed meanwhile
      this.next = reply.nextPageToken || "";
      this.render(reply.runs || []);
      fieldError($("#filter-error"), "");
      $("#filter").removeAttribute("aria-invalid");
      $("#runs-status").textContent = "";
    } catch (err) {
      if (!this.current(asked)) return;
      if (err instanceof ApiError && err.status === "INVALID_ARGUMENT") {
        // The filter or the order (or a page token of an older search) is wrong: say so where
        // it was typed, and show no runs rather than runs it did not select.
        fieldError($("#filter-error"), describe(err));
        $("#filter").setAttribute("aria-invalid", "true");
        this.next = "";
        this.render([]);
        $("#runs-empty").hidden = $("#runs-none").hidden = true;
      } else {
        $("#runs-status").textContent = `cannot list runs: ${err.message}`;
      }
    }
  }

  same(params) {
    return ["filter", "orderBy", "pageSize"].every((key) => params[key] === this.params[key]);
  }

  current(asked) {
    return this.same(asked) && asked.token === this.pages[this.pages.length - 1];
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
      const pick = el("input", {
        type: "checkbox",
        class: "pick",
        checked: this.selected.has(run.id),
        title: "Select to compare",
        dataset: { runId: run.id },
      });
      pick.setAttribute("aria-label", `Select ${run.displayName || run.id} to compare`);
      pick.addEventListener("change", () => {
        if (pick.checked) this.selected.add(run.id);
        else this.selected.delete(run.id);
        this.selection();
      });
      const labels = labelChips(run.labels);
      const row = el(
        "tr",
        { dataset: { runId: run.id, state: stateName(run), episode: String(episode) } },
        el("td", { class: "pick" }, pick),
        el(
          "td",
          {},
          el("a", { href: `#/runs/${run.id}`, textContent: run.displayName || run.id }),
          ...(labels.length ? [el("div", { class: "chips" }, ...labels)] : []),
        ),
        el("td", { class: "muted", textContent: taskText(run.task) }),
        el("td", {}, state),
        el("td", {}, el("div", { class: "progress" }, el("div", { class: "bar" }, fill), `${episode}/${max}`)),
        el("td", { class: "num", textContent: episode ? fixed(run.reward) : "\u2013" }),
        el("td", { class: "num", textContent: episode ? fixed(run.bestReward) : "\u2013" }),
        el("td", { class: "num", textContent: speedText(run.speed) }),
        el("td", { class: "num muted", textContent: ageText(run.createTime) }),
      );
      row.addEventListener("click", (e) => {
        if (e.target.tagName !== "A" && !e.target.closest("td.pick")) location.hash = `#/runs/${run.id}`;
      });
      return row;
    });
    $("#runs tbody").replaceChildren(...rows);
    $("#runs-empty").hidden = runs.length > 0 || Boolean(this.params.filter) || this.pages.length > 1;
    $("#runs-none").hidden = runs.length > 0 || !this.params.filter;
    const pages = this.pages.length;
    $("#runs-prev").disabled = pages <= 1;
    $("#runs-next").disabled = !this.next;
    $("#runs-pager").hidden = pages <= 1 && !this.next;
    $("#runs-page").textContent = `page ${pages}`;
    this.selection();
  }

  /** The Compare button: how many runs are selected (on any page); two or more to compare. */
  selection() {
    const button = $("#compare-button");
    const n = this.selected.size;
    button.disabled = n < 2;
    button.dataset.selected = String(n);
    button.textContent = n ? `Compare ${n}` : "Compare";
    $("#clear-selection").hidden = !n;
  }

  clearSelection() {
    this.selected.clear();
    for (const box of document.querySelectorAll("#runs input.pick")) box.checked = false;
    this.selection();
  }

  async submit(event) {
    event.preventDefault();
    const f = this.form.elements;
    const kind = f.kind.value;
    const error = $("#form-error");
    error.hidden = true;
    let labels;
    try {
      labels = parseLabels(f.labels.value);
    } catch (err) {
      fieldError(error, `labels: ${err.message}`);
      return;
    }
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
      labels,
      requestId: crypto.randomUUID ? crypto.randomUUID() : `${Date.now()}-${Math.random()}`,
    };
    try {
      const reply = await api("POST", "/v1/runs", request);
      location.hash = `#/runs/${reply.run.id}`;
    } catch (err) {
      fieldError(error, describe(err));
    }
  }
}

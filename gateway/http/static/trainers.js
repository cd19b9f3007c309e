// The Trainers card of the runs view: each trainer the gateway places runs on, as the gateway
// last probed it (GET /v1/trainers): reachable or why not, device and free slots, and each GPU
// its jobs may use with its memory in use and its utilization. The gateway probes trainers in
// the background (every few seconds), so the card asks it again every POLL_MS while shown.
//
// Each trainer is an `li.trainer[data-address]` (`data-reachable` "true" or "false") and each of
// its GPUs an `li.gpu[data-index]` carrying `data-name`, `data-memory-used`, `data-memory-total`
// (bytes) and `data-utilization` (0..1), so people and tests can read them. Under "defaults" (a
// closed `details.provider-defaults`), each provider the trainer advertises defaults for is an
// `li[data-provider]` (`data-checkpoint-every`) saying what a task's 0 fields mean there.

import { api, describe } from "./api.js";
import { $, el, num } from "./dom.js";

const POLL_MS = 3000;
const GIB = 1024 ** 3;

/** Bytes as GiB for people: `12.3` (one decimal; whole GiB from 100 on). */
export function gib(bytes) {
  const value = num(bytes) / GIB;
  return value >= 100 ? value.toFixed(0) : value.toFixed(1);
}

/** One GPU (a Gpu message, JSON mapping: int64 fields are strings, zeros left out). */
export function gpuItem(gpu) {
  const used = num(gpu.memoryUsedBytes);
  const total = num(gpu.memoryTotalBytes);
  const utilization = num(gpu.utilization);
  const share = total ? Math.min(1, used / total) : 0;
  const percent = `${Math.round(utilization * 100)}%`;
  return el(
    "li",
    {
      class: "gpu",
      dataset: { index: String(num(gpu.index)), name: gpu.name || "", memoryUsed: String(used), memoryTotal: String(total), utilization: String(utilization) },
    },
    el("span", { class: "gpu-name", textContent: `cuda:${num(gpu.index)} ${gpu.name || "GPU"}` }),
    el("span", { class: "gpu-memory", title: "memory in use / total", textContent: `${gib(used)} / ${gib(total)} GiB` }),
    el("span", { class: "gpu-util", title: "utilization", textContent: percent }),
    el("span", { class: "bar gpu-bar", title: `memory ${Math.round(share * 100)}% in use` }, el("span", { style: { width: `${(share * 100).toFixed(1)}%` } })),
  );
}

/** What a provider's 0 (or unset) task fields mean on a trainer, for people (a ProviderDefaults
 * message, JSON mapping: zeros left out). */
export function defaultsText(provider, defaults) {
  const parts = [`checkpoint every ${num(defaults.checkpointEvery)}`];
  const imitation = defaults.imitation;
  if (imitation) {
    parts.push(`group size ${num(imitation.groupSize)}`, `learning rate ${num(imitation.learningRate)}`);
  }
  const grpo = defaults.grpo;
  if (grpo) {
    parts.push(
      `rewards ${(grpo.rewardFunctions || []).join(" + ") || "none"}`,
      `${num(grpo.numGenerations)} generations of ${num(grpo.promptsPerStep)} prompts a step`,
      `completions up to ${num(grpo.maxCompletionLength)} tokens`,
      `learning rate ${num(grpo.learningRate)}`,
      `beta ${num(grpo.beta)}`,
      `temperature ${num(grpo.temperature)}`,
    );
    const lora = grpo.lora;
    if (lora) {
      parts.push(
        `LoRA rank ${num(lora.rank)}, alpha ${num(lora.alphaPerRank)} x rank, learning rate ${num(lora.learningRate)}, beta ${num(lora.beta)}`,
      );
    }
  }
  return `${provider}: ${parts.join("; ")}`;
}

/** One trainer of GET /v1/trainers. */
export function trainerItem(trainer) {
  const caps = trainer.capabilities || {};
  const reachable = Boolean(trainer.reachable);
  const head = el("div", { class: "trainer-head" }, el("code", { textContent: trainer.address }));
  const item = el("li", { class: "trainer", dataset: { address: trainer.address, reachable: String(reachable) } }, head);
  if (!reachable) {
    item.append(el("div", { class: "field-error", textContent: trainer.error || "not answering" }));
    return item;
  }
  const slots = `${num(caps.slotsFree)}/${num(caps.slotsTotal)} slots free`;
  head.append(el("span", { class: "muted small", textContent: ` ${slots}` }));
  const device = el("div", { class: "muted small trainer-device", textContent: caps.device || "" });
  item.append(device);
  const gpus = caps.gpus || [];
  if (gpus.length) item.append(el("ul", { class: "gpus" }, ...gpus.map(gpuItem)));
  else device.append(el("span", { class: "no-gpus", textContent: " \u00b7 no GPUs" }));
  const defaults = caps.providerDefaults || {};
  const providers = Object.keys(defaults);
  if (providers.length) {
    const lines = providers.map((provider) =>
      el("li", {
        dataset: { provider, checkpointEvery: String(num(defaults[provider].checkpointEvery)) },
        textContent: defaultsText(provider, defaults[provider]),
      }),
    );
    item.append(
      el(
        "details",
        { class: "provider-defaults small" },
        el("summary", { class: "muted", textContent: "defaults" }),
        el("ul", {}, ...lines),
      ),
    );
  }
  return item;
}

export class TrainersPanel {
  constructor() {
    this.timer = null;
    this.asked = 0; // bumped by every start and stop: a reply to an older one is dropped
  }

  /** Shows the trainers now and every POLL_MS until `stop`. */
  start() {
    this.stop();
    const asked = this.asked;
    this.refresh(asked);
    this.timer = setInterval(() => this.refresh(asked), POLL_MS);
  }

  stop() {
    clearInterval(this.timer);
    this.timer = null;
    this.asked += 1;
  }

  async refresh(asked) {
    const list = $("#trainers");
    const status = $("#trainers-status");
    try {
      const reply = await api("GET", "/v1/trainers");
      if (asked !== this.asked) return;
      const trainers = reply.trainers || [];
      list.replaceChildren(...trainers.map(trainerItem));
      const up = trainers.filter((t) => t.reachable).length;
      status.textContent = `${up} of ${trainers.length} answering`;
    } catch (err) {
      if (asked === this.asked) status.textContent = `cannot list the trainers: ${describe(err)}`;
    }
  }
}

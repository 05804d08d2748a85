// Small DOM and formatting helpers shared by the views.

/** h("a", {href: "#/x", class: "c"}, "text", childNode) -> element. `on*` attributes are listeners. */
export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k.startsWith("on") && typeof v === "function") el.addEventListener(k.slice(2), v);
    else if (k === "dataset") Object.assign(el.dataset, v);
    else if (k === "value") el.value = v;
    else if (k in el && typeof v !== "string") el[k] = v;
    else el.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children.flat()) {
    if (c !== undefined && c !== null && c !== false) el.append(c instanceof Node ? c : String(c));
  }
  return el;
}

/** A labelled input (`attrs.tag: "textarea"` for a text area). */
export function field(label, name, attrs = {}) {
  const { tag = "input", ...rest } = attrs;
  const input = h(tag, { name, ...rest });
  return h("label", { class: "field" }, h("span", {}, label), input);
}

export const STATUS = { 0: "prefill", 1: "queued", 2: "running", 3: "finished" };

export function statusText(t) {
  const s = STATUS[t.status] ?? String(t.status);
  return t.status === 3 && t.finish_reason ? `${s} (${t.finish_reason})` : s;
}

export function when(epochSeconds) {
  if (!epochSeconds) return "";
  const d = new Date(epochSeconds * 1000);
  const today = new Date().toDateString() === d.toDateString();
  return today ? d.toLocaleTimeString() : d.toLocaleString();
}

export function bytes(n) {
  if (!Number.isFinite(n)) return "";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

export function kindOf(id) {
  if (id.startsWith("_")) return "template";
  return id.startsWith("TMP_") ? "tmp" : "task";
}

/** True for a parent id that names where a template's state came from, not a task
 *  (`state:upload`, `state:operator`: a template imported from a state file). */
export function isStateOrigin(id) {
  return typeof id === "string" && id.startsWith("state:");
}

/** A link to the task's page; a state origin as plain text (it has no page). */
export function taskLink(id) {
  if (!id) return "";
  if (isStateOrigin(id)) return h("span", { class: "mono" }, id);
  return h("a", { href: `#/tasks/${encodeURIComponent(id)}`, class: "mono" }, id);
}

/** The numeric and text fields of a form that are filled in, as a request body. An integer
 *  beyond Number.MAX_SAFE_INTEGER (a seed up to 2^63-1) is a BigInt, sent as typed (json.js). */
export function formFields(form, names) {
  const out = {};
  for (const name of names) {
    const el = form.elements.namedItem(name);
    if (!el || el.value.trim() === "") continue;
    out[name] = el.type === "number" ? numberOf(el.value) : el.value;
  }
  return out;
}

function numberOf(text) {
  const n = Number(text);
  return /^-?\d+$/.test(text) && !Number.isSafeInteger(n) ? BigInt(text) : n;
}

/** Runs fn every `ms` (after the previous run ended) until the returned stop() is called. */
export function every(ms, fn) {
  let timer = null, stopped = false;
  const tick = async () => {
    try { await fn(); } catch (err) { if (err.name !== "AbortError") console.warn(err); }
    if (!stopped) timer = setTimeout(tick, ms);
  };
  tick();
  return () => { stopped = true; clearTimeout(timer); };
}

/** A message line for an error (shown in the view, not thrown). */
export function errorBox(err) {
  return h("p", { class: "error", role: "alert" }, err && err.message ? err.message : String(err));
}

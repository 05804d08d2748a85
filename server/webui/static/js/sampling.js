// The sampling fields of the two APIs (names and bounds as the server validates them); an empty
// field is left out of the request, so the server's default applies.

import { field, formFields, h } from "./dom.js";

const COMMON = [
  { name: "max_tokens", label: "max tokens", min: 0, step: 1 },
  { name: "temperature", label: "temperature", min: 0, max: 5, step: "any" },
  { name: "top_p", label: "top p", min: 0, max: 1, step: "any" },
  { name: "top_k", label: "top k", min: -1, step: 1 },
];
const LAST = [
  { name: "seed", label: "seed", min: 0, step: 1 },
  { name: "stop", label: "stop strings (one a line, \\n = newline)", text: true },
];

/** Task API (/v1/tasks/*) generation parameters. */
export const TASK_FIELDS = [
  ...COMMON,
  { name: "presence_penalty", label: "presence penalty", min: -10, max: 10, step: "any" },
  { name: "repetition_penalty", label: "repetition penalty", min: -10, max: 10, step: "any" },
  { name: "penalty_decay", label: "penalty decay", min: 0, max: 1, step: "any" },
  ...LAST,
];

/** OpenAI API (/v1/chat/completions, /v1/completions) sampling fields. */
export const OPENAI_FIELDS = [
  ...COMMON,
  { name: "presence_penalty", label: "presence penalty", min: -10, max: 10, step: "any" },
  { name: "frequency_penalty", label: "frequency penalty", min: -10, max: 10, step: "any" },
  { name: "penalty_decay", label: "penalty decay", min: 0, max: 1, step: "any" },
  ...LAST,
];

/** Inputs for `fields`, pre-filled from `defaults` ({name: value}). */
export function samplingFields(fields, defaults = {}) {
  return h("div", { class: "sampling" }, fields.map((f) => f.text
    ? field(f.label, f.name, { tag: "textarea", rows: 1, value: defaults[f.name] ?? "" })
    : field(f.label, f.name, { type: "number", min: f.min, max: f.max, step: f.step,
      value: defaults[f.name] ?? "", placeholder: "default" })));
}

/** The filled-in sampling fields of `form` as a request body (stop strings as a list). */
export function samplingBody(form, fields) {
  const body = formFields(form, fields.map((f) => f.name));
  if (typeof body.stop === "string") body.stop = stopList(body.stop);
  if (Array.isArray(body.stop) && !body.stop.length) delete body.stop;
  return body;
}

/** Stop strings typed one per line, with \n and \t written as escapes. */
export function stopList(text) {
  return text.split("\n").filter((s) => s !== "").map((s) => s.replace(/\\n/g, "\n").replace(/\\t/g, "\t"));
}

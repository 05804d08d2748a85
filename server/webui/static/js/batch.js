// Batch: many prompts (one a line, or a .txt / .jsonl file) submitted as TMP_ tasks, so the
// engine batches them; one list call per refresh gives every row's progress; each finished
// row's text is read once; the results download as JSONL.

import { aborted, api } from "./api.js";
import { errorBox, h, statusText } from "./dom.js";
import { TASK_FIELDS, samplingBody, samplingFields } from "./sampling.js";

const PARALLEL_CALLS = 6; // a browser's connections to one host
const REFRESH_MS = 500;
const LIST_LIMIT = 1000;

export function mount(el) {
  const ctl = new AbortController();
  let rows = [];
  const prompts = h("textarea", { name: "prompts", id: "batch-prompts", rows: 8, placeholder: "one prompt a line" });
  const file = h("input", { type: "file", id: "batch-file", accept: ".txt,.jsonl,text/plain" });
  const summary = h("span", { id: "batch-summary", class: "muted" });
  const download = h("button", { id: "batch-download", type: "button", disabled: true }, "Download JSONL");
  const stopAll = h("button", { id: "batch-stop", type: "button", disabled: true }, "Stop all");
  const run = h("button", { id: "batch-run", type: "submit" }, "Run");
  const body = h("tbody", { id: "batch-rows" });
  const message = h("div");
  const form = h("form", { id: "batch-form", class: "stack card" },
    h("label", { class: "field" }, h("span", {}, "prompts, one a line"), prompts),
    h("label", { class: "field" }, h("span", {}, "or a file (.txt: one a line; .jsonl: {\"prompt\": ...} a line)"), file),
    samplingFields(TASK_FIELDS, { max_tokens: 100 }), h("div", { class: "row" }, run, stopAll, download, summary));
  const table = h("table", { class: "list", id: "batch-table" },
    h("thead", {}, h("tr", {}, ["#", "prompt", "status", "tokens", "text"].map((c) => h("th", {}, c)))), body);
  el.append(h("h1", {}, "Batch"), form, message, h("div", { class: "table-wrap" }, table));
  const fail = (err) => { if (!aborted(err)) message.replaceChildren(errorBox(err)); };

  file.addEventListener("change", async () => {
    if (file.files.length) prompts.value = promptsOf(await file.files[0].text()).join("\n");
  });
  form.addEventListener("submit", (ev) => {
    ev.preventDefault();
    const list = prompts.value.split("\n").map((p) => p.trim()).filter(Boolean);
    if (!list.length || rows.some((r) => !r.done)) return;
    message.replaceChildren();
    rows = list.map((prompt, index) => newRow(prompt, index));
    body.replaceChildren(...rows.map((r) => r.tr));
    download.disabled = true;
    stopAll.disabled = false;
    runBatch(rows, samplingBody(form, TASK_FIELDS), ctl.signal, () => {
      const done = rows.filter((r) => r.done).length;
      summary.textContent = `${done} of ${rows.length} done`;
      if (done === rows.length) { download.disabled = false; stopAll.disabled = true; }
    }).catch(fail);
  });
  stopAll.addEventListener("click", () => {
    for (const r of rows.filter((r) => r.id && !r.done)) {
      api(`/v1/tasks/${r.id}/stop`, { method: "POST", body: {}, signal: ctl.signal }).catch(fail);
    }
  });
  download.addEventListener("click", () => saveJsonl(rows));
  return () => ctl.abort();
}

/** Prompts of a file: JSON lines with a "prompt" (or "text") key, or plain lines. */
export function promptsOf(text) {
  return text.split(/\r?\n/).map((line) => {
    const s = line.trim();
    if (!s.startsWith("{")) return s;
    try {
      const obj = JSON.parse(s);
      return typeof obj.prompt === "string" ? obj.prompt : typeof obj.text === "string" ? obj.text : s;
    } catch { return s; }
  }).filter(Boolean);
}

function newRow(prompt, index) {
  const cells = { status: h("td", {}, "submitting"), tokens: h("span", { class: "num" }, "0"),
    bar: h("progress", { value: 0, max: 1 }), text: h("td", { class: "text-cell" }) };
  const tr = h("tr", { dataset: { index } }, h("td", { class: "num" }, index + 1),
    h("td", { class: "prompt-cell", title: prompt }, prompt), cells.status,
    h("td", { class: "progress" }, cells.tokens, cells.bar), cells.text);
  return { index, prompt, id: null, done: false, fetched: false, result: null, tr, cells };
}

function showRow(row, st, maxTokens) {
  row.cells.status.textContent = statusText(st);
  row.cells.tokens.textContent = st.generated_buf;
  row.cells.bar.max = Math.max(maxTokens || st.generated_buf || 1, st.generated_buf);
  row.cells.bar.value = st.generated_buf;
}

async function pool(items, fn) {
  let next = 0;
  const worker = async () => { while (next < items.length) await fn(items[next++]); };
  await Promise.all(Array.from({ length: Math.min(PARALLEL_CALLS, items.length) }, worker));
}

async function runBatch(rows, params, signal, changed) {
  const maxTokens = params.max_tokens;
  const submitted = pool(rows, async (row) => {
    try {
      const t = await api("/v1/tasks/tmp", { method: "POST", body: { prompt: row.prompt, ...params }, signal });
      row.id = t.task_id;
      row.tr.dataset.taskId = t.task_id;
    } catch (err) {
      if (aborted(err)) throw err;
      Object.assign(row, { done: true, result: { error: err.message } });
      row.cells.status.textContent = `error: ${err.message}`;
      changed();
    }
  });
  let submitting = true;
  const settled = submitted.catch(() => {}).then(() => { submitting = false; }); // an abort ends the loop below
  for (;;) {
    const pause = new Promise((r) => setTimeout(r, REFRESH_MS));
    await (submitting ? Promise.race([settled, pause]) : pause);
    if (signal.aborted) return;
    const idle = await refresh(rows.filter((r) => r.id && !r.done), maxTokens, signal, changed);
    if (idle && !submitting && rows.every((r) => r.done)) return;
  }
}

/** One refresh: progress of every unfinished row, the text of each row that finished. */
async function refresh(open, maxTokens, signal, changed) {
  if (!open.length) return true;
  const list = await api("/v1/tasks/list", { query: { kind: "tmp", limit: LIST_LIMIT }, signal });
  const seen = new Map((list.tasks || []).map((t) => [t.task_id, t]));
  const missing = open.filter((r) => !seen.has(r.id)).slice(0, PARALLEL_CALLS);
  await pool(missing, async (r) => { seen.set(r.id, await api(`/v1/tasks/${r.id}/status`, { signal })); });
  const finished = [];
  for (const row of open) {
    const st = seen.get(row.id);
    if (!st) continue;
    showRow(row, st, maxTokens);
    if (st.status === 3) finished.push(row);
  }
  await pool(finished, async (row) => {
    const r = await api(`/v1/tasks/${row.id}/get_result`, { signal });
    row.result = { text: r.result, finish_reason: r.finish_reason, completion_tokens: r.completion_tokens,
      prompt_tokens: r.prompt_tokens, speed: r.speed };
    row.done = true;
    row.cells.text.textContent = r.result;
    row.tr.dataset.done = "1";
  });
  changed();
  return false;
}

function saveJsonl(rows) {
  const lines = rows.map((r) => JSON.stringify({ index: r.index, prompt: r.prompt, task_id: r.id, ...r.result }));
  const url = URL.createObjectURL(new Blob([lines.join("\n") + "\n"], { type: "application/jsonl" }));
  const a = h("a", { href: url, download: "batch-results.jsonl" });
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(url), 10000);
}

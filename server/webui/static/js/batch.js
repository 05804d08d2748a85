// Batch: many prompts (one a line of the text box, or a .txt / .jsonl file) submitted as TMP_
// tasks, so the engine batches them; one list call per refresh gives every row's progress; each
// finished row's text is read once; the results download as JSONL. A file's prompts are kept as
// the file has them (a JSONL prompt may hold line ends; spaces stay), and the page says which
// source a run uses. A row whose task is gone (deleted, or expired) or whose call the server
// refused ends as an error, the others go on; a call without an answer is tried again, for
// GIVE_UP_MS at most: a batch always ends, and can be run again.

import { ApiError, aborted, api, offline } from "./api.js";
import { errorBox, h, statusText } from "./dom.js";
import { TASK_FIELDS, samplingBody, samplingFields } from "./sampling.js";

const PARALLEL_CALLS = 6; // a browser's connections to one host
const REFRESH_MS = 500;
const LIST_LIMIT = 1000;
const GIVE_UP_MS = 60_000; // a row's calls that get no answer this long: the row ends as an error
const RETRY_MAX_MS = 5000; // the longest wait between two submits of a row (doubling from 500 ms)

export function mount(el) {
  const ctl = new AbortController();
  let rows = [], batch = null; // the batch running: {stopping}
  let loaded = null; // the file's prompts: {name, prompts}; null: the text box's lines
  const prompts = h("textarea", { name: "prompts", id: "batch-prompts", rows: 8, placeholder: "one prompt a line" });
  const file = h("input", { type: "file", id: "batch-file", accept: ".txt,.jsonl,text/plain" });
  const useText = h("button", { id: "batch-use-text", type: "button", class: "small", hidden: true },
    "Use the text box instead");
  const source = h("p", { id: "batch-source", class: "muted" });
  const summary = h("span", { id: "batch-summary", class: "muted" });
  const download = h("button", { id: "batch-download", type: "button", disabled: true }, "Download JSONL");
  const stopAll = h("button", { id: "batch-stop", type: "button", disabled: true }, "Stop all");
  const run = h("button", { id: "batch-run", type: "submit" }, "Run");
  const body = h("tbody", { id: "batch-rows" });
  const message = h("div", { id: "batch-message" });
  const form = h("form", { id: "batch-form", class: "stack card" },
    h("label", { class: "field" }, h("span", {}, "prompts, one a line (spaces are kept, blank lines skipped)"), prompts),
    h("label", { class: "field" },
      h("span", {}, "or a file (.txt: one a line; .jsonl: {\"prompt\": ...} a line, its prompt as written)"), file),
    h("div", { class: "row" }, source, useText),
    samplingFields(TASK_FIELDS, { max_tokens: 100 }), h("div", { class: "row" }, run, stopAll, download, summary));
  const table = h("table", { class: "list", id: "batch-table" },
    h("thead", {}, h("tr", {}, ["#", "prompt", "status", "tokens", "text"].map((c) => h("th", {}, c)))), body);
  el.append(h("h1", {}, "Batch"), form, message, h("div", { class: "table-wrap" }, table));
  const fail = (err) => { if (!aborted(err)) message.replaceChildren(errorBox(err)); };

  const chosen = () => (loaded ? loaded.prompts : linesOf(prompts.value));
  const showSource = () => {
    const n = chosen().length, some = `${n} prompt${n === 1 ? "" : "s"}`;
    source.textContent = loaded ? `Run uses the file ${loaded.name}: ${some}, each as the file has it (the text box is not used).`
      : `Run uses the text box: ${some}, one a line.`;
    Object.assign(source.dataset, { source: loaded ? "file" : "text", count: n });
    prompts.disabled = Boolean(loaded);
    useText.hidden = !loaded;
  };
  showSource();
  prompts.addEventListener("input", showSource);
  file.addEventListener("change", async () => {
    const f = file.files[0];
    loaded = null;
    message.replaceChildren();
    if (f) {
      const { prompts: list, bad } = promptsOf(await f.text(), /\.(jsonl|ndjson)$/i.test(f.name));
      if (bad.length) {
        file.value = "";
        const lines = `line${bad.length > 1 ? "s" : ""} ${bad.slice(0, 5).join(", ")}${bad.length > 5 ? ", ..." : ""}`;
        message.replaceChildren(errorBox(`${f.name}: ${lines} ${bad.length > 1 ? "are" : "is"} no JSON object`
          + " with a \"prompt\" (or \"text\") string; nothing was loaded"));
      } else {
        loaded = { name: f.name, prompts: list };
      }
    }
    showSource();
  });
  useText.addEventListener("click", () => {
    loaded = null;
    file.value = ""; // (choosing the same file again is a change)
    showSource();
  });
  const settle = () => {
    const ended = rows.filter((r) => r.done), failed = rows.filter((r) => r.result && r.result.error).length;
    summary.textContent = `${ended.length} of ${rows.length} done${failed ? ` (${failed} failed)` : ""}`;
  };
  form.addEventListener("submit", (ev) => {
    ev.preventDefault();
    const list = chosen();
    if (batch) return; // (Run is disabled meanwhile)
    if (!list.length) return message.replaceChildren(errorBox("no prompts: type some in the text box, or choose a file"));
    message.replaceChildren();
    rows = list.map((prompt, index) => newRow(prompt, index));
    body.replaceChildren(...rows.map((r) => r.tr));
    download.disabled = true;
    stopAll.disabled = false;
    run.disabled = true;
    batch = { stopping: false };
    settle();
    runBatch(rows, samplingBody(form, TASK_FIELDS), ctl.signal, batch, settle)
      .catch((err) => {
        fail(err);
        if (!aborted(err)) rows.filter((r) => !r.done).forEach((r) => failRow(r, `not finished: ${err.message}`));
      })
      .finally(() => {
        batch = null;
        settle();
        run.disabled = false;
        stopAll.disabled = true;
        download.disabled = false;
      });
  });
  stopAll.addEventListener("click", () => {
    if (batch) batch.stopping = true; // the rows not submitted yet are not; those being submitted stop then
    for (const r of rows.filter((r) => r.id && !r.done)) stopRow(r, ctl.signal).catch(fail);
  });
  download.addEventListener("click", () => saveJsonl(rows));
  return () => ctl.abort();
}

/** The text box's prompts: its lines as typed, less the blank ones. */
export function linesOf(text) {
  return text.split(/\r?\n/).filter((line) => line.trim() !== "");
}

/** Prompts of a file, each as the file has it: {prompts, bad}. A .jsonl file (`jsonl`): a line
 *  that is a JSON object gives its "prompt" (or "text") string, which may hold line ends and
 *  spaces; another line is a prompt as written; `bad` lists the lines (from 1) that start as
 *  an object but are none or have no such string. A .txt file: its lines. Blank lines are
 *  skipped. */
export function promptsOf(text, jsonl) {
  const prompts = [], bad = [];
  text.split(/\r?\n/).forEach((line, i) => {
    if (line.trim() === "") return;
    if (!jsonl || !line.trimStart().startsWith("{")) return prompts.push(line);
    let obj = null;
    try { obj = JSON.parse(line); } catch { /* bad */ }
    const prompt = obj && (typeof obj.prompt === "string" ? obj.prompt : typeof obj.text === "string" ? obj.text : null);
    if (typeof prompt === "string") prompts.push(prompt); else bad.push(i + 1);
  });
  return { prompts, bad };
}

function newRow(prompt, index) {
  const cells = { status: h("td", {}, "submitting"), tokens: h("span", { class: "num" }, "0"),
    bar: h("progress", { value: 0, max: 1 }), text: h("td", { class: "text-cell" }) };
  const tr = h("tr", { dataset: { index } }, h("td", { class: "num" }, index + 1),
    h("td", { class: "prompt-cell", title: prompt }, prompt), cells.status,
    h("td", { class: "progress" }, cells.tokens, cells.bar), cells.text);
  return { index, prompt, id: null, done: false, result: null, failing: null, tr, cells };
}

/** Stops the row's task; one gone meanwhile is no error (the refresh shows the row's end). */
function stopRow(row, signal) {
  return api(`/v1/tasks/${row.id}/stop`, { method: "POST", body: {}, signal }).catch((err) => {
    if (!gone(err)) throw err;
  });
}

function showRow(row, st, maxTokens) {
  row.cells.status.textContent = statusText(st);
  row.cells.tokens.textContent = st.generated_buf;
  row.cells.bar.max = Math.max(Number(maxTokens) || st.generated_buf || 1, st.generated_buf);
  row.cells.bar.value = st.generated_buf;
}

/** The row ends as an error (its result: {error}); the batch goes on. */
function failRow(row, message) {
  Object.assign(row, { done: true, result: { error: message } });
  row.cells.status.textContent = `error: ${message}`;
  row.cells.status.className = "error";
  row.tr.dataset.error = "1";
}

/** A call worth trying again: no answer (or a 502-504, a server starting or stopping), or 429. */
const transient = (err) => offline(err) || (err instanceof ApiError && err.status === 429);

const gone = (err) => err instanceof ApiError && err.status === 404;
const GONE = "the task is gone: deleted (by another client or page), or expired (the server drops a TMP_ task"
  + " once it has been finished for --tmp-task-ttl)";

/** A call of `rows` failed: a transient error is tried again at the next refresh, until the row
 *  has had no answer for GIVE_UP_MS; another ends the rows as errors. */
function trouble(rows, err) {
  if (aborted(err)) throw err;
  const now = Date.now();
  for (const row of rows) {
    if (!transient(err)) {
      failRow(row, gone(err) ? GONE : err.message);
      continue;
    }
    row.failing ??= now;
    if (now - row.failing >= GIVE_UP_MS) failRow(row, `no answer for ${GIVE_UP_MS / 1000} s: ${err.message}`);
    else row.cells.status.textContent = `retrying (${err.message})`;
  }
}

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

async function pool(items, fn) {
  let next = 0;
  const worker = async () => { while (next < items.length) await fn(items[next++]); };
  await Promise.all(Array.from({ length: Math.min(PARALLEL_CALLS, items.length) }, worker));
}

/** Submits and follows the rows until every one is done (a result or an error); an abort (the
 *  page was left) ends it at once. */
async function runBatch(rows, params, signal, batch, changed) {
  const maxTokens = params.max_tokens;
  const submitted = pool(rows, async (row) => {
    for (let attempt = 0; ; attempt++) {
      if (batch.stopping) {
        failRow(row, "not run: the batch was stopped");
        return changed();
      }
      try {
        const t = await api("/v1/tasks/tmp", { method: "POST", body: { prompt: row.prompt, ...params }, signal });
        row.id = t.task_id;
        row.tr.dataset.taskId = t.task_id;
        row.cells.status.textContent = "submitted";
        if (batch.stopping) await stopRow(row, signal).catch(() => {}); // Stop all came meanwhile
        return;
      } catch (err) {
        trouble([row], err);
        if (row.done) return changed();
        await sleep(Math.min(RETRY_MAX_MS, 500 * 2 ** attempt));
        if (signal.aborted) return;
      }
    }
  });
  let submitting = true;
  const settled = submitted.catch(() => {}).then(() => { submitting = false; }); // an abort ends the loop below
  for (;;) {
    const pause = sleep(REFRESH_MS);
    await (submitting ? Promise.race([settled, pause]) : pause);
    if (signal.aborted) return;
    await refresh(rows.filter((r) => r.id && !r.done), maxTokens, signal);
    changed();
    if (!submitting && rows.every((r) => r.done)) return;
  }
}

/** One refresh: progress of every unfinished row, the text of each row that finished. */
async function refresh(open, maxTokens, signal) {
  if (!open.length) return;
  let seen;
  try {
    const list = await api("/v1/tasks/list", { query: { kind: "tmp", limit: LIST_LIMIT }, signal });
    seen = new Map((list.tasks || []).map((t) => [t.task_id, t]));
  } catch (err) {
    return trouble(open, err);
  }
  const missing = open.filter((r) => !seen.has(r.id)).slice(0, PARALLEL_CALLS); // gone, or past the list's limit
  await pool(missing, async (r) => {
    try { seen.set(r.id, await api(`/v1/tasks/${r.id}/status`, { signal })); } catch (err) { trouble([r], err); }
  });
  const finished = [];
  for (const row of open) {
    const st = seen.get(row.id);
    if (!st || row.done) continue;
    if (st.status !== 3) row.failing = null; // (a finished row's failing get_result goes on counting)
    showRow(row, st, maxTokens);
    if (st.status === 3) finished.push(row);
  }
  await pool(finished, async (row) => {
    let r;
    try { r = await api(`/v1/tasks/${row.id}/get_result`, { signal }); } catch (err) { return trouble([row], err); }
    row.result = { text: r.result, finish_reason: r.finish_reason, completion_tokens: r.completion_tokens,
      prompt_tokens: r.prompt_tokens, speed: r.speed };
    row.done = true;
    row.cells.text.textContent = r.result;
    row.tr.dataset.done = "1";
  });
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

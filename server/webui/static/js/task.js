// One task or template. A task's page streams its text (GET /v1/tasks/{id}/stream?pos=0: the
// text so far, then live), follows later runs (taskView), and has stop, continue (with a
// prompt), fork, make template and delete (actions.js). A template's page shows its prompt and
// forks it with a prompt. Both poll the task every POLL_MS: one deleted (or, a TMP_ task,
// expired) meanwhile (a 404) ends the page's polling (gone). Opened while the server does not
// answer, the page says so and asks again every RETRY_MS until it does. An action's error goes
// once the task's status changes (a 409 "task is running" once it has finished); continue,
// fork and make template, which the server refuses while the task runs, are disabled meanwhile.

import { continueForm, deleteButton, forkForm, templateForm } from "./actions.js";
import { ApiError, aborted, api, offline, sse } from "./api.js";
import { errorBox, every, h, isStateOrigin, kindOf, statusText, taskLink, when } from "./dom.js";
import { stringify } from "./json.js";
import { textSink } from "./output.js";

export { appendText } from "./output.js"; // for test_webui_tasks.py

const path = (id, action) => `/v1/tasks/${encodeURIComponent(id)}/${action}`;
const detailPath = (id) => `/v1/ui/tasks/${encodeURIComponent(id)}`;
const POLL_MS = 1000;
const RETRY_MS = 2000; // the first load's, while the server is down (as the header's /health)

export function mount(el, id) {
  let current = null;
  const reload = () => {
    if (current) current();
    el.replaceChildren();
    current = show(el, id, reload);
  };
  reload();
  return () => current && current();
}

function show(el, id, reload) {
  const ctl = new AbortController();
  const stops = [() => ctl.abort()];
  const message = h("div", { id: "task-message" });
  el.append(h("h1", {}, h("span", { class: "mono" }, id)), message);
  let shown = false; // the page shows the task: a 404 from now on means it was deleted
  const fail = (err) => {
    if (aborted(err)) return;
    if (shown && deleted(err)) return gone(el, id, message, stops);
    const tmpGone = !shown && deleted(err) && kindOf(id) === "tmp";
    message.replaceChildren(errorBox(tmpGone ? `${err.message}: ${TMP_GONE}` : err));
    message.dataset.offline = offline(err) ? "1" : "";
  };
  // a call went through: the message of one that got no answer (the server was down) goes
  const online = () => {
    if (message.dataset.offline === "1") message.replaceChildren();
    message.dataset.offline = "";
  };
  // the task's status changed: an error an action met (a 409 while it ran) is no longer true
  const changed = () => {
    if (message.dataset.offline !== "1" && !message.querySelector("#task-gone")) message.replaceChildren();
  };
  let retry = null;
  stops.push(() => clearTimeout(retry));
  // the first load; while the server does not answer (down, starting, loading: `offline`), its
  // message stays and the load is tried again; any other error (an unknown id) ends the page
  const load = () => api(detailPath(id), { signal: ctl.signal, exact: true }).then((detail) => {
    online();
    const ctx = { id, el, signal: ctl.signal, fail, online, changed, reload, stops, detail };
    shown = true;
    detail.kind === "template" ? templateView(ctx) : taskView(ctx);
  }).catch((err) => {
    fail(err);
    if (offline(err) && !ctl.signal.aborted) retry = setTimeout(load, RETRY_MS);
  });
  load();
  return () => stops.forEach((fn) => fn());
}

const deleted = (err) => err instanceof ApiError && err.status === 404 && err.code === "task_not_found";

/** Why a TMP_ task's 404 may come: the API answers the same "not found" for both. */
const TMP_GONE = "it was deleted (by another client or page), or it expired: the server drops a TMP_ task"
  + " once it has been finished for --tmp-task-ttl (10 minutes by default)";

/** The task was deleted (by another client or page), or a TMP_ task expired, while its page was
 *  open: the page says so, stops its poll and stream, and disables its actions. */
function gone(el, id, message, stops) {
  stops.forEach((fn) => fn());
  const tmp = kindOf(id) === "tmp";
  message.dataset.offline = "";
  message.replaceChildren(h("p", { id: "task-gone", class: "error", role: "alert" },
    `This task no longer exists: ${tmp ? TMP_GONE : "it was deleted (by another client or page)"}.`));
  for (const c of el.querySelectorAll("button, input, textarea, select")) c.disabled = true;
  const status = el.querySelector("#task-status");
  if (status) Object.assign(status, { textContent: tmp ? "deleted or expired" : "deleted", className: "st-gone" });
}

function infoTable(detail) {
  const status = h("dd", { id: "task-status", class: `st-${detail.status}` }, statusText(detail));
  const tokens = h("dd", { id: "task-tokens" }, detail.generated_buf);
  const promptTokens = h("dd", { id: "task-prompt-tokens" }, detail.prompt_tokens);
  const params = h("dd", { id: "task-params", class: "mono" }, stringify(detail.params || {}));
  const dl = h("dl", { class: "info" },
    h("dt", {}, "kind"), h("dd", { id: "task-kind" }, detail.kind),
    h("dt", {}, "status"), status, h("dt", {}, "tokens generated"), tokens,
    h("dt", {}, "prompt tokens"), promptTokens,
    h("dt", {}, "created"), h("dd", {}, when(detail.created_at)),
    h("dt", {}, "parent"), h("dd", {}, taskLink(detail.parent_id) || "none"),
    h("dt", {}, "made as"), h("dd", { id: "task-tag" }, detail.tag || "a task"),
    h("dt", {}, "parameters"), params);
  /** st: a poll's brief detail (counters), or a whole detail (with params). */
  const update = (st) => {
    status.textContent = statusText(st);
    status.className = `st-${st.status}`;
    tokens.textContent = st.generated_buf;
    promptTokens.textContent = st.prompt_tokens;
    if (st.params) params.textContent = stringify(st.params);
  };
  return { dl, update };
}

/** The last prompt; a prompt of token ids has no text (prompt_len counts its tokens), a
 *  template made from a state file and a fork made without a prompt have none. */
const promptText = (detail) => {
  if (detail.prompt) return detail.prompt;
  if (detail.prompt_len) return "(token ids)";
  return isStateOrigin(detail.parent_id) ? "(state file)" : "(none)";
};

/** A task's page follows its runs: the stream shows the current output; once it has ended, the
 *  status poll watches for a later run (this page's continue, or another client's). A run that
 *  goes on with the same output (a continue without a prompt) is streamed from where the text
 *  stopped (`pos`); a run with a new prompt started a new output (`output_start` moved): the
 *  page shows its prompt and streams it from 0, as it does an output it may show more of than
 *  the server has: its stream's connection broke (a restarted server keeps only what its last
 *  progress write stored, and a continue makes the rest again), the server's output is
 *  shorter than the text shown, or the text shown ends with a U+FFFD that a continue takes back
 *  (cutShort). A run on another server of the database (the detail's `elsewhere`, or its
 *  stream's 409 task_running_elsewhere) is watched by `elsewhere`. */
function taskView(ctx) {
  const { id, el, detail, signal, fail, online, changed, stops } = ctx;
  const info = infoTable(detail);
  const prompt = h("pre", { id: "task-prompt", class: "text prompt" }, promptText(detail));
  const output = h("pre", { id: "task-output", class: "text" });
  const stopButton = h("button", { id: "task-stop", type: "button", disabled: detail.status === 3 }, "Stop");
  stopButton.addEventListener("click", () => {
    api(path(id, "stop"), { method: "POST", body: {}, signal }).catch(fail);
  });
  const note = h("div", { id: "task-note" });
  const actions = h("div", { class: "actions" },
    continueForm(ctx), forkForm(ctx), templateForm(ctx), deleteButton(ctx, false));
  el.append(info.dl, h("h2", {}, "Prompt"), prompt, h("h2", {}, "Output ", stopButton), note, output, actions);
  const refused = actions.querySelectorAll( // what the server answers 409 while the task runs
    "#continue-form [type=submit], #fork-form [type=submit], #template-form [type=submit]");
  let status = detail.status;
  /** The task's status (3: finished): the buttons follow it, an action's error goes when it changes. */
  const busy = (now) => {
    if (now !== status) changed();
    status = now;
    stopButton.disabled = now === 3;
    for (const b of refused) {
      b.disabled = now !== 3;
      b.title = now === 3 ? "" : "the task is running: stop it, or wait until it finishes";
    }
  };

  // start: the output's place in the history; pos: its tokens shown; ends: streams ended so far;
  // lost: a stream's connection broke (the text shown may be ahead of the server's)
  const run = { start: detail.output_start, pos: 0, streaming: false, ends: 0, lost: false };
  const away = elsewhere({ id, signal, output, note, busy,
    buttons: () => [stopButton, ...actions.querySelectorAll("button")] });
  const attach = () => {
    run.streaming = true;
    delete output.dataset.done;
    follow(output, id, run, signal, () => busy(3))
      .catch((err) => {
        run.lost ||= offline(err);
        return away.isMoved(err) ? away.enter(err) : fail(err);
      })
      .catch(fail)
      .finally(() => { run.streaming = false; run.ends++; });
  };
  const newOutput = async () => {
    const fresh = await api(detailPath(id), { signal, exact: true });
    prompt.textContent = promptText(fresh);
    info.update(fresh);
    output.replaceChildren();
    Object.assign(run, { start: fresh.output_start, pos: 0, lost: false });
  };
  if (detail.elsewhere) away.enter(detail.elsewhere).catch(fail); // no stream to ask for: its 409 is known
  else {
    busy(detail.status);
    attach();
  }
  const pollOnce = async () => {
    const ends = run.ends;
    const st = await api(detailPath(id), { query: { brief: true }, signal });
    online();
    info.update(st);
    if (away.active()) {
      if (await away.watch(st)) return; // still running there: its committed text is shown
      await newOutput(); // it has finished there (or moved here): stream it whole
      return attach();
    }
    if (run.streaming || ends !== run.ends) return; // streaming, or this answer predates the stream's end
    busy(st.status); // (while a stream runs, its end says when the run has finished)
    const fresh = st.output_start !== run.start || run.lost || st.generated_buf < run.pos;
    if (!fresh && st.status === 3 && st.generated_buf === run.pos) return; // nothing new
    if (fresh || cutShort(output)) await newOutput();
    attach();
  };
  stops.push(every(POLL_MS, () => pollOnce().catch(fail))); // a 404: the task was deleted (gone stops it)
}

/** The text shown ends with U+FFFD: the first bytes of a character that the last run's end cut.
 *  A continue without a prompt takes that U+FFFD back and writes the whole character in its
 *  place (docs/task-api.md, continue), so the page streams that output anew, not from `pos`,
 *  where the U+FFFD would stay shown before the character. */
const cutShort = (pre) => (pre.lastElementChild?.textContent ?? "").endsWith("\ufffd");

/** The task runs on another server of the database: this one cannot stream it, nor stop,
 *  continue, fork, make a template of or delete it (each a 409). `enter` shows the 409's message
 *  (it names that server), the text that server last committed, and disables those buttons;
 *  `watch`, given each status poll, refreshes that text and answers true while the task still
 *  runs there; once it has finished (or runs on another instance), it enables them again. */
function elsewhere({ id, signal, output, note, buttons, busy }) {
  let instance; // the server running it; undefined: not watching
  let entering = false; // enter is reading the committed text: the poll must not stream meanwhile
  let shown = -1; // the poll's generated_buf when the text shown was read
  const committed = async () => {
    const r = await api(path(id, "get_result"), { signal });
    if (!r.finished) output.textContent = r.result || ""; // a finished one: the poll streams it
    return r;
  };
  const lock = (on) => buttons().forEach((b) => { b.disabled = on; });
  return {
    isMoved: (err) => err && err.code === "task_running_elsewhere",
    active: () => entering || instance !== undefined,
    async enter(err) {
      entering = true;
      try {
        const r = await committed();
        if (r.finished) return; // it finished meanwhile
        instance = r.instance ?? null;
        shown = -1;
        note.replaceChildren(h("p", { id: "task-elsewhere", class: "muted" }, err.message));
        lock(true);
      } finally {
        entering = false;
      }
    },
    async watch(st) {
      if (entering) return true; // (the page's first poll can come before enter's answer)
      if (st.status !== 3 && st.instance === instance) {
        if (st.generated_buf !== shown) {
          await committed();
          shown = st.generated_buf;
        }
        return true;
      }
      instance = undefined;
      note.replaceChildren();
      lock(false);
      busy(st.status); // Stop, and the actions refused while it runs
      return false;
    },
  };
}

/** Appends the task's text from token `run.pos` to `pre` as it streams (`run.pos` follows);
 *  resolves at the stream's end, with all of it shown. `finished()`: the run's end came. */
async function follow(pre, id, run, signal, finished) {
  const sink = textSink(pre);
  try {
    for await (const ev of sse(path(id, "stream"), { query: { pos: run.pos }, signal })) {
      if (ev.pos !== undefined) run.pos = ev.pos;
      if (typeof ev.data === "string") sink.add(ev.data);
      else if (ev.finished) {
        pre.dataset.finishReason = ev.finish_reason || "";
        finished();
      }
      pre.dataset.pos = run.pos;
    }
  } finally {
    sink.flush(); // what came before an end or an error is shown too
  }
  pre.dataset.done = "1";
}

/** A template's page; its poll (as a task page's) shows one deleted meanwhile as gone, and the
 *  message of a server that was down goes once it answers again. */
function templateView(ctx) {
  const { id, el, detail, signal, fail, online, stops } = ctx;
  const info = infoTable(detail);
  const result = h("pre", { id: "template-text", class: "text" });
  el.append(info.dl,
    h("h2", {}, "Prompt"), h("pre", { id: "task-prompt", class: "text prompt" }, promptText(detail)),
    h("h2", {}, "Text generated before it became a template"), result,
    h("div", { class: "actions" }, forkForm(ctx, "Fork this template with a prompt"), deleteButton(ctx, true)));
  api(path(id, "get_result"), { signal }).then((r) => { result.textContent = r.result || "(none)"; }).catch(fail);
  const pollOnce = async () => {
    info.update(await api(detailPath(id), { query: { brief: true }, signal }));
    online();
  };
  stops.push(every(POLL_MS, () => pollOnce().catch(fail))); // a 404: the template was deleted (gone stops it)
}

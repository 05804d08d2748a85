// One task or template. A task's page streams its text (GET /v1/tasks/{id}/stream?pos=0: the
// text so far, then live), follows later runs (taskView), and has stop, continue (with a
// prompt), fork, make template and delete. A template's page shows its prompt and forks it
// with a prompt.

import { aborted, api, sse } from "./api.js";
import { errorBox, every, field, h, statusText, taskLink, when } from "./dom.js";
import { templateNameError } from "./newtask.js";
import { TASK_FIELDS, samplingBody, samplingFields } from "./sampling.js";

const path = (id, action) => `/v1/tasks/${encodeURIComponent(id)}/${action}`;

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
  const fail = (err) => { if (!aborted(err)) message.replaceChildren(errorBox(err)); };
  api(`/v1/ui/tasks/${encodeURIComponent(id)}`, { signal: ctl.signal }).then((detail) => {
    const ctx = { id, el, signal: ctl.signal, fail, reload, stops, detail };
    detail.kind === "template" ? templateView(ctx) : taskView(ctx);
  }).catch(fail);
  return () => stops.forEach((fn) => fn());
}

function infoTable(detail) {
  const status = h("dd", { id: "task-status", class: `st-${detail.status}` }, statusText(detail));
  const tokens = h("dd", { id: "task-tokens" }, detail.generated_buf);
  const promptTokens = h("dd", { id: "task-prompt-tokens" }, detail.prompt_tokens);
  const params = h("dd", { id: "task-params", class: "mono" }, JSON.stringify(detail.params || {}));
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
    if (st.params) params.textContent = JSON.stringify(st.params);
  };
  return { dl, update };
}

const detailPath = (id) => `/v1/ui/tasks/${encodeURIComponent(id)}`;
const promptText = (detail) => detail.prompt || "(token ids)";

/** A task's page follows its runs: the stream shows the current output; once it has ended, the
 *  status poll watches for a later run (this page's continue, or another client's). A run that
 *  goes on with the same output (a continue without a prompt) is streamed from where the text
 *  stopped (`pos`); a run with a new prompt started a new output (`output_start` moved): the
 *  page shows its prompt and streams it from 0. */
function taskView(ctx) {
  const { id, el, detail, signal, fail, stops } = ctx;
  const info = infoTable(detail);
  const prompt = h("pre", { id: "task-prompt", class: "text prompt" }, promptText(detail));
  const output = h("pre", { id: "task-output", class: "text" });
  const stopButton = h("button", { id: "task-stop", type: "button", disabled: detail.status === 3 }, "Stop");
  stopButton.addEventListener("click", () => {
    api(path(id, "stop"), { method: "POST", body: {}, signal }).catch(fail);
  });
  el.append(info.dl, h("h2", {}, "Prompt"), prompt, h("h2", {}, "Output ", stopButton), output,
    h("div", { class: "actions" }, continueForm(ctx), forkForm(ctx), templateForm(ctx), deleteButton(ctx, false)));

  // start: the output's place in the history; pos: its tokens shown; ends: streams ended so far
  const run = { start: detail.output_start, pos: 0, streaming: false, ends: 0 };
  const attach = () => {
    run.streaming = true;
    delete output.dataset.done;
    follow(output, id, run, signal).catch(fail).finally(() => { run.streaming = false; run.ends++; });
  };
  const newOutput = async () => {
    const fresh = await api(detailPath(id), { signal });
    prompt.textContent = promptText(fresh);
    info.update(fresh);
    output.replaceChildren();
    run.start = fresh.output_start;
    run.pos = 0;
  };
  attach();
  const poll = every(1000, async () => {
    const ends = run.ends;
    const st = await api(detailPath(id), { query: { brief: true }, signal });
    info.update(st);
    stopButton.disabled = st.status === 3;
    if (run.streaming || ends !== run.ends) return; // streaming, or this answer predates the stream's end
    if (st.output_start !== run.start) await newOutput();
    else if (st.status === 3 && st.generated_buf === run.pos) return; // nothing new
    attach();
  });
  stops.push(poll);
}

/** Appends the task's text from token `run.pos` to `pre` as it streams (`run.pos` follows);
 *  resolves at the stream's end. */
async function follow(pre, id, run, signal) {
  for await (const ev of sse(path(id, "stream"), { query: { pos: run.pos }, signal })) {
    if (ev.pos !== undefined) run.pos = ev.pos;
    if (typeof ev.data === "string") {
      const atBottom = pre.scrollHeight - pre.scrollTop - pre.clientHeight < 40;
      pre.append(ev.data);
      if (atBottom) pre.scrollTop = pre.scrollHeight;
    } else if (ev.finished) {
      pre.dataset.finishReason = ev.finish_reason || "";
    }
    pre.dataset.pos = run.pos;
  }
  pre.dataset.done = "1";
}

function templateView(ctx) {
  const { id, el, detail, signal, fail } = ctx;
  const result = h("pre", { id: "template-text", class: "text" });
  el.append(infoTable(detail).dl,
    h("h2", {}, "Prompt"), h("pre", { id: "task-prompt", class: "text prompt" }, detail.prompt || "(token ids)"),
    h("h2", {}, "Text generated before it became a template"), result,
    h("div", { class: "actions" }, forkForm(ctx, "Fork this template with a prompt"), deleteButton(ctx, true)));
  api(path(id, "get_result"), { signal }).then((r) => { result.textContent = r.result || "(none)"; }).catch(fail);
}

function actionForm(formId, title, children, onSubmit, fail) {
  const form = h("form", { id: formId, class: "stack card" }, h("h3", {}, title), ...children);
  form.addEventListener("submit", (ev) => {
    ev.preventDefault();
    onSubmit(form).catch(fail);
  });
  return form;
}

function moreFields() {
  return h("details", {}, h("summary", {}, "sampling"), samplingFields(TASK_FIELDS.filter((f) => f.name !== "max_tokens")));
}

function updateBody(form) {
  const body = samplingBody(form, TASK_FIELDS);
  const prompt = form.elements.prompt.value;
  if (prompt) body.prompt = prompt;
  return body;
}

function continueForm({ id, signal, reload, fail }) {
  return actionForm("continue-form", "Continue", [
    field("prompt (optional: without one it keeps generating)", "prompt", { tag: "textarea", rows: 2 }),
    field("max tokens", "max_tokens", { type: "number", min: 0, value: 200 }), moreFields(),
    h("button", { type: "submit" }, "Continue")],
  async (form) => {
    await api(path(id, "continue"), { method: "POST", body: updateBody(form), signal });
    reload();
  }, fail);
}

function forkForm({ id, signal, fail }, title = "Fork") {
  return actionForm("fork-form", title, [
    field("prompt (optional)", "prompt", { tag: "textarea", rows: 2 }),
    field("max tokens", "max_tokens", { type: "number", min: 0, value: 200 }), moreFields(),
    h("button", { type: "submit" }, "Fork")],
  async (form) => {
    const t = await api(path(id, "fork"), { method: "POST", body: updateBody(form), signal });
    location.hash = `#/tasks/${encodeURIComponent(t.task_id)}`;
  }, fail);
}

function templateForm({ id, signal, fail }) {
  return actionForm("template-form", "Make a template", [
    field("name (optional; else _TMPL_…)", "name", { maxlength: 64 }),
    h("button", { type: "submit" }, "Make template")],
  async (form) => {
    const name = form.elements.name.value.trim();
    const bad = templateNameError(name);
    if (bad) throw new Error(bad);
    const t = await api(path(id, "as_template"), { method: "POST", body: {}, query: { name }, signal });
    location.hash = `#/tasks/${encodeURIComponent(t.task_id)}`;
  }, fail);
}

/** Delete needs a second click within a few seconds. Templates are deleted with force=true. */
function deleteButton({ id, signal, fail }, force) {
  let armed = null;
  const button = h("button", { id: "task-delete", type: "button", class: "danger" }, "Delete");
  button.addEventListener("click", async () => {
    if (!armed) {
      button.textContent = "Click again to delete";
      armed = setTimeout(() => { armed = null; button.textContent = "Delete"; }, 4000);
      return;
    }
    clearTimeout(armed);
    try {
      await api(path(id, "delete"), { method: "POST", body: {}, query: { force: force || undefined }, signal });
      location.hash = "#/tasks";
    } catch (err) { fail(err); }
  });
  return h("div", { class: "card" }, h("h3", {}, "Delete"), button);
}

// One task or template. A task's page streams its text (GET /v1/tasks/{id}/stream?pos=0: the
// text so far, then live) and has stop, continue (with a prompt), fork, make template and
// delete. A template's page shows its prompt and forks it with a prompt.

import { aborted, api, sse } from "./api.js";
import { errorBox, every, field, h, statusText, taskLink, when } from "./dom.js";
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
  const dl = h("dl", { class: "info" },
    h("dt", {}, "kind"), h("dd", { id: "task-kind" }, detail.kind),
    h("dt", {}, "status"), status, h("dt", {}, "tokens generated"), tokens,
    h("dt", {}, "prompt tokens"), h("dd", {}, detail.prompt_tokens),
    h("dt", {}, "created"), h("dd", {}, when(detail.created_at)),
    h("dt", {}, "parent"), h("dd", {}, taskLink(detail.parent_id) || "none"),
    h("dt", {}, "parameters"), h("dd", { class: "mono" }, JSON.stringify(detail.params || {})));
  const update = (st) => {
    status.textContent = statusText(st);
    status.className = `st-${st.status}`;
    tokens.textContent = st.generated_buf;
  };
  return { dl, update };
}

function taskView(ctx) {
  const { id, el, detail, signal, fail, stops } = ctx;
  const info = infoTable(detail);
  const output = h("pre", { id: "task-output", class: "text" });
  const stopButton = h("button", { id: "task-stop", type: "button", disabled: detail.status === 3 }, "Stop");
  stopButton.addEventListener("click", () => {
    api(path(id, "stop"), { method: "POST", body: {}, signal }).catch(fail);
  });
  el.append(info.dl,
    h("h2", {}, "Prompt"), h("pre", { id: "task-prompt", class: "text prompt" }, detail.prompt || "(token ids)"),
    h("h2", {}, "Output ", stopButton), output,
    h("div", { class: "actions" }, continueForm(ctx), forkForm(ctx), templateForm(ctx), deleteButton(ctx, false)));
  const poll = every(1000, async () => {
    const st = await api(path(id, "status"), { signal });
    info.update(st);
    stopButton.disabled = st.status === 3;
  });
  stops.push(poll);
  follow(output, id, signal).then(() => { stopButton.disabled = true; }).catch(fail);
}

/** Appends the task's text to `pre` as it streams; resolves at the stream's end. */
async function follow(pre, id, signal) {
  for await (const ev of sse(path(id, "stream"), { query: { pos: 0 }, signal })) {
    if (typeof ev.data === "string") {
      const atBottom = pre.scrollHeight - pre.scrollTop - pre.clientHeight < 40;
      pre.append(ev.data);
      if (ev.pos !== undefined) pre.dataset.pos = ev.pos;
      if (atBottom) pre.scrollTop = pre.scrollHeight;
    } else if (ev.finished) {
      pre.dataset.finishReason = ev.finish_reason || "";
    }
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

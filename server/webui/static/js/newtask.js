// The Tasks page's "New task" form: creates a TASK_ (POST /v1/tasks/create), or with "prefill
// only" a template: a max_tokens 0 task, then as_template once it has finished. The template
// name is checked first (nothing is created for a bad one); should anything fail once the task
// exists, the task is deleted again, so a failed attempt leaves nothing behind.

import { aborted, api } from "./api.js";
import { errorBox, field, h } from "./dom.js";
import { TASK_FIELDS, samplingBody, samplingFields } from "./sampling.js";

const NAME = /^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$/; // the server's rule (server/tasks/manager.py)

/** Why `name` cannot name a template, or "" when it can (an empty name: the server picks one). */
export function templateNameError(name) {
  if (!name || NAME.test(name)) return "";
  return "template name: 1-64 of letters, digits, '_', '-', '.', starting with a letter or digit";
}

export function newTaskForm(signal) {
  const out = h("div", { id: "new-task-message" });
  const form = h("form", { id: "new-task", class: "stack" },
    field("Prompt", "prompt", { tag: "textarea", rows: 3, required: true }),
    h("div", { class: "row" }, samplingFields(TASK_FIELDS, { max_tokens: 200 }),
      h("label", { class: "field check" }, h("input", { type: "checkbox", name: "template" }),
        h("span", {}, "prefill only, then make it a template named"),
        h("input", { name: "template_name", placeholder: "name (optional)", size: 12, maxlength: 64 }))),
    h("div", { class: "row" }, h("button", { type: "submit" }, "Create task")), out);
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    out.replaceChildren();
    const body = { prompt: form.elements.prompt.value, ...samplingBody(form, TASK_FIELDS) };
    const asTemplate = form.elements.template.checked;
    const name = form.elements.template_name.value.trim();
    try {
      if (asTemplate) {
        const bad = templateNameError(name);
        if (bad) throw new Error(bad);
        body.max_tokens = 0;
      }
      let t = await api("/v1/tasks/create", { method: "POST", body, signal });
      if (asTemplate) t = await makeTemplate(t.task_id, name, signal);
      location.hash = `#/tasks/${encodeURIComponent(t.task_id)}`;
    } catch (err) {
      if (!aborted(err)) out.replaceChildren(errorBox(err));
    }
  });
  return h("details", { class: "card" }, h("summary", {}, "New task"), form);
}

/** The finished prefill task `id` as a template; on failure `id` is deleted, then the error thrown. */
async function makeTemplate(id, name, signal) {
  const path = (action) => `/v1/tasks/${encodeURIComponent(id)}/${action}`;
  try {
    await waitFinished(path("status"), signal);
    return await api(path("as_template"), { method: "POST", body: {}, query: { name }, signal });
  } catch (err) {
    // no signal: the clean-up runs even when the page was left meanwhile
    const left = await api(path("delete"), { method: "POST", body: {} }).then(() => null, (e) => e);
    if (left && !aborted(err)) throw new Error(`${err.message} (the task ${id} could not be deleted: ${left.message})`);
    throw err;
  }
}

async function waitFinished(statusPath, signal) {
  for (;;) {
    const st = await api(statusPath, { signal });
    if (st.status === 3) return st;
    await new Promise((r) => setTimeout(r, 200));
  }
}

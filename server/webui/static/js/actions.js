// The task and template pages' action forms (task.js): continue (with a prompt), fork, make
// template, delete. Each gets the page's ctx: {id, signal, reload, fail}.

import { api } from "./api.js";
import { errorBox, field, h } from "./dom.js";
import { templateNameError } from "./newtask.js";
import { TASK_FIELDS, samplingBody, samplingFields } from "./sampling.js";

const path = (id, action) => `/v1/tasks/${encodeURIComponent(id)}/${action}`;

/** A value the form itself refuses (nothing was sent): shown in the form, not on the page. */
class InputError extends Error {}

/** A form whose submit runs `onSubmit(form)`. An InputError shows in the form until its input
 *  changes or it is submitted again (the page's polls leave it alone); other errors go to `fail`. */
function actionForm(formId, title, children, onSubmit, fail) {
  const note = h("div", { class: "form-note" });
  const form = h("form", { id: formId, class: "stack card" }, h("h3", {}, title), ...children, note);
  form.addEventListener("input", () => note.replaceChildren());
  form.addEventListener("submit", (ev) => {
    ev.preventDefault();
    note.replaceChildren();
    onSubmit(form).catch((err) => (err instanceof InputError ? note.replaceChildren(errorBox(err)) : fail(err)));
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

export function continueForm({ id, signal, reload, fail }) {
  return actionForm("continue-form", "Continue", [
    field("prompt (optional: without one it keeps generating)", "prompt", { tag: "textarea", rows: 2 }),
    field("max tokens", "max_tokens", { type: "number", min: 0, value: 200 }), moreFields(),
    h("button", { type: "submit" }, "Continue")],
  async (form) => {
    await api(path(id, "continue"), { method: "POST", body: updateBody(form), signal });
    reload();
  }, fail);
}

export function forkForm({ id, signal, fail }, title = "Fork") {
  return actionForm("fork-form", title, [
    field("prompt (optional)", "prompt", { tag: "textarea", rows: 2 }),
    field("max tokens", "max_tokens", { type: "number", min: 0, value: 200 }), moreFields(),
    h("button", { type: "submit" }, "Fork")],
  async (form) => {
    const t = await api(path(id, "fork"), { method: "POST", body: updateBody(form), signal });
    location.hash = `#/tasks/${encodeURIComponent(t.task_id)}`;
  }, fail);
}

export function templateForm({ id, signal, fail }) {
  return actionForm("template-form", "Make a template", [
    field("name (optional; else _TMPL_…)", "name", { maxlength: 64 }),
    h("button", { type: "submit" }, "Make template")],
  async (form) => {
    const name = form.elements.name.value.trim();
    const bad = templateNameError(name);
    if (bad) throw new InputError(bad);
    const t = await api(path(id, "as_template"), { method: "POST", body: {}, query: { name }, signal });
    location.hash = `#/tasks/${encodeURIComponent(t.task_id)}`;
  }, fail);
}

/** Delete needs a second click within a few seconds. Templates are deleted with force=true. */
export function deleteButton({ id, signal, fail }, force) {
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

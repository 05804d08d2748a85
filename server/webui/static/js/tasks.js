// Tasks: the key's tasks and templates, refreshed every second (GET /v1/tasks/list), with a
// kind / status filter, a search box, and a form that creates a task.

import { aborted, api } from "./api.js";
import { errorBox, every, field, h, statusText, taskLink, when } from "./dom.js";
import { TASK_FIELDS, samplingBody, samplingFields } from "./sampling.js";

const REFRESH_MS = 1000;
const PAGE = 500;

export function mount(el) {
  const ctl = new AbortController();
  const filters = h("form", { class: "row filters", onsubmit: (ev) => ev.preventDefault() },
    h("select", { name: "kind", id: "filter-kind", onchange: () => { seen = ""; refresh(); } },
      h("option", { value: "" }, "all kinds"), h("option", { value: "task" }, "tasks (TASK_)"),
      h("option", { value: "tmp" }, "temporary (TMP_)"), h("option", { value: "template" }, "templates")),
    h("select", { name: "status", id: "filter-status", onchange: () => render() },
      h("option", { value: "" }, "any status"), h("option", { value: "running" }, "running or queued"),
      h("option", { value: "finished" }, "finished")),
    h("input", { type: "search", name: "q", id: "filter-search", placeholder: "search id, parent, finish reason",
      oninput: () => render() }));
  const count = h("span", { class: "muted", id: "task-count" });
  const body = h("tbody", { id: "task-rows" });
  const table = h("table", { class: "list" },
    h("thead", {}, h("tr", {}, ["id", "kind", "status", "tokens", "created", "parent"].map((c) => h("th", {}, c)))),
    body);
  const message = h("div");
  el.append(h("h1", {}, "Tasks"), newTaskForm(ctl.signal), filters, count, message, table);

  let rows = [], seen = "";
  const render = () => {
    const status = filters.elements.status.value;
    const q = filters.elements.q.value.trim().toLowerCase();
    const shown = rows.filter((t) => (status === "" || (status === "finished") === (t.status === 3))
      && (!q || [t.task_id, t.parent_id, t.finish_reason, t.kind].some((v) => v && v.toLowerCase().includes(q))));
    body.replaceChildren(...shown.map((t) => h("tr", { dataset: { id: t.task_id, status: t.status } },
      h("td", {}, taskLink(t.task_id)), h("td", {}, t.kind), h("td", { class: `st-${t.status}` }, statusText(t)),
      h("td", { class: "num" }, t.generated_buf), h("td", {}, when(t.created_at)), h("td", {}, taskLink(t.parent_id)))));
    count.textContent = `${shown.length} shown of ${rows.length}`;
  };
  const refresh = async () => {
    try {
      const kind = filters.elements.kind.value;
      const list = await api("/v1/tasks/list", { query: { limit: PAGE, kind }, signal: ctl.signal });
      const text = JSON.stringify(list.tasks || []);
      message.replaceChildren();
      if (text === seen) return; // unchanged: keep the rows (and a pointer on a link) as they are
      seen = text;
      rows = list.tasks || [];
      render();
    } catch (err) {
      if (!aborted(err)) message.replaceChildren(errorBox(err));
    }
  };
  const stop = every(REFRESH_MS, refresh);
  return () => { stop(); ctl.abort(); };
}

function newTaskForm(signal) {
  const out = h("div");
  const form = h("form", { id: "new-task", class: "stack" },
    field("Prompt", "prompt", { tag: "textarea", rows: 3, required: true }),
    h("div", { class: "row" }, samplingFields(TASK_FIELDS, { max_tokens: 200 }),
      h("label", { class: "field check" }, h("input", { type: "checkbox", name: "template" }),
        h("span", {}, "prefill only, then make it a template named"),
        h("input", { name: "template_name", placeholder: "name (optional)", size: 12 }))),
    h("div", { class: "row" }, h("button", { type: "submit" }, "Create task")), out);
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const body = { prompt: form.elements.prompt.value, ...samplingBody(form, TASK_FIELDS) };
    try {
      if (form.elements.template.checked) body.max_tokens = 0;
      let t = await api("/v1/tasks/create", { method: "POST", body, signal });
      if (form.elements.template.checked) {
        await waitFinished(t.task_id, signal);
        const name = form.elements.template_name.value.trim();
        t = await api(`/v1/tasks/${t.task_id}/as_template`, { method: "POST", body: {}, query: { name }, signal });
      }
      location.hash = `#/tasks/${encodeURIComponent(t.task_id)}`;
    } catch (err) {
      if (!aborted(err)) out.replaceChildren(errorBox(err));
    }
  });
  return h("details", { class: "card" }, h("summary", {}, "New task"), form);
}

async function waitFinished(id, signal) {
  for (;;) {
    const st = await api(`/v1/tasks/${id}/status`, { signal });
    if (st.status === 3) return st;
    await new Promise((r) => setTimeout(r, 200));
  }
}

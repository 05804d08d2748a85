// Tasks: the key's tasks and templates (GET /v1/tasks/list, newest first), a page at a time,
// refreshed every second, each with the start of its prompt (`prompt_preview`), with a kind /
// status filter, a prompt search, a search box for ids, and the form that creates a task
// (newtask.js).
//
// The list route pages (`limit`, `offset`, `total_count`) and filters by kind and by prompt
// (`prompt_contains`, asked once typing pauses for DEBOUNCE_MS). Without a status or an id
// search, a page is one list call. With one, that filter runs here, over every task the route
// lists: read whole (1000 a call) when the filter starts and every SCAN_MS; in between, each
// refresh reads the newest 1000 again and puts them over the older ones read before.

import { aborted, api } from "./api.js";
import { errorBox, every, h, statusText, taskLink, when } from "./dom.js";
import { newTaskForm } from "./newtask.js";

const REFRESH_MS = 1000;
const SCAN_MS = 30_000;
const PAGE = 100; // rows a page shows
const CHUNK = 1000; // the list route's largest `limit`
const MAX_OFFSET = 1_000_000; // and its largest `offset`
const DEBOUNCE_MS = 300; // a pause in typing a prompt search before the list is asked for it

export function mount(el) {
  const ctl = new AbortController();
  const changed = () => { offset = 0; refresh(); };
  let prompt = "", pause = null; // the prompt search asked for; the timer of the one being typed
  const typed = (ev) => {
    clearTimeout(pause);
    pause = setTimeout(() => {
      const text = ev.target.value;
      prompt = text.trim() ? text : ""; // spaces only: no search
      changed();
    }, DEBOUNCE_MS);
  };
  const filters = h("form", { class: "row filters", onsubmit: (ev) => ev.preventDefault() },
    h("select", { name: "kind", id: "filter-kind", onchange: changed },
      h("option", { value: "" }, "all kinds"), h("option", { value: "task" }, "tasks (TASK_)"),
      h("option", { value: "tmp" }, "temporary (TMP_)"), h("option", { value: "template" }, "templates")),
    h("select", { name: "status", id: "filter-status", onchange: changed },
      h("option", { value: "" }, "any status"), h("option", { value: "running" }, "running or queued"),
      h("option", { value: "finished" }, "finished")),
    h("input", { type: "search", name: "prompt", id: "filter-prompt", placeholder: "search prompts",
      maxlength: 256, oninput: typed }),
    h("input", { type: "search", name: "q", id: "filter-search", placeholder: "search id, parent, finish reason",
      oninput: changed }));
  const count = h("span", { class: "muted", id: "task-count" });
  const pager = (id, step, label) => h("button", { type: "button", id, class: "small", onclick: () => turn(step) }, label);
  const newer = pager("page-newer", -PAGE, "‹ newer"), older = pager("page-older", PAGE, "older ›");
  const body = h("tbody", { id: "task-rows" });
  const table = h("table", { class: "list" },
    h("thead", {}, h("tr", {},
      ["id", "prompt", "kind", "status", "tokens", "created", "parent"].map((c) => h("th", {}, c)))),
    body);
  const message = h("div");
  el.append(h("h1", {}, "Tasks"), newTaskForm(ctl.signal), filters,
    h("div", { class: "row" }, newer, older, count), message, h("div", { class: "table-wrap" }, table));

  let offset = 0, seen = "", generation = 0;
  let scan = null; // every task the list route answers for the query scan.key, read at scan.at
  const turn = (step) => { offset = Math.max(0, offset + step); refresh(); };

  /** The status or id filter `match` over every task listed for `query` (kind, prompt search). */
  const filtered = async (query, match) => {
    const key = JSON.stringify(query);
    if (!scan || scan.key !== key || Date.now() - scan.at > SCAN_MS) {
      scan = { key, at: Date.now(), ...(await readAll(query, ctl.signal)) };
    } else {
      const head = await api("/v1/tasks/list", { query: { limit: CHUNK, ...query }, signal: ctl.signal });
      scan = { ...scan, tasks: overlay(head.tasks, scan.tasks), total: head.total_count };
    }
    const hits = scan.tasks.filter(match);
    return { total: scan.total, hits: hits.length, page: hits.slice(offset, offset + PAGE) };
  };

  const refresh = async () => {
    const mine = ++generation; // a refresh started later (a filter changed) wins
    try {
      const query = { kind: filters.elements.kind.value, prompt_contains: prompt };
      const status = filters.elements.status.value;
      const q = filters.elements.q.value.trim().toLowerCase();
      let view;
      if (!status && !q) {
        const list = await api("/v1/tasks/list", { query: { limit: PAGE, offset, ...query }, signal: ctl.signal });
        view = { total: list.total_count, hits: list.total_count, page: list.tasks || [] };
      } else {
        view = await filtered(query, (t) => (status === "" || (status === "finished") === (t.status === 3))
          && (!q || [t.task_id, t.parent_id, t.finish_reason, t.kind].some((v) => v && v.toLowerCase().includes(q))));
      }
      if (mine !== generation) return;
      message.replaceChildren();
      if (offset > 0 && offset >= view.hits) { // the page emptied (tasks deleted): go to the last one
        offset = Math.max(0, Math.ceil(view.hits / PAGE) - 1) * PAGE;
        return refresh();
      }
      show(view, Boolean(status || q));
    } catch (err) {
      if (!aborted(err) && mine === generation) message.replaceChildren(errorBox(err));
    }
  };

  /** filtering: a status or id filter runs here, over the `total` tasks listed. */
  const show = ({ total, hits, page }, filtering) => {
    const range = page.length ? `${offset + 1}–${offset + page.length}` : "none";
    if (filtering) count.textContent = `${hits} of ${total} match, ${range} shown`;
    else count.textContent = prompt ? `${total} match the prompt search, ${range} shown` : `${range} of ${total}`;
    count.dataset.total = total;
    newer.disabled = offset === 0;
    older.disabled = offset + page.length >= hits;
    const text = JSON.stringify(page);
    if (text === seen) return; // unchanged: keep the rows (and a pointer on a link) as they are
    seen = text;
    body.replaceChildren(...page.map((t) => h("tr", { dataset: { id: t.task_id, status: t.status } },
      h("td", {}, taskLink(t.task_id)), h("td", { class: "prompt-cell", title: t.prompt_preview }, t.prompt_preview),
      h("td", {}, t.kind), h("td", { class: `st-${t.status}` }, statusText(t)),
      h("td", { class: "num" }, t.generated_buf), h("td", {}, when(t.created_at)), h("td", {}, taskLink(t.parent_id)))));
  };

  const stop = every(REFRESH_MS, refresh);
  return () => { stop(); clearTimeout(pause); ctl.abort(); };
}

/** Every task the list route answers for `query` ({kind, prompt_contains}; "" all), newest first:
 *  { tasks, total }. */
async function readAll(query, signal) {
  const byId = new Map(); // a task may move to the next page while the pages are read
  let total = 0;
  for (let offset = 0; offset <= MAX_OFFSET; offset += CHUNK) {
    const list = await api("/v1/tasks/list", { query: { limit: CHUNK, offset, ...query }, signal });
    total = list.total_count;
    for (const t of list.tasks) if (!byId.has(t.task_id)) byId.set(t.task_id, t);
    if (list.tasks.length < CHUNK || offset + CHUNK >= total) break;
  }
  return { tasks: [...byId.values()], total };
}

/** The newest tasks `head` (a fresh first page) over `old` (all, read before): `old`'s tasks
 *  older than the whole head stay, the rest is the head's. */
function overlay(head, old) {
  if (head.length < CHUNK) return head; // the head is every task
  const last = head[head.length - 1];
  const ids = new Set(head.map((t) => t.task_id));
  const older = (t) => t.created_at < last.created_at
    || (t.created_at === last.created_at && t.task_id > last.task_id);
  return head.concat(old.filter((t) => !ids.has(t.task_id) && older(t)));
}

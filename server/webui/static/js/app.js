// The dashboard's entry: hash routes (#/tasks, #/tasks/ID, #/playground, #/batch, #/server),
// the header (model, key button). Each view's mount(el, arg) returns its cleanup.

import { OfflineError, api, apiKey, askKey } from "./api.js";
import * as batch from "./batch.js";
import { h } from "./dom.js";
import * as playground from "./playground.js";
import * as serverPage from "./server.js";
import * as task from "./task.js";
import * as tasks from "./tasks.js";

const ROUTES = {
  tasks: (arg) => (arg ? task.mount : tasks.mount),
  playground: () => playground.mount,
  batch: () => batch.mount,
  server: () => serverPage.mount,
};

const HEALTH_OK_MS = 10_000;
const HEALTH_RETRY_MS = 2000;
let cleanup = null;

function route() {
  const [page = "tasks", ...rest] = location.hash.replace(/^#\/?/, "").split("/");
  const name = Object.hasOwn(ROUTES, page) ? page : "tasks";
  const raw = rest.join("/");
  let arg = "", bad = false;
  try {
    arg = decodeURIComponent(raw);
  } catch { // a malformed escape (#/tasks/%ZZ): URIError
    bad = true;
  }
  if (cleanup) cleanup();
  cleanup = null;
  const view = document.getElementById("view");
  view.replaceChildren();
  view.dataset.page = name;
  for (const a of document.querySelectorAll("nav a")) a.classList.toggle("active", a.dataset.page === name);
  if (bad && name === "tasks") return badAddress(view, raw); // (the other pages take no argument)
  cleanup = ROUTES[name](arg)(view, arg) || null;
}

/** An address whose task id is no valid percent-encoding: said so, nothing asked of the server. */
function badAddress(view, raw) {
  view.append(h("h1", {}, "Bad task id"), h("p", { id: "bad-address", class: "error", role: "alert" },
    `The address holds a malformed task id: "${raw}" is not valid percent-encoding (a "%" must be`
    + " followed by two hex digits). ", h("a", { href: "#/tasks" }, "Back to the tasks")));
}

function showKey() {
  const button = document.getElementById("key-button");
  const key = apiKey.get();
  button.textContent = key ? `Key ${key.slice(0, 4)}…` : "API key";
  button.title = key ? "Change or forget the API key kept in this browser" : "Set an API key";
}

/** The header's model name, from /health: read again every few seconds while the server is
 *  loading or unreachable, and every HEALTH_OK_MS once it answers (a restart may bring another
 *  model). */
async function showModel() {
  const el = document.getElementById("model");
  let ok = false;
  try {
    const health = await api("/health");
    el.textContent = health.model || "";
    ok = true;
  } catch (err) { // 503: loading, shutting_down, load_failed, engine_dead; or no answer
    el.textContent = `(${err instanceof OfflineError ? err.short : (err.code || "error").replace(/_/g, " ")})`;
  }
  setTimeout(showModel, ok ? HEALTH_OK_MS : HEALTH_RETRY_MS);
}

window.addEventListener("hashchange", route);
window.addEventListener("DOMContentLoaded", () => {
  document.getElementById("key-button").addEventListener("click", () => {
    askKey("Set the API key for this server.", true).catch(() => {});
  });
  apiKey.onChange(() => { showKey(); route(); });
  showKey();
  showModel();
  route();
});

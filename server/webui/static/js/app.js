// The dashboard's entry: hash routes (#/tasks, #/tasks/ID, #/playground, #/batch, #/server),
// the header (model, key button). Each view's mount(el, arg) returns its cleanup.

import { OfflineError, api, apiKey, askKey } from "./api.js";
import * as batch from "./batch.js";
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
  const name = ROUTES[page] ? page : "tasks";
  const arg = rest.length ? decodeURIComponent(rest.join("/")) : "";
  if (cleanup) cleanup();
  const view = document.getElementById("view");
  view.replaceChildren();
  view.dataset.page = name;
  for (const a of document.querySelectorAll("nav a")) a.classList.toggle("active", a.dataset.page === name);
  cleanup = ROUTES[name](arg)(view, arg) || null;
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
    el.textContent = `(${err instanceof OfflineError ? "unreachable" : (err.code || "error").replace(/_/g, " ")})`;
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

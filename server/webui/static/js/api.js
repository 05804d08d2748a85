// HTTP to the server's public APIs: JSON calls, SSE streams read from fetch (EventSource can
// neither POST nor send a key), and the API key: asked for when the server answers 401, kept
// in localStorage, sent as a Bearer token.

const KEY_NAME = "rwkv.apiKey";
const keyListeners = new Set();
let pendingKey = null; // one dialog for every request that got a 401 at the same time
let declined = false; // the user cancelled the dialog: polls fail quietly until asked again

export class ApiError extends Error {
  constructor(status, message, code) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

/** A call that got no answer: the server is down or restarting, or the connection was lost
 *  (fetch's own TypeError, wrapped so that callers can tell it from a bug). */
export class OfflineError extends Error {
  constructor() {
    super("server unreachable: no answer (it may be down or restarting)");
    this.name = "OfflineError";
  }
}

const NOT_UP = ["shutting_down", "loading", "tasks_unavailable"]; // 503s (and error events) of a server not up

/** True for an error that says nothing about the request itself: no answer at all, a 502-504,
 *  or the server shutting down (a stream's error event, or a 503 shutting_down / loading). */
export function offline(err) {
  if (err instanceof OfflineError) return true;
  if (!(err instanceof ApiError)) return false;
  return (err.status >= 502 && err.status <= 504) || NOT_UP.includes(err.code);
}

export const apiKey = {
  get() { return localStorage.getItem(KEY_NAME) || ""; },
  set(key) {
    if (key) localStorage.setItem(KEY_NAME, key); else localStorage.removeItem(KEY_NAME);
    keyListeners.forEach((fn) => fn(key));
  },
  onChange(fn) { keyListeners.add(fn); },
};

/** Opens the key dialog; resolves with the key typed, rejects when the user cancels. After a
 *  cancel, requests that get a 401 fail at once until `askKey(reason, true)` (the key button). */
export function askKey(reason, explicit = false) {
  if (pendingKey) return pendingKey;
  if (declined && !explicit) return Promise.reject(new ApiError(401, "an API key is needed", "invalid_api_key"));
  const dialog = document.getElementById("key-dialog");
  const input = document.getElementById("key-input");
  document.getElementById("key-reason").textContent = reason || "";
  input.value = apiKey.get();
  pendingKey = new Promise((resolve, reject) => {
    const done = (key) => {
      form.removeEventListener("submit", onSave);
      cancel.removeEventListener("click", onCancel);
      forget.removeEventListener("click", onForget);
      dialog.removeEventListener("cancel", onCancel);
      pendingKey = null;
      declined = key === null;
      if (dialog.open) dialog.close();
      key === null ? reject(new ApiError(401, "an API key is needed", "invalid_api_key")) : resolve(key);
    };
    const form = document.getElementById("key-form");
    const cancel = document.getElementById("key-cancel");
    const forget = document.getElementById("key-forget");
    const onSave = (ev) => { ev.preventDefault(); apiKey.set(input.value.trim()); done(input.value.trim()); };
    const onCancel = () => done(null);
    const onForget = () => { apiKey.set(""); done(null); };
    form.addEventListener("submit", onSave);
    cancel.addEventListener("click", onCancel);
    forget.addEventListener("click", onForget);
    dialog.addEventListener("cancel", onCancel); // Escape
  });
  dialog.showModal();
  input.focus();
  return pendingKey;
}

function url(path, query) {
  const u = new URL(path, location.origin);
  for (const [k, v] of Object.entries(query || {})) {
    if (v !== undefined && v !== null && v !== "") u.searchParams.set(k, v);
  }
  return u;
}

async function errorOf(res) {
  let message = `${res.status} ${res.statusText}`, code = null;
  try {
    const body = await res.json();
    if (body && body.error) ({ message, code } = body.error);
  } catch { /* not JSON */ }
  return new ApiError(res.status, message, code);
}

/** fetch with the key; on 401 asks for a key and tries again. Returns the Response (ok). */
async function send(path, { method = "GET", body, query, signal } = {}) {
  for (let attempt = 0; ; attempt++) {
    const headers = {};
    const key = apiKey.get();
    if (key) headers.Authorization = `Bearer ${key}`;
    if (body !== undefined) headers["Content-Type"] = "application/json";
    const res = await fetch(url(path, query), {
      method, headers, signal, body: body === undefined ? undefined : JSON.stringify(body),
    }).catch(noAnswer);
    if (res.status === 401 && attempt < 3) {
      const err = await errorOf(res);
      await askKey(key ? `The server refused the key: ${err.message}` : "This server needs an API key.");
      continue;
    }
    if (!res.ok) throw await errorOf(res);
    return res;
  }
}

/** A JSON (or text) call. */
export async function api(path, options) {
  const res = await send(path, options);
  const type = res.headers.get("content-type") || "";
  return type.includes("json") ? res.json() : res.text();
}

/** Parsed `data:` events of an SSE response, until `[DONE]`; an `{error}` event throws. */
export async function* sse(path, options) {
  const res = await send(path, options);
  const reader = res.body.pipeThrough(new TextDecoderStream()).getReader();
  let buf = "";
  try {
    for (;;) {
      const { value, done } = await reader.read().catch(noAnswer);
      if (done) return;
      buf += value.replace(/\r\n/g, "\n");
      let cut;
      while ((cut = buf.indexOf("\n\n")) >= 0) {
        const block = buf.slice(0, cut);
        buf = buf.slice(cut + 2);
        for (const line of block.split("\n")) {
          if (!line.startsWith("data:")) continue; // comments (": ping") and other fields
          const data = line.slice(5).trim();
          if (data === "[DONE]") return;
          const event = JSON.parse(data);
          if (event.error) throw new ApiError(0, event.error.message, event.error.code);
          yield event;
        }
      }
    }
  } finally {
    reader.cancel().catch(() => {});
  }
}

/** fetch's network failure (a TypeError) as an OfflineError; an abort stays one. */
function noAnswer(err) {
  throw aborted(err) ? err : new OfflineError();
}

/** True for the error a fetch throws when its AbortController fired. */
export function aborted(err) {
  return err && err.name === "AbortError";
}

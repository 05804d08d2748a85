// HTTP to the server's public APIs: JSON calls, SSE streams read from fetch (EventSource can
// neither POST nor send a key), and the API key: asked for when the server answers 401, kept
// in localStorage, sent as a Bearer token. A JSON call that gets no answer in `timeouts` (a
// server that accepts connections but is stopped or stuck) fails as "not answering", as a
// stream does that gets no byte for `timeouts.stall` (the server sends a `: ping` every 15 s).

import { parse, stringify } from "./json.js";

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
 *  (fetch's own TypeError, wrapped so that callers can tell it from a bug); or, `timedOut`, the
 *  server took the call but did not answer in time (stopped, stuck or overloaded). `short`:
 *  "unreachable" or "not answering", for a header or a card. */
export class OfflineError extends Error {
  constructor(timedOutAfterMs = 0) {
    super(timedOutAfterMs
      ? `server not answering: no answer in ${Math.round(timedOutAfterMs / 1000)} s (it may be stopped or overloaded)`
      : "server unreachable: no answer (it may be down or restarting)");
    this.name = "OfflineError";
    this.timedOut = timedOutAfterMs > 0;
    this.short = this.timedOut ? "not answering" : "unreachable";
  }
}

/** How long a call waits for an answer (ms): a GET (the pages' polls), another JSON call (an
 *  action), a stream's headers or next bytes (`stall`: the server pings an idle stream every
 *  15 s). Tests shorten them through this module. */
export const timeouts = { get: 10_000, action: 30_000, stall: 45_000 };

const NOT_UP = ["shutting_down", "loading", "tasks_unavailable"]; // 503s (and error events) of a server not up

/** True for an error that says nothing about the request itself: no answer at all, a 502-504,
 *  or the server shutting down (a stream's error event, or a 503 shutting_down / loading). */
export function offline(err) {
  if (err instanceof OfflineError) return true;
  if (!(err instanceof ApiError)) return false;
  return (err.status >= 502 && err.status <= 504) || NOT_UP.includes(err.code);
}

/** Why `key` cannot go in an HTTP header ("" when it can): printable ASCII and Latin-1 only (a
 *  fetch with another character throws before anything is sent). */
export function keyProblem(key) {
  const bad = [...key].findIndex((c) => !/[\x20-\x7e\xa0-\xff]/.test(c));
  if (bad < 0) return "";
  const c = [...key][bad];
  const code = `U+${c.codePointAt(0).toString(16).toUpperCase().padStart(4, "0")}`;
  const hint = /[\u2018-\u201f]/.test(c) ? ", a curly quote: pasted?" : "";
  return `its character ${bad + 1}, "${c}" (${code}${hint}), is not allowed: an HTTP header carries`
    + " printable ASCII (and Latin-1) characters only";
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
  const problem = document.getElementById("key-error");
  document.getElementById("key-reason").textContent = reason || "";
  input.value = apiKey.get();
  problem.hidden = true;
  pendingKey = new Promise((resolve, reject) => {
    const done = (key) => {
      form.removeEventListener("submit", onSave);
      cancel.removeEventListener("click", onCancel);
      forget.removeEventListener("click", onForget);
      dialog.removeEventListener("cancel", onCancel);
      input.removeEventListener("input", onInput);
      pendingKey = null;
      declined = key === null;
      if (dialog.open) dialog.close();
      key === null ? reject(new ApiError(401, "an API key is needed", "invalid_api_key")) : resolve(key);
    };
    const form = document.getElementById("key-form");
    const cancel = document.getElementById("key-cancel");
    const forget = document.getElementById("key-forget");
    const onSave = (ev) => {
      ev.preventDefault();
      const key = input.value.trim();
      const bad = keyProblem(key);
      if (bad) { // the dialog stays, saying what is wrong; the key kept is left as it was
        Object.assign(problem, { textContent: `This key cannot be sent: ${bad}.`, hidden: false });
        return input.focus();
      }
      apiKey.set(key);
      done(key);
    };
    const onCancel = () => done(null);
    const onForget = () => { apiKey.set(""); done(null); };
    const onInput = () => { problem.hidden = true; };
    form.addEventListener("submit", onSave);
    input.addEventListener("input", onInput);
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

function errorOf(res, text) {
  let message = `${res.status} ${res.statusText}`, code = null;
  try {
    const body = JSON.parse(text);
    if (body && body.error) ({ message, code } = body.error);
  } catch { /* not JSON */ }
  return new ApiError(res.status, message, code);
}

/** fetch with the key; on 401 (or a kept key that cannot be sent) asks for a key and tries
 *  again. Returns {res, text}: the Response (ok) and, `whole`, its body read. `timeout` (ms): no
 *  answer (or, `whole`, no whole body) by then is an OfflineError (timedOut); the time a key
 *  dialog is open does not count. `signal` still aborts it, as an AbortError. */
async function send(path, { method = "GET", body, query, signal, timeout = 0, whole = false } = {}) {
  for (let attempt = 0; ; attempt++) {
    const headers = {};
    const key = apiKey.get();
    const bad = keyProblem(key);
    if (bad) { // fetch would throw a TypeError (no network error): the key is asked for again
      const err = new ApiError(0, `the API key kept in this browser cannot be sent: ${bad}`, "invalid_api_key");
      if (attempt >= 3) throw err;
      await askKey(`The API key kept in this browser cannot be sent: ${bad}.`).catch(() => { throw err; });
      continue;
    }
    if (key) headers.Authorization = `Bearer ${key}`;
    if (body !== undefined) headers["Content-Type"] = "application/json";
    const init = { method, headers: new Headers(headers), body: body === undefined ? undefined : stringify(body) };
    const { res, text } = await timed(signal, timeout, !whole, async (sig) => {
      const res = await fetch(url(path, query), { ...init, signal: sig });
      return { res, text: whole || !res.ok ? await res.text() : undefined };
    });
    if (res.status === 401 && attempt < 3) {
      const err = errorOf(res, text);
      await askKey(key ? `The server refused the key: ${err.message}` : "This server needs an API key.");
      continue;
    }
    if (!res.ok) throw errorOf(res, text);
    return { res, text };
  }
}

/** `call(signal)` (a fetch), failing as OfflineError (timedOut) when it has not settled in `ms`
 *  ms (0: no limit), as OfflineError when it got no answer, and as the AbortError when `outer`
 *  aborted it. `stream`: `outer` goes on aborting the fetch after the call (its body is read
 *  later). */
async function timed(outer, ms, stream, call) {
  if (!ms) return call(outer).catch(noAnswer);
  const ctl = new AbortController();
  const abort = () => ctl.abort();
  outer?.addEventListener("abort", abort);
  if (outer?.aborted) ctl.abort();
  let late = false;
  const timer = setTimeout(() => { late = true; ctl.abort(); }, ms);
  try {
    return await call(ctl.signal).catch((err) => {
      if (late && !outer?.aborted) throw new OfflineError(ms);
      return noAnswer(err);
    });
  } finally {
    clearTimeout(timer);
    if (!stream) outer?.removeEventListener("abort", abort);
  }
}

/** A JSON (or text) call, given up after `timeouts` (OfflineError, timedOut). `exact: true`:
 *  integers beyond Number.MAX_SAFE_INTEGER come as BigInt (json.js). */
export async function api(path, { exact = false, ...options } = {}) {
  const timeout = options.timeout ?? ((options.method || "GET") === "GET" ? timeouts.get : timeouts.action);
  const { res, text } = await send(path, { ...options, timeout, whole: true });
  const type = res.headers.get("content-type") || "";
  if (!type.includes("json")) return text;
  return exact ? parse(text) : JSON.parse(text);
}

/** Parsed `data:` events of an SSE response, until `[DONE]`; an `{error}` event throws. No limit
 *  on the whole stream (it is long by design), but nothing at all from the server (headers,
 *  events, its pings) for `timeouts.stall` fails it as OfflineError (timedOut). */
export async function* sse(path, options) {
  const { res } = await send(path, { ...options, timeout: timeouts.stall });
  const reader = res.body.pipeThrough(new TextDecoderStream()).getReader();
  let buf = "";
  try {
    for (;;) {
      const { value, done } = await stalled(reader.read(), timeouts.stall).catch(noAnswer);
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

/** `read` (a stream reader's), or an OfflineError (timedOut) once it has waited `ms` ms. */
function stalled(read, ms) {
  let timer;
  const late = new Promise((_, reject) => { timer = setTimeout(() => reject(new OfflineError(ms)), ms); });
  return Promise.race([read, late]).finally(() => clearTimeout(timer));
}

/** fetch's network failure (a TypeError) as an OfflineError; an abort, and an OfflineError
 *  already, stay as they are. */
function noAnswer(err) {
  throw aborted(err) || err instanceof OfflineError ? err : new OfflineError();
}

/** True for the error a fetch throws when its AbortController fired. */
export function aborted(err) {
  return err && err.name === "AbortError";
}

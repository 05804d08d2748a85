// Playground: a chat with the model. Plain chat streams through /v1/chat/completions (the whole
// history each turn, with stream_options.include_usage for the cached-token count). Started
// from a template, the first turn forks the template through the task API and later turns
// continue that task: its state carries the conversation, nothing is prefilled twice. A turn
// joins the chat's history once it has ended (or was stopped: what came is kept); one that
// failed (refused by the server, cut by an error) stays out of it, and its bubbles say so.
// "Token probabilities" (plain chat) asks for logprobs: each token of the reply is shown under it,
// shaded by its probability, with the most probable alternatives in its tooltip.

import { aborted, api, sse } from "./api.js";
import { errorBox, field, h } from "./dom.js";
import { OPENAI_FIELDS, samplingBody, samplingFields } from "./sampling.js";
import { listStates } from "./states.js";

const TURN = "\n\n"; // the RWKV chat format's turn separator (and the chat stop string)

export function mount(el) {
  const ctl = new AbortController();
  const chat = { messages: [], taskId: null, lastFinish: null, turn: null };
  const template = h("select", { name: "template", id: "chat-template" },
    h("option", { value: "" }, "nothing (plain chat)"));
  const state = h("select", { name: "state", id: "chat-state" }, h("option", { value: "" }, "none"));
  const stateField = h("label", { class: "field", id: "chat-state-field", hidden: true },
    h("span", {}, "state (a tuned state file loaded on the server)"), state);
  const settings = h("form", { id: "chat-settings", class: "card stack", onsubmit: (ev) => ev.preventDefault() },
    h("label", { class: "field" }, h("span", {}, "start from template"), template), stateField,
    field("system prompt (plain chat)", "system", { tag: "textarea", rows: 2 }),
    samplingFields(OPENAI_FIELDS, { max_tokens: 200 }),
    h("label", { class: "field check" }, h("input", { type: "checkbox", name: "logprobs", id: "chat-logprobs" }),
      h("span", {}, "token probabilities (plain chat)")),
    h("p", { class: "muted" }, "From a template the chat runs on the task API: frequency penalty and token probabilities do not apply."));
  const log = h("div", { id: "chat-log", class: "chat-log" });
  const input = h("textarea", { name: "message", id: "chat-input", rows: 3, placeholder: "Message (Enter sends, Shift+Enter: new line)" });
  const sendButton = h("button", { id: "chat-send", type: "submit" }, "Send");
  const stopButton = h("button", { id: "chat-stop", type: "button", disabled: true }, "Stop");
  const form = h("form", { id: "chat-form", class: "row" }, input, sendButton, stopButton,
    h("button", { id: "chat-clear", type: "button", onclick: () => reset() }, "New chat"));
  const message = h("div");
  el.append(h("h1", {}, "Playground"), h("div", { class: "playground" }, settings,
    h("section", { class: "stack" }, log, form, message)));

  const reset = () => {
    if (chat.turn) chat.turn.abort();
    Object.assign(chat, { messages: [], taskId: null, lastFinish: null });
    log.replaceChildren();
  };
  template.addEventListener("change", reset);
  state.addEventListener("change", reset);
  input.addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey) { ev.preventDefault(); form.requestSubmit(); }
  });
  stopButton.addEventListener("click", () => {
    if (chat.taskId) api(`/v1/tasks/${chat.taskId}/stop`, { method: "POST", body: {} }).catch(() => {});
    if (chat.turn) chat.turn.abort();
  });
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const text = input.value.trim();
    if (!text || chat.turn) return;
    input.value = "";
    message.replaceChildren();
    sendButton.disabled = true;
    stopButton.disabled = false;
    try {
      await turn(chat, text, log, { template: template.value, state: state.value, settings });
    } catch (err) {
      if (!aborted(err)) message.replaceChildren(errorBox(err));
    } finally {
      chat.turn = null;
      sendButton.disabled = false;
      stopButton.disabled = true;
    }
  });

  api("/v1/tasks/list", { query: { kind: "template", limit: 500 }, signal: ctl.signal }).then((list) => {
    template.append(...(list.tasks || []).map((t) => h("option", { value: t.task_id }, t.task_id)));
    template.dataset.loaded = "1";
  }).catch((err) => { if (!aborted(err)) message.replaceChildren(errorBox(err)); });
  listStates(ctl.signal).then((names) => {
    if (!names.length) return;
    state.append(...names.map((n) => h("option", { value: n }, n)));
    stateField.hidden = false;
  }).catch(() => {});
  return () => { ctl.abort(); if (chat.turn) chat.turn.abort(); };
}

function bubble(log, role, text) {
  const body = h("div", { class: "text" }, text);
  const meta = h("div", { class: "meta muted" });
  const el = h("div", { class: `msg ${role}` }, h("div", { class: "role" }, role), body, meta);
  log.append(el);
  log.scrollTop = log.scrollHeight;
  return { el, body, meta };
}

/** One turn: stream the reply into a new bubble, then show its tokens/s and cached tokens. A
 *  turn that ended, or that Stop cut (what came is kept), joins the history; a failed one not. */
async function turn(chat, text, log, { template, state, settings }) {
  const asked = bubble(log, "user", text);
  const reply = bubble(log, "assistant", "");
  reply.el.classList.add("streaming");
  const params = samplingBody(settings, OPENAI_FIELDS);
  if (!template && settings.elements.logprobs.checked) Object.assign(params, { logprobs: true, top_logprobs: TOP });
  chat.turn = new AbortController();
  const signal = chat.turn.signal;
  const events = template
    ? taskTurn(chat, template, text, params, signal)
    : chatTurn(chat, text, params, settings.elements.system.value.trim(), state, signal);
  const history = chat.messages; // a "New chat" meanwhile starts another list: this turn stays out of it
  const stats = { t0: performance.now(), first: null, last: null, chunks: 0, usage: null, reply: "" };
  let kept = false;
  try {
    for await (const piece of events) {
      if (piece.usage) stats.usage = piece.usage;
      if (piece.logprobs) showTokens(reply, piece.logprobs);
      if (!piece.text) continue;
      stats.last = performance.now();
      stats.first ??= stats.last;
      stats.chunks++;
      stats.reply += piece.text;
      reply.body.append(piece.text);
      log.scrollTop = log.scrollHeight;
    }
    kept = true;
  } catch (err) {
    kept = aborted(err); // Stop (or New chat): the turn keeps what came
    throw err;
  } finally {
    reply.el.classList.remove("streaming");
    reply.meta.textContent = turnFacts(stats);
    if (kept && !template) history.push({ role: "user", content: text }, { role: "assistant", content: stats.reply });
    if (!kept) {
      for (const b of [asked, reply]) b.el.classList.add("failed");
      reply.meta.textContent += template ? " · failed" : " · failed: not part of the chat (the next message goes without it)";
    }
  }
}

const TOP = 5; // alternatives per token shown in a token's tooltip

/** Add tokens (chat's logprobs.content entries) to the reply's token strip: each token's text
 *  (a newline shown as ↵), shaded by its probability; its tooltip: its probability and the
 *  alternatives'. The strip shows the tokens as generated: the reply's leading whitespace and
 *  a token that holds part of a character (U+FFFD) too. */
function showTokens(reply, entries) {
  if (!reply.tokens) {
    reply.tokens = h("div", { class: "tokens" });
    reply.body.after(reply.tokens);
  }
  const pct = (lp) => `${(Math.exp(lp) * 100).toFixed(1)}%`;
  const shown = (s) => s.replace(/\n/g, "↵");
  for (const e of entries) {
    const alts = (e.top_logprobs || []).map((a) => `${JSON.stringify(a.token)} ${pct(a.logprob)}`);
    reply.tokens.append(h("span", {
      class: "tok", style: `--p: ${Math.exp(e.logprob).toFixed(3)}`,
      title: [`${JSON.stringify(e.token)} ${pct(e.logprob)}`, ...alts].join("\n"),
    }, shown(e.token)));
  }
}

function turnFacts({ t0, first, last, chunks, usage }) {
  const facts = [];
  const completion = usage ? usage.completion_tokens : chunks;
  facts.push(`${completion} tokens`);
  if (first !== null) facts.push(`first token ${((first - t0) / 1000).toFixed(2)} s`);
  if (first !== null && last > first && completion > 1) {
    facts.push(`${((completion - 1) / ((last - first) / 1000)).toFixed(1)} tok/s`);
  }
  const cached = usage && usage.prompt_tokens_details && usage.prompt_tokens_details.cached_tokens;
  if (usage && typeof cached === "number") facts.push(`cached ${cached} of ${usage.prompt_tokens} prompt tokens`);
  else if (usage) facts.push(`${usage.prompt_tokens} prompt tokens`);
  return facts.join(" · ");
}

/** /v1/chat/completions, streamed: yields {text} pieces and a last {usage}. */
async function* chatTurn(chat, text, params, system, state, signal) {
  const messages = [...(system ? [{ role: "system", content: system }] : []), ...chat.messages,
    { role: "user", content: text }];
  const body = { messages, stream: true, stream_options: { include_usage: true }, ...params };
  if (state) body.state = state;
  for await (const ev of sse("/v1/chat/completions", { method: "POST", body, signal })) {
    const choice = (ev.choices || [])[0];
    const piece = choice && choice.delta && choice.delta.content;
    const logprobs = choice && choice.logprobs && choice.logprobs.content;
    if (piece || logprobs) yield { text: piece || "", logprobs };
    if (ev.usage) yield { usage: ev.usage };
  }
}

/** The task API: fork the template (first turn) or continue the chat's task, streamed. */
async function* taskTurn(chat, template, text, params, signal) {
  const { frequency_penalty: _unused, ...taskParams } = params;
  const lead = chat.taskId && chat.lastFinish !== "stop" ? TURN : "";
  const body = { ...taskParams, prompt: `${lead}User: ${text}${TURN}Assistant:`, stream: true,
    stop: [...(taskParams.stop || []), TURN] };
  const url = chat.taskId ? `/v1/tasks/${chat.taskId}/continue` : `/v1/tasks/${encodeURIComponent(template)}/fork`;
  const query = chat.taskId ? {} : { tmp: "true" };
  for await (const ev of sse(url, { method: "POST", body, query, signal })) {
    if (ev.task_id && !chat.taskId) chat.taskId = ev.task_id;
    if (typeof ev.data === "string" && ev.data) yield { text: ev.data };
    if (ev.finished) {
      chat.lastFinish = ev.finish_reason;
      yield { usage: ev.usage };
    }
  }
}

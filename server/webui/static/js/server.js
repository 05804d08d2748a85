// Server: live charts of the last five minutes from GET /metrics (scraped every second from the
// first visit on, so the history is there when the page is opened again), and /health.

import { OfflineError, aborted, api } from "./api.js";
import { LineChart } from "./chart.js";
import { errorBox, every, h, when } from "./dom.js";
import { figures, parseMetrics, totals } from "./metrics.js";

const SCRAPE_MS = 1000;
const WINDOW_S = 300;

const history = { times: [], samples: [], last: null, lastT: 0, error: null, listeners: new Set() };
let sampling = null;

async function scrape() {
  let text;
  try {
    text = await api("/metrics");
    history.error = null;
  } catch (err) {
    history.error = err;
    history.listeners.forEach((fn) => fn());
    return;
  }
  const now = parseMetrics(text), t = Date.now() / 1000;
  if (history.last) {
    history.times.push(t);
    history.samples.push(figures(now, history.last, t - history.lastT));
    while (history.times.length && history.times[0] < t - WINDOW_S) {
      history.times.shift();
      history.samples.shift();
    }
  }
  history.last = now;
  history.lastT = t;
  history.listeners.forEach((fn) => fn());
}

/** {series name: values aligned with history.times} of one figure group. */
function seriesOf(group) {
  const out = {};
  history.samples.forEach((s, i) => {
    for (const [name, v] of Object.entries(s[group] || {})) {
      (out[name] ??= new Array(history.samples.length).fill(null))[i] = v;
    }
  });
  return out;
}

const CHARTS = [
  ["throughput", "Throughput (tokens/s)", {}],
  ["requests", "Requests", {}],
  ["occupancy", "Batch occupancy (% of slots)", { yMax: 100 }],
  ["latency", "Latency (ms, mean per interval)", {}],
  ["cacheMiB", "State cache by tier (MiB)", { format: (v) => v.toFixed(2) }],
  ["hitRate", "Cache hit rate by tier (%)", { yMax: 100 }],
];

export function mount(el) {
  const ctl = new AbortController();
  const cards = h("div", { class: "cards", id: "server-cards" });
  const message = h("div");
  const charts = CHARTS.map(([id, title, opts]) => [id, new LineChart(id, title, { windowS: WINDOW_S, ...opts })]);
  const chartBox = h("div", { class: "charts" }, charts.map(([, c]) => c.el));
  el.append(h("h1", {}, "Server"), message, cards, chartBox);
  const render = () => {
    const stale = Boolean(history.error); // the last scrape failed: the figures are old
    message.replaceChildren(...(stale ? [errorBox(history.error)] : []));
    if (stale && history.last) {
      const note = `The figures below are from ${when(history.lastT)}, its last answer.`;
      message.append(h("p", { class: "muted", id: "server-stale" }, note));
    }
    for (const box of [cards, chartBox]) box.classList.toggle("stale", stale);
    for (const [id, chart] of charts) chart.draw(history.times, seriesOf(id));
    if (history.last) showCards(cards, totals(history.last), health, stale);
  };
  let health = null;
  const stopHealth = every(2000, async () => {
    try { health = await api("/health", { signal: ctl.signal }); } catch (err) {
      if (!aborted(err)) health = { status: err instanceof OfflineError ? err.short : err.code || err.message };
    }
  });
  history.listeners.add(render);
  render();
  sampling ??= every(SCRAPE_MS, scrape);
  return () => { history.listeners.delete(render); stopHealth(); ctl.abort(); };
}

function card(label, value, title) {
  return h("div", { class: "card stat", title: title || null },
    h("div", { class: "muted" }, label), h("div", { class: "value" }, value));
}

/** The database card from /health: [its text, the error as its tooltip]. The task database failed
 *  this server's last use of it: task routes answer 503 until it answers again (/health says since when). */
export function databaseCard(health) {
  if (!health || !health.database) return ["–", null];
  if (health.database === "ok") return ["ok", null];
  const since = health.database_unavailable_since ? new Date(health.database_unavailable_since * 1000) : null;
  return [`${health.database}${since ? ` since ${since.toLocaleTimeString()}` : ""}`, health.database_error || null];
}

/** The cards; `stale`: the server does not answer, the figures of the moment are blanked. */
function showCards(el, t, health, stale) {
  const rates = Object.entries(t.hitRates).map(([tier, r]) => `${tier} ${r === null ? "–" : `${r.toFixed(0)}%`}`);
  const last = (!stale && history.samples[history.samples.length - 1]) || {};
  el.replaceChildren(
    card("status", history.error instanceof OfflineError ? history.error.short
      : health ? `${health.status}${health.model ? ` · ${health.model}` : ""}` : "…"),
    card("database", ...databaseCard(health)),
    card("slots", t.slots ?? "–"),
    card("running / waiting", `${last.requests ? last.requests.running : "–"} / ${last.requests ? last.requests.waiting : "–"}`),
    card("generated tok/s", last.throughput && last.throughput.generated !== null ? last.throughput.generated.toFixed(1) : "–"),
    card("tokens generated / prefilled", `${t.generated ?? "–"} / ${t.prompt ?? "–"}`),
    card("engine step", `${t.stepMs.toFixed(2)} ms`),
    card("streams open", last.requests ? last.requests["streams open"] : "–"),
    card("hit rate (since start)", rates.join(", ") || "–"));
}

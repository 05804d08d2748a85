// Prometheus text format (what GET /metrics answers) -> samples, and the figures the Server page
// draws, derived from two scrapes (counters become rates over the interval between them).

const LINE = /^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+-?\d+)?$/;
const LABEL = /([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"/g;

function number(text) {
  if (text === "+Inf") return Infinity;
  if (text === "-Inf") return -Infinity;
  return Number(text); // "NaN" -> NaN
}

/** Map name -> [{labels, value}] of every sample line (comments and HELP/TYPE lines skipped). */
export function parseMetrics(text) {
  const out = new Map();
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const m = LINE.exec(line.trim());
    if (!m) continue;
    const labels = {};
    for (const [, k, v] of (m[2] || "").matchAll(LABEL)) {
      labels[k] = v.replace(/\\n/g, "\n").replace(/\\"/g, "\"").replace(/\\\\/g, "\\");
    }
    if (!out.has(m[1])) out.set(m[1], []);
    out.get(m[1]).push({ labels, value: number(m[3]) });
  }
  return out;
}

/** The sum of a family's samples (one unlabelled sample: its value); undefined when absent. */
export function total(metrics, name) {
  const samples = metrics.get(name);
  return samples ? samples.reduce((a, s) => a + s.value, 0) : undefined;
}

/** {label value: sample value} of a family, e.g. per cache tier. */
export function byLabel(metrics, name, label) {
  const out = {};
  for (const s of metrics.get(name) || []) out[s.labels[label]] = s.value;
  return out;
}

function rate(now, before, name, dt, count = total) {
  const a = count(now, name), b = count(before, name);
  return a === undefined || b === undefined || dt <= 0 ? null : Math.max(0, a - b) / dt;
}

const PROBES = new Set(["/metrics", "/health"]); // this page's own polls (and load balancers'): not traffic

/** rwkv_http_requests_total less the probes' routes: an idle server reads 0 requests/s. */
function served(metrics, name) {
  const samples = metrics.get(name);
  return samples && samples.filter((s) => !PROBES.has(s.labels.route)).reduce((a, s) => a + s.value, 0);
}

function meanOver(now, before, family) {
  const dn = (total(now, `${family}_count`) ?? 0) - (total(before, `${family}_count`) ?? 0);
  const ds = (total(now, `${family}_sum`) ?? 0) - (total(before, `${family}_sum`) ?? 0);
  return dn > 0 ? (ds / dn) * 1000 : null;
}

/** {tier: value} of a per-tier state cache family (`rwkv_state_cache_${name}`), with the
 *  conversation cache (`rwkv_conversation_cache_${name}`, unlabelled) as the tier "conversation". */
function perTier(metrics, name) {
  const out = byLabel(metrics, `rwkv_state_cache_${name}`, "tier");
  const conversation = total(metrics, `rwkv_conversation_cache_${name}`);
  if (conversation !== undefined) out.conversation = conversation;
  return out;
}

function hitRates(now, before) {
  const hits = perTier(now, "hits_total"), misses = perTier(now, "misses_total");
  const hits0 = perTier(before, "hits_total"), misses0 = perTier(before, "misses_total");
  const out = {};
  for (const tier of Object.keys(hits)) {
    const dh = hits[tier] - (hits0[tier] ?? 0), dm = (misses[tier] ?? 0) - (misses0[tier] ?? 0);
    out[tier] = dh + dm > 0 ? (100 * dh) / (dh + dm) : null; // no lookups: a gap, not 0 %
  }
  return out;
}

/** The figures of one interval between two scrapes taken `dt` seconds apart. */
export function figures(now, before, dt) {
  const running = total(now, "rwkv_requests_running") ?? 0;
  const slots = total(now, "rwkv_slots") ?? 0;
  const mib = {};
  for (const [tier, b] of Object.entries(perTier(now, "bytes"))) mib[tier] = b / 2 ** 20;
  return {
    throughput: { generated: rate(now, before, "rwkv_generation_tokens_total", dt),
      prefilled: rate(now, before, "rwkv_prompt_tokens_total", dt) },
    requests: { running, waiting: total(now, "rwkv_requests_waiting") ?? 0,
      "streams open": total(now, "rwkv_http_streams_open") ?? 0,
      "HTTP requests/s": rate(now, before, "rwkv_http_requests_total", dt, served) },
    occupancy: { "running / slots": slots > 0 ? (100 * running) / slots : null },
    latency: { "time to first token": meanOver(now, before, "rwkv_time_to_first_token_seconds"),
      "inter-token": meanOver(now, before, "rwkv_inter_token_latency_seconds") },
    cacheMiB: mib,
    hitRate: hitRates(now, before),
  };
}

/** Whole-run figures for the cards above the charts. */
export function totals(now) {
  const hits = perTier(now, "hits_total"), misses = perTier(now, "misses_total");
  const rates = {};
  for (const tier of Object.keys(hits)) {
    const n = hits[tier] + (misses[tier] ?? 0);
    rates[tier] = n > 0 ? (100 * hits[tier]) / n : null;
  }
  return {
    ready: total(now, "rwkv_ready"), slots: total(now, "rwkv_slots"),
    generated: total(now, "rwkv_generation_tokens_total"), prompt: total(now, "rwkv_prompt_tokens_total"),
    steps: total(now, "rwkv_engine_steps_total"), stepMs: (total(now, "rwkv_engine_step_seconds") ?? 0) * 1000,
    hitRates: rates,
  };
}

// Named states (tuned state files loaded on the server), feature-detected: the server's OpenAPI
// document is asked whether it has a state list route, so a server without one is never sent a
// request it would answer 404 (which a browser logs as an error).

import { api } from "./api.js";

const LIST_PATHS = ["/v1/states", "/v1/states/list"];

/** Names usable as `"state": NAME` on the chat route; [] when the server lists none. */
export async function listStates(signal) {
  const doc = await api("/openapi.json", { signal });
  const route = LIST_PATHS.find((p) => doc.paths && doc.paths[p] && doc.paths[p].get);
  if (!route) return [];
  return namesOf(await api(route, { signal }));
}

/** Accepts a list, {data: [...]} or {states: [...]}, of names or of objects with name/id. */
export function namesOf(body) {
  const items = Array.isArray(body) ? body : (body && (body.data || body.states)) || [];
  return items.map((s) => (typeof s === "string" ? s : s && (s.name || s.id))).filter(Boolean);
}

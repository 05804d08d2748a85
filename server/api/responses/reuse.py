"""A stateless client's history, reused: a create from no state (no previous_response_id,
conversation, compaction item or context_management) whose prompt's tokens begin with the whole
token history of an earlier response of the same API key forks that response, as
previous_response_id would, and prefills only the rest (docs/agents.md, "The Responses API").

A client that keeps its history itself (the Agents SDK with a local session, any client with
`store: false`) sends it all as input every turn: the previous turn's input items, its output
items, the new message. Rendered, that prompt begins with exactly the previous response's tokens
when the model's reply re-tokenizes as it was generated (the usual case for a trained model; a
reply that does not is prefilled whole, as before, and the turn after it matches again). The
match is exact, token for token, so the answer is the one the chain would give.

Candidates are each key's last MAX_RECENT responses that ended and are still in memory (a
stored response the state cache dropped is still forked: its state is read back or rebuilt).
Looking them up costs one byte comparison of the prompt's tokens per candidate.
"""

from __future__ import annotations

from array import array
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from weakref import WeakKeyDictionary

from cachetools import LRUCache

from server.api.responses.conversation import Start
from server.api.responses.render import RESPONSE
from server.api.services import Services, task_manager
from server.tasks.errors import TaskNotFound

if TYPE_CHECKING:
    from server.tasks import TaskManager
    from server.tasks.records import Task

MAX_RECENT = 32
"""Responses per API key that a stateless create may continue (the newest)."""
MAX_KEYS = 4096
"""API keys whose recent responses are remembered (the least recently used are forgotten)."""


@dataclass(frozen=True)
class Reuse:
    """The earlier response a create continues, and the prompt's text after its history."""

    task: Task
    rest: str


class Recent:
    """Each key's last MAX_RECENT responses (their task ids), newest last."""

    def __init__(self) -> None:
        self._ids: LRUCache[str, deque[str]] = LRUCache(maxsize=MAX_KEYS)

    def add(self, owner: str | None, task_id: str) -> None:
        ids = self._ids.get(owner or "")
        if ids is None:
            ids = self._ids[owner or ""] = deque(maxlen=MAX_RECENT)
        ids.append(task_id)

    async def find(self, sv: Services, owner: str | None, prompt: str) -> Reuse | None:
        """The response whose whole history the prompt's tokens extend (the longest), and the
        prompt's text after it; None when none does, or the text cannot be cut at that token
        (its rest would not tokenize as the prompt's tokens do)."""
        ids = self._ids.get(owner or "")
        if not ids:
            return None
        tm = task_manager(sv)
        tokens = await tm.inputs.encode(prompt)
        whole = memoryview(tokens_bytes(tokens))
        best: Task | None = None
        for tid in ids:
            t = tm.table.find(tid)
            if t is None or t.running or not t.tokens or len(t.tokens) >= len(tokens):
                continue
            mine = t.tokens.tobytes()
            if (best is None or len(t.tokens) > len(best.tokens)) and whole[: len(mine)] == mine:
                best = t
        if best is None:
            return None
        head = sv.tokenizer.decode(list(best.tokens))
        if not prompt.startswith(head):
            return None
        rest = prompt[len(head) :]
        if tokens_bytes(await tm.inputs.encode(rest)) != whole[len(best.tokens.tobytes()) :]:
            return None
        return Reuse(best, rest)


async def continued(
    sv: Services, owner: str | None, src: Task | None, conv: Start | None, prompt: str, meta: dict[str, Any]
) -> Reuse | None:
    """For a create from no state (`src` and `conv` None): the earlier response whose history its
    prompt extends (None: none). Its meta then shows no previous_response_id (none was sent)."""
    if src is not None or conv is not None:
        return None
    found = await recent(task_manager(sv)).find(sv, owner, prompt)
    if found is not None:
        meta["previous"] = None
    return found


async def fork(
    tm: TaskManager, reused: Reuse, prompt: str, params: dict[str, Any], *, store: bool, owner: str | None
) -> Task:
    """The response: a fork of the earlier one with the rest of the prompt, or where that one was
    deleted meanwhile a create of the whole `prompt`."""
    try:
        return await tm.fork(reused.task.id, params, reused.rest, tmp=not store, owner=owner, tag=RESPONSE,
                             inherit=False)  # fmt: skip
    except TaskNotFound:
        return await tm.create(prompt, params, persistent=store, owner=owner, tag=RESPONSE)


_RECENT: WeakKeyDictionary[TaskManager, Recent] = WeakKeyDictionary()


def recent(tm: TaskManager) -> Recent:
    """The recent responses of the server whose task layer is `tm` (one per task manager)."""
    r = _RECENT.get(tm)
    if r is None:
        r = _RECENT[tm] = Recent()
    return r


def tokens_bytes(ids: list[int]) -> bytes:
    """Token ids as the bytes of an array('i') (Task.tokens' own layout)."""
    return array("i", ids).tobytes()

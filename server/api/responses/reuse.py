"""A stateless client's history, reused: a create from no state (no previous_response_id or
conversation; or from its input's compaction item) whose prompt's tokens begin with the whole
token history of an earlier response of the same API key (after that compaction's) forks that
response, as previous_response_id would, and prefills only the rest (docs/agents.md, "The
Responses API").

A client that keeps its history itself (the Agents SDK with a local session, any client with
`store: false`) sends it all as input every turn: the previous turn's input items, its output
items, the new message. Rendered, that prompt begins with exactly the previous response's tokens
when the model's reply re-tokenizes as it was generated (the usual case for a trained model; a
reply that does not is prefilled whole, as before, and the turn after it matches again). The
match is exact, token for token, so the answer is the one the chain would give.

Candidates are each key's last MAX_RECENT responses that ended (the newest LOAD_NEWEST read back
from the database when the task table no longer holds them, or after a restart; a response whose state the state
cache dropped is still forked: its state is read back or rebuilt).
Looking them up costs one byte comparison of the prompt's tokens per candidate.
"""

from __future__ import annotations

from array import array
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from weakref import WeakKeyDictionary

from cachetools import LRUCache

from server.api.responses import compaction
from server.api.responses.access import separator
from server.api.responses.conversation import Start
from server.api.responses.render import RESPONSE
from server.api.services import Services, task_manager
from server.tasks.config import TokenizerLike
from server.tasks.errors import TaskConflict, TaskError, TaskNotFound
from server.tasks.records import TASK

if TYPE_CHECKING:
    from server.tasks import TaskManager
    from server.tasks.records import Task

MAX_RECENT = 32
"""Responses per API key that a stateless create may continue (the newest)."""
LOAD_NEWEST = 2
"""A key's newest responses read back from the database when no longer in memory (a busy
server's task table keeps the last 1,024 tasks it touched)."""
MAX_KEYS = 4096
"""API keys whose recent responses are remembered (the least recently used are forgotten)."""


@dataclass(frozen=True)
class Reuse:
    """The earlier response a create continues: its task, and the text after its history; `src`
    and `text`: what the create would have forked (None: nothing) and with what text."""

    task: Task
    rest: str
    rest_tokens: int
    """The rest's tokens (what a fork of `task` feeds after its pending token)."""
    src: Task | None
    text: str


class Recent:
    """Each key's last MAX_RECENT responses (their task ids), newest last."""

    def __init__(self) -> None:
        self._ids: LRUCache[str, deque[str]] = LRUCache(maxsize=MAX_KEYS)

    def add(self, owner: str | None, task_id: str) -> None:
        ids = self._ids.get(owner or "")
        if ids is None:
            ids = self._ids[owner or ""] = deque(maxlen=MAX_RECENT)
        ids.append(task_id)

    async def find(
        self, tm: TaskManager, tokenizer: TokenizerLike, owner: str | None, src: Task | None, text: str
    ) -> Reuse | None:
        """The response whose whole history is a prefix of src's history (none: empty) then
        `text`'s tokens, and goes further than src's (the longest such), with the text after it;
        None when none does, or the text cannot be cut at that token (its rest would not
        tokenize as the whole does)."""
        ids = self._ids.get(owner or "")
        if ids is None:  # (none since this server started: its newest stored tasks, read back below)
            ids = await self._seed(tm, owner)
        if not ids:
            return None
        n_base = len(src.tokens) if src is not None else 0
        tokens = [*(src.tokens if src is not None else ()), *await tm.inputs.encode(text)]
        whole = memoryview(tokens_bytes(tokens))
        best: Task | None = None
        for i, tid in enumerate(reversed(ids)):
            t = tm.table.find(tid)
            if t is None and i < LOAD_NEWEST:  # (other tasks pushed it out of memory: read back)
                t = await _load(tm, tid, owner)
            if t is None or t.running or t.tag != RESPONSE or not n_base < len(t.tokens) < len(tokens):
                continue
            mine = t.tokens.tobytes()
            if (best is None or len(t.tokens) > len(best.tokens)) and whole[: len(mine)] == mine:
                best = t
        if best is None:
            return None
        head = tokenizer.decode(tokens[n_base : len(best.tokens)])
        rest = text[len(head) :]
        after = tokens[len(best.tokens) :]
        if not text.startswith(head) or await tm.inputs.encode(rest) != after:
            return None
        return Reuse(best, rest, len(after), src, text)

    async def _seed(self, tm: TaskManager, owner: str | None) -> deque[str]:
        """A key's list after a restart: its LOAD_NEWEST newest stored tasks (those that are
        responses are candidates), so its first turn sent whole is not prefilled whole."""
        ids = self._ids[owner or ""] = deque(maxlen=MAX_RECENT)
        try:
            page = await tm.list(owner, limit=LOAD_NEWEST, kind=TASK)
        except TaskError:
            return ids
        ids.extend(row["task_id"] for row in reversed(page["tasks"]))  # (newest last)
        return ids


async def continued(
    sv: Services, owner: str | None, src: Task | None, conv: Start | None, prompt: str, meta: dict[str, Any]
) -> Reuse | None:
    """For a create from no state or from an input's compaction item (not after a
    previous_response_id or in a conversation): the earlier response whose history its prompt
    extends (None: none). Its meta then shows no previous_response_id (none was sent)."""
    if conv is not None or (src is not None and not compaction.is_compaction(src)):
        return None
    text = separator(sv, src) + prompt if src is not None else prompt
    tm = task_manager(sv)
    found = await recent(tm).find(tm, sv.tokenizer, owner, src, text)
    if found is not None:
        meta["previous"] = None
    return found


async def fork(tm: TaskManager, reused: Reuse, params: dict[str, Any], *, store: bool, owner: str | None) -> Task:
    """The response: a fork of the earlier one with the rest of the prompt, or where that one was
    deleted or started again meanwhile what the create would have made without it."""
    try:
        return await tm.fork(reused.task.id, params, reused.rest, tmp=not store, owner=owner, tag=RESPONSE,
                             inherit=False)  # fmt: skip
    except (TaskNotFound, TaskConflict):
        if reused.src is None:
            return await tm.create(reused.text, params, persistent=store, owner=owner, tag=RESPONSE)
        return await tm.fork(reused.src.id, params, reused.text, tmp=not store, owner=owner, tag=RESPONSE,
                             inherit=False)  # fmt: skip


async def _load(tm: TaskManager, task_id: str, owner: str | None) -> Task | None:
    try:
        return await tm.get(task_id, owner)
    except TaskError:  # (deleted, unavailable: no candidate)
        return None


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

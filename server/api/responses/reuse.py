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

Candidates are each key's last MAX_PER_KEY responses (at most MAX_ENTRIES for all keys). Once a
response has ended, its whole token history is indexed by its length and SHA-256 digest, so a
lookup hashes the prompt's tokens once, taking the digest at each length some candidate has, and
compares tokens only with the candidates whose digest matches: a key with many conversations at
once (one key for all of an application's users) finds each one's previous response. A response
the task table no longer holds is read back from the database when its digest matches; after a
restart a key's newest responses are indexed by the digests their rows keep (tasks.digest); one
not indexed yet when it left memory (or one a crash interrupted) is looked for only among the
key's LOAD_NEWEST newest (read back); a response whose state the state cache dropped is still
forked: its state is read back or rebuilt.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from weakref import WeakKeyDictionary

from server.api.responses import compaction
from server.api.responses.access import separator
from server.api.responses.conversation import Start
from server.api.responses.render import RESPONSE
from server.api.services import Services, task_manager
from server.tasks.config import TokenizerLike
from server.tasks.errors import TaskConflict, TaskError, TaskNotFound
from server.tasks.records import TASK
from server.tasks.token_digest import prefix_digests, tokens_bytes

if TYPE_CHECKING:
    from server.tasks import TaskManager
    from server.tasks.records import Task

MAX_PER_KEY = 1024
"""Responses per API key that a stateless create may continue (the newest)."""
MAX_ENTRIES = 65536
"""Responses remembered for all keys together (the least recently used key's oldest go first)."""
LOAD_NEWEST = 2
"""A key's newest responses read back from the database when they left memory before they were
indexed (a busy server's task table keeps the last 1,024 tasks it touched), or after a restart
when their rows have no digest (a crash interrupted them)."""


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


class _Key:
    """One key's responses, newest last: task id -> (tokens, digest) once indexed (None until
    it has ended), and the index: length -> digest -> task id."""

    def __init__(self) -> None:
        self.ids: OrderedDict[str, tuple[int, bytes] | None] = OrderedDict()
        self.index: dict[int, dict[bytes, str]] = {}

    def put(self, tid: str, entry: tuple[int, bytes] | None) -> None:
        """(Re)place tid's entry (None: not indexed), keeping its place in the order."""
        old = self.ids.get(tid)
        if old is not None and self.index.get(old[0], {}).get(old[1]) == tid:
            del self.index[old[0]][old[1]]
            if not self.index[old[0]]:
                del self.index[old[0]]
        self.ids[tid] = entry
        if entry is not None:
            self.index.setdefault(entry[0], {})[entry[1]] = tid

    def drop(self, tid: str) -> None:
        self.put(tid, None)
        del self.ids[tid]


class Recent:
    """Each key's last MAX_PER_KEY responses, indexed by their token histories once ended."""

    def __init__(self) -> None:
        self._keys: OrderedDict[str, _Key] = OrderedDict()  # least recently used first
        self._n = 0  # entries of all keys

    def add(self, owner: str | None, task_id: str) -> None:
        key = self._key(owner)
        if task_id in key.ids:
            self._drop(key, task_id)
        key.ids[task_id] = None
        self._n += 1
        if len(key.ids) > MAX_PER_KEY:
            self._drop(key, next(iter(key.ids)))
        while self._n > MAX_ENTRIES:  # (the current key is the newest: another one gives)
            name, oldest = next(iter(self._keys.items()))
            if oldest.ids:
                self._drop(oldest, next(iter(oldest.ids)))
            if not oldest.ids:
                del self._keys[name]

    async def find(
        self, tm: TaskManager, tokenizer: TokenizerLike, owner: str | None, src: Task | None, text: str
    ) -> Reuse | None:
        """The response whose whole history is a prefix of src's history (none: empty) then
        `text`'s tokens, and goes further than src's (the longest such), with the text after it;
        None when none does, or the text cannot be cut at that token (its rest would not
        tokenize as the whole does)."""
        key = self._keys.get(owner or "")
        if key is None:  # (none since this server started: its newest stored tasks, read back below)
            key = await self._seed(tm, owner)
        await self._index_ended(tm, key, owner)
        n_base = len(src.tokens) if src is not None else 0
        tokens = [*(src.tokens if src is not None else ()), *await tm.inputs.encode(text)]
        best = await self._longest(tm, key, owner, tokens, n_base)
        if best is None:
            return None
        head = tokenizer.decode(tokens[n_base : len(best.tokens)])
        rest = text[len(head) :]
        after = tokens[len(best.tokens) :]
        if not text.startswith(head) or await tm.inputs.encode(rest) != after:
            return None
        return Reuse(best, rest, len(after), src, text)

    def _key(self, owner: str | None) -> _Key:
        key = self._keys.get(owner or "")
        if key is None:
            key = self._keys[owner or ""] = _Key()
        self._keys.move_to_end(owner or "")
        return key

    def _drop(self, key: _Key, tid: str) -> None:
        key.drop(tid)
        self._n -= 1

    async def _seed(self, tm: TaskManager, owner: str | None) -> _Key:
        """A key's list after a restart: its MAX_PER_KEY newest stored responses that ended, indexed
        by their stored digests (tasks.digest: no tokens read), then its LOAD_NEWEST newest stored
        tasks not among them (one a crash interrupted has no digest: read back when looked for),
        so its first turn sent whole is not prefilled whole."""
        key = self._key(owner)
        try:
            ended = await tm.digests(owner, RESPONSE, MAX_PER_KEY)
            page = await tm.list(owner, limit=LOAD_NEWEST, kind=TASK)
        except TaskError:
            return key
        for tid, n, digest in reversed(ended):  # (newest last)
            self.add(owner, tid)
            key.put(tid, (n, digest))
        for row in reversed(page["tasks"]):
            if row["task_id"] not in key.ids:
                self.add(owner, row["task_id"])
        return key

    async def _index_ended(self, tm: TaskManager, key: _Key, owner: str | None) -> None:
        """Index the key's responses that have ended (those no longer in memory: only its
        LOAD_NEWEST newest, read back); forget those that are not responses."""
        self._keys.move_to_end(owner or "")
        for i, (tid, entry) in enumerate(reversed(list(key.ids.items()))):
            if entry is not None:
                continue
            t = tm.table.find(tid)
            if t is None and i < LOAD_NEWEST:  # (other tasks pushed it out of memory: read back)
                t = await _load(tm, tid, owner)
            if t is None or t.running or tid not in key.ids:  # (or forgotten while it was read)
                continue
            if t.tag != RESPONSE:
                self._drop(key, tid)
            else:
                n = len(t.tokens)
                key.put(tid, (n, prefix_digests(t.tokens, [n])[n]))

    async def _longest(
        self, tm: TaskManager, key: _Key, owner: str | None, tokens: list[int], n_base: int
    ) -> Task | None:
        """The indexed response of the most tokens that `tokens` begin with (more than n_base,
        fewer than all): the prompt hashed once, its digest taken at each length one has."""
        digests = prefix_digests(tokens, [n for n in key.index if n_base < n < len(tokens)])
        hits = [(n, tid) for n, d in digests.items() if (tid := key.index[n].get(d)) is not None]
        for n, tid in reversed(hits):  # (the longest first)
            t = tm.table.find(tid) or await _load(tm, tid, owner)
            if tid not in key.ids:  # (forgotten while it was read)
                continue
            if t is None:  # (deleted)
                self._drop(key, tid)
            elif t.running or len(t.tokens) != n or t.tokens.tobytes() != tokens_bytes(tokens[:n]):
                key.put(tid, None)  # (continued meanwhile: indexed again once it ends)
            else:
                return t
        return None


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

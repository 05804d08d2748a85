"""Task records: what a task is, in memory and as a database row.

A task keeps its whole token history `tokens` (every prompt and every generated token, including
those inherited from the task it was forked from). `state_id` names its last settled state and
`state_pos` says how many tokens of the history that state has consumed; `tokens[state_pos:]` is
what must be fed before anything new. That one rule covers templates, forks, continues, tasks
interrupted by a crash and states dropped by a budget (state_pos = 0: recompute from zero).

The history only grows (a continue appends), so any state of a task is a valid starting point
for its later history. States are written behind the row: `stored_id`/`stored_pos` name the
last state in the database (what the row says), `state_id`/`state_pos` the newest one, which
may be in memory only until it is written (or dropped: then it is rebuilt from the tokens).

Ids: a private named template of an API key is stored as `_<name>@<owner hash prefix>` (names
are per key); clients always see `display_id` (`_<name>`).

A `Run` is one engine submission of a task (server.tasks.runs), attached to the task while it runs.
"""

from __future__ import annotations

import asyncio
import sys
import time
import uuid
from array import array
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson
from sqlalchemy import Row

from server.engine.protocol import Handle
from server.engine.types import SamplingParams
from server.tasks.config import LatencyRecorder
from server.tasks.output import Output
from server.tasks.params import TaskParams
from server.tasks.schema import DbRow
from server.tasks.token_digest import history_digest

PREFILL, READY, RUNNING, FINISHED = 0, 1, 2, 3
TMP, TASK, TEMPLATE = "tmp", "task", "template"
FINISH_REASONS = ("stop", "length", "stopped", "error", "interrupted")
STORED, CACHED, REBUILD = "stored", "cached", "rebuild"
"""Task.state: its newest state is in the database / only in memory / gone (the next run
prefills the history from the last stored state, or from zero)."""
OWNER_TAG = 12
"""Hex characters of the owner hash in a private named template's id."""


class Held(Protocol):
    """The states held in memory (server.tasks.cache.StateCache), for Task.state_in."""

    def __contains__(self, key: str, /) -> bool: ...


def new_id(kind: str, name: str | None = None, owner: str | None = None) -> str:
    """A new id. A named template with an `owner` (private) is `_<name>@<owner prefix>`."""
    if kind == TMP:
        return "TMP_" + uuid.uuid4().hex
    if kind == TASK:
        return "TASK_" + uuid.uuid4().hex
    if not name:
        return "_TMPL_" + uuid.uuid4().hex
    return f"_{name}@{owner[:OWNER_TAG]}" if owner else "_" + name


def qualified(task_id: str, owner: str | None) -> str | None:
    """The id `owner`'s private template of that plain name has (None: not a plain template id)."""
    if owner is None or not task_id.startswith("_") or "@" in task_id:
        return None
    return f"{task_id}@{owner[:OWNER_TAG]}"


def display_id(task_id: str | None) -> str | None:
    """The id a client sees (a private template's plain name)."""
    return task_id.split("@", 1)[0] if task_id else task_id


def kind_of(task_id: str) -> str:
    if task_id.startswith("_"):
        return TEMPLATE
    return TMP if task_id.startswith("TMP_") else TASK


def decode_rate(tokens: int, gen_time: float) -> float:
    """A task's `speed`: the tokens generated after the first over `gen_time`, which starts at the
    first token (the prefill made that one: counted, a one-token answer would read as thousands of
    tokens a second); 0 before a second token."""
    return (tokens - 1) / gen_time if gen_time > 0 and tokens > 1 else 0.0


@dataclass
class Run:
    """One engine submission of a task, from its start to its settle."""

    pos: int
    """state_pos the run started from."""
    n_input: int
    """Tokens submitted (prefilled)."""
    params: SamplingParams
    key: str | None
    """Pinned cache key of the starting state (released when the run settles)."""
    handle: Handle | None = None
    """The engine's handle; None when there was nothing to feed."""
    t_submit: float = field(default_factory=time.monotonic)
    t_first: float | None = None
    recorder: LatencyRecorder | None = None
    t_last: float | None = None
    """When its last batch of tokens arrived (kept by the recorder)."""
    gen_base: float = 0.0
    """gen_time of earlier runs of the same output."""
    after_eos: bool = False
    """No prompt, and the history's last token is EOS (a continue or a fork of an output a stop
    token ended): the run's input ends with that EOS (settle._covered)."""
    n_out: int = 0
    saved_out: int = 0
    """n_out in the last progress row written."""
    started: asyncio.Future[Any] | None = None
    """A persistent run's start row commit (its settle waits for it)."""
    undo: Callable[[], None] | None = None
    """Undoes the start when that commit failed (Runs._discard; runs once)."""
    discarded: bool = False


@dataclass
class Task:
    id: str
    kind: str
    owner: str | None = None
    parent_id: str | None = None
    params: TaskParams = field(default_factory=TaskParams)
    prompt: str = ""
    prompt_len: int = 0
    tokens: array[int] = field(default_factory=lambda: array("i"))
    out_start: int = 0
    out: Output = field(default_factory=Output)
    state_id: str | None = None
    state_pos: int = 0
    status: int = FINISHED
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prefill_time: float = 0.0
    gen_time: float = 0.0
    created_at: float = field(default_factory=time.time)
    updated_at: float = field(default_factory=time.time)
    finished_at: float | None = None
    public: bool = False
    """A template every API key may read and fork."""
    stored_id: str | None = None
    """The last state written to the database (the row's state_id), or None."""
    stored_pos: int = 0
    instance: str | None = None
    """The server instance running it (None: not running)."""
    version: int = 0
    """The row's version (+1 at each claim of a run)."""
    base_id: str | None = None
    """The template made from a state file whose state the history starts from (None: the zero
    state; server.tasks.lineage)."""
    tag: str | None = None
    """What the task is to the route that made it, set at creation and never changed:
    "response" (/v1/responses), "compaction <uuid>" (server.api.responses.compaction),
    "lightning session <name>" (server.api.lightning.sessions), None (/v1/tasks and the rest; a
    fork does not inherit it)."""
    # runtime only
    run: Run | None = None  # the current run while running
    run_from: int = 0
    """Output token index where the latest run's text begins: a continue without a prompt starts
    at the output's length then (its stream shows the new text), any other run at 0."""
    saved: asyncio.Future[None] | None = None  # the last queued settle write of this task
    done: asyncio.Event | None = None  # set when the current run settled
    pending_writes: int = 0  # settle writes queued and not yet done
    stop_requested: bool = False
    interrupted: bool = False  # aborted by a shutdown (finish_reason "interrupted")
    deleted: bool = False
    deleting: bool = False  # a delete stops its run: what waited for that settle answers 404

    @property
    def running(self) -> bool:
        return self.status != FINISHED

    def phase(self) -> int:
        """Its status as shown (API answers, rows): READY while its run waits for a slot, PREFILL
        once the engine gave it one (Handle.admitted: its prompt is being fed; `status` turns
        RUNNING at its first token, in the pump)."""
        handle = self.run.handle if self.run is not None else None
        return PREFILL if self.status == READY and handle is not None and handle.admitted else self.status

    @property
    def display_id(self) -> str:
        return self.id.split("@", 1)[0]

    @property
    def state(self) -> str:
        """state_in() without a look at the cache."""
        return self.state_in(None)

    def state_in(self, held: Held | None) -> str:
        """STORED, CACHED or REBUILD (docs/task-api.md). A running task's state is in the
        engine (CACHED); a finished task whose state has not consumed its history up to the
        pending token is REBUILD (in part: e.g. interrupted). `held`: the states in memory (the
        StateCache): a TMP_ state (never stored) that it no longer holds is gone, and the next
        run starts from the last stored state (a membership test, no query). The cache's own
        evictions already move state_id back (TaskManager._state_evicted); this also covers a
        state a fork took over from a TMP_ source and never replaced (a run that fed nothing
        or failed)."""
        if self.running:
            return CACHED
        sid, pos = self.state_id, self.state_pos
        if (
            held is not None
            and sid is not None
            and sid != self.stored_id
            and sid.startswith("TMP_")
            and sid not in held
        ):
            sid, pos = self.stored_id, self.stored_pos
        if sid is None or pos < len(self.tokens) - 1:
            return REBUILD
        return STORED if sid == self.stored_id else CACHED

    @property
    def generated(self) -> int:
        return len(self.out)

    def finish(self, reason: str, error: str | None) -> None:
        """Show the task finished (status, output, stream readers, waiters)."""
        self.status, self.finish_reason = FINISHED, reason
        self.finished_at = time.time()
        out = self.out
        out.finished, out.finish_reason = True, reason
        out.error = error if reason == "error" else None
        out.notify()
        if self.done is not None:
            self.done.set()

    def generating(self) -> float:
        """Seconds this output has been generating: gen_time, plus the running run's so far."""
        run = self.run
        if run is None or run.t_first is None:
            return self.gen_time
        return run.gen_base + time.monotonic() - run.t_first

    def speed(self) -> float:
        return decode_rate(self.completion_tokens, self.generating())

    def response(self, held: Held | None = None) -> dict[str, Any]:
        """TaskResponse (the SDK's keys + ours); `held`: as state_in's."""
        return {
            "task_id": self.display_id,
            "result": self.out.text,
            "prefill_time": self.prefill_time,
            "gen_time": self.generating(),
            "speed": self.speed(),
            "finished": not self.running,
            "status": self.phase(),
            "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "state": self.state_in(held),
            "instance": self.instance,
        }

    def info(self) -> dict[str, Any]:
        return {
            "task_id": self.display_id,
            "generated_buf": self.generated,
            "status": self.phase(),
            "finish_reason": self.finish_reason,
        }

    def summary(self, held: Held | None = None) -> dict[str, Any]:
        """The task's row in a list; `held`: as state_in's."""
        return {
            "task_id": self.display_id,
            "kind": self.kind,
            "status": self.phase(),
            "finish_reason": self.finish_reason,
            "generated_buf": self.generated,
            "created_at": self.created_at,
            "updated_at": self.updated_at,
            "parent_id": display_id(self.parent_id),
            "state": self.state_in(held),
            "instance": self.instance,
            "public": self.public,
        }


def _ints_to_blob(values: Iterable[int]) -> bytes:
    """int32 little-endian (token ids; char offsets < 2**31)."""
    a = array("i", values)
    return a.tobytes() if _LITTLE else _swap(a).tobytes()


def _blob_to_ints(blob: bytes | None) -> array[int]:
    a = array("i")
    a.frombytes(blob or b"")
    return a if _LITTLE else _swap(a)


def _swap(a: array[int]) -> array[int]:
    b = array(a.typecode, a)
    b.byteswap()
    return b


_LITTLE = sys.byteorder == "little"


def to_row(t: Task) -> dict[str, Any]:
    """The whole row of a new task (its state pointer: the last STORED state)."""
    return {
        "id": t.id,
        "kind": t.kind,
        "status": t.phase(),
        "finish_reason": t.finish_reason,
        "owner": t.owner,
        "parent_id": t.parent_id,
        "params": orjson.dumps(t.params).decode(),
        "prompt": t.prompt,
        "prompt_len": t.prompt_len,
        "tokens": _ints_to_blob(t.tokens),
        "out_start": t.out_start,
        "text": t.out.text,
        "offsets": _ints_to_blob(t.out.offsets),
        "state_id": t.stored_id,
        "state_pos": t.stored_pos,
        "prompt_tokens": t.prompt_tokens,
        "completion_tokens": t.completion_tokens,
        "prefill_time": t.prefill_time,
        "gen_time": t.generating(),  # a progress row keeps the time so far (a crash keeps it)
        "created_at": t.created_at,
        "updated_at": t.updated_at,
        "public": t.public,
        "instance": t.instance,
        "version": t.version,
        "base_id": t.base_id,
        "tag": t.tag,
        "digest": None if t.running else history_digest(t.tokens).hex(),  # (the Responses reuse index's key)
    }


UPDATE_COLUMNS = (
    "id",
    "status",
    "finish_reason",
    "params",
    "prompt",
    "prompt_len",
    "tokens",
    "out_start",
    "text",
    "offsets",
    "prompt_tokens",
    "completion_tokens",
    "prefill_time",
    "gen_time",
    "updated_at",
    "instance",
    "digest",
)
"""What a run changes in an existing row: never its identity, owner or version (claims own
those) nor its state pointer (only a state write or the database budget moves that)."""


def update_row(t: Task) -> dict[str, Any]:
    """The columns of t a run's writes (start, progress, settle) update."""
    row = to_row(t)
    return {k: row[k] for k in UPDATE_COLUMNS}


def from_row(r: DbRow | Mapping[str, Any]) -> Task:
    m = r._mapping if isinstance(r, Row) else r
    out = Output(m["text"], _blob_to_ints(m["offsets"]), finished=m["status"] == FINISHED)
    out.finish_reason = m["finish_reason"]
    return Task(
        id=m["id"],
        kind=m["kind"],
        owner=m["owner"],
        parent_id=m["parent_id"],
        params=orjson.loads(m["params"]),
        prompt=m["prompt"],
        prompt_len=m["prompt_len"],
        tokens=_blob_to_ints(m["tokens"]),
        out_start=m["out_start"],
        out=out,
        state_id=m["state_id"],
        state_pos=m["state_pos"],
        status=m["status"],
        finish_reason=m["finish_reason"],
        prompt_tokens=m["prompt_tokens"],
        completion_tokens=m["completion_tokens"],
        prefill_time=m["prefill_time"],
        gen_time=m["gen_time"],
        created_at=m["created_at"],
        updated_at=m["updated_at"],
        finished_at=m["updated_at"] if m["status"] == FINISHED else None,
        public=bool(m["public"]),
        stored_id=m["state_id"],
        stored_pos=m["state_pos"],
        instance=m["instance"],
        version=m["version"],
        base_id=m.get("base_id"),
        tag=m.get("tag"),
    )


def complete_interrupted(t: Task, decode: Callable[[Sequence[int]], str]) -> None:
    """A task a crash interrupted shows its last progress row's text, which lacks what the
    engine's stream still held: the bytes of an unfinished character, text held back for a stop
    string. Complete it as a run stopped there shows it (the decode of its output tokens), where
    that decode extends the stored text; an output of several runs whose text is not one decode
    (a stop string cut, a character split at a run's end) is left as stored."""
    text = t.out.text
    full = decode(t.tokens[t.out_start :])
    if len(full) > len(text) and full.startswith(text):
        t.out.append(full[len(text) :], 0)

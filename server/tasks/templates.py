"""Filling a new template (TaskManager.as_template): give it a stored state that has consumed
all but the last token of its history, before the template is answered."""

from __future__ import annotations

import asyncio
from array import array

from server.tasks.codec import encode_state
from server.tasks.lineage import base_of
from server.tasks.output import Output
from server.tasks.persist import Persistence
from server.tasks.records import TEMPLATE, Task, to_row
from server.tasks.runs import Runs
from server.tasks.store import state_row


def template_of(src: Task, tid: str, owner: str | None, public: bool) -> Task:
    """A new template `tid` with the finished task's history, text and parameters (less a
    `max_tokens` of 0: forks of it generate); its state: fill_template."""
    params = {k: v for k, v in src.params.items() if not (k == "max_tokens" and v == 0)}
    tpl = Task(
        id=tid,
        kind=TEMPLATE,
        owner=owner,
        parent_id=src.id,
        public=public,
        params=params,
        prompt=src.prompt,
        prompt_len=src.prompt_len,
        tokens=array("i", src.tokens),
        out_start=src.out_start,
        out=Output(src.out.text, src.out.offsets),
        finish_reason=src.finish_reason,
        prompt_tokens=src.prompt_tokens,
        completion_tokens=src.completion_tokens,
        prefill_time=src.prefill_time,
        gen_time=src.gen_time,
        base_id=base_of(src),
    )
    tpl.out.finish_reason = src.finish_reason
    return tpl


async def fill_template(tpl: Task, src: Task, persistence: Persistence, runs: Runs, signature: str) -> None:
    """With the source's state at hand: the template's row and a copy of that state in one
    transaction. Without (dropped, never stored, not at the last token): prefill the template's
    history once (forks then start at no cost), and wait until that state is written."""
    state, pos, key = await persistence.resolve_state(src)
    try:
        if state is not None and key is not None and pos >= len(src.tokens) - 1:
            sid = f"{tpl.id}:{key.rsplit(':', 1)[-1]}"
            tpl.state_id, tpl.state_pos = sid, pos
            persistence.cache.put(sid, state, template=True)
            enc = await asyncio.to_thread(encode_state, state, signature, wkv_dtype=persistence.store_dtype)
            tpl.stored_id, tpl.stored_pos = sid, pos
            await persistence.writer.call(persistence.store.save, to_row(tpl), state_row(sid, tpl.id, enc, True))
            return
    finally:
        persistence.release(key)
    tpl.state_id, tpl.state_pos = src.state_id, src.state_pos  # a start for the prefill, if any
    await runs.start(tpl, None, new=True, max_tokens=0)
    if tpl.done is not None:
        await tpl.done.wait()
    if tpl.saved is not None:
        await tpl.saved
    await persistence.lane.wait_written(tpl.id)

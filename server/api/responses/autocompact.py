"""Server-side compaction in a create: `context_management: [{"type": "compaction",
"compact_threshold": N}]` (OpenAI's; docs/agents.md, "Compaction").

OpenAI compacts a history whose rendered tokens cross the threshold and sends the compaction item
in the response's output, before the reply; a client that chains by its input then drops the
items before that item. Here a compaction is the history's state, kept (compaction.py), so the
create makes one exactly as POST /v1/responses/compact would of the same fields (the previous
response's state, the tools' description, the instructions and the input, without the opening
"Assistant:"), and the response forks it with that opening alone: the same tokens, so the same
answer, as without it.

The window a threshold bounds is what the history holds since its last compaction: a chain
keeps where that was (`window_start` in each response's meta: the tokens its state held then),
and a response that resumes a compaction item starts its window there. So a chain compacts
about every N tokens, as OpenAI's does, and a client that drops what came before the last
compaction item sends at most about N tokens of input.

Not compacted (the field is accepted): a response in a conversation (the conversation holds the
history; its items are sent once), and one whose input ends with an assistant message that the
reply continues (there is no point between history and reply to keep).
"""

from __future__ import annotations

from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import Request

from server.api.responses import agent, compact, compaction, render
from server.api.responses.access import call, separator
from server.api.responses.conversation import Start
from server.api.responses.reuse import Reuse
from server.api.responses.schemas import ResponseRequest
from server.api.services import Services, get_owner, task_manager

if TYPE_CHECKING:
    from server.tasks.records import Task


@dataclass(frozen=True)
class Cut:
    """A compaction a create made: the response forks `task` with `prompt`."""

    task: Task
    prompt: str


def threshold(sv: Services, body: ResponseRequest) -> int | None:
    """The request's compact_threshold (the server's max_prompt_tokens when the entry has none);
    None: no compaction asked for."""
    for entry in body.context_management or ():
        return entry.compact_threshold or sv.settings.max_prompt_tokens
    return None


def window_start(src: Task | None) -> int:
    """The tokens src's state held at the history's last compaction (0: none)."""
    if src is None:
        return 0
    return len(src.tokens) if compaction.is_compaction(src) else int(render.meta(src).get("window_start") or 0)


async def cut(
    request: Request,
    sv: Services,
    body: ResponseRequest,
    rt: agent.ResponseTools,
    src: Task | None,
    conv: Start | None,
    prompt: str,
    meta: dict[str, Any],
    reused: Reuse | None = None,
) -> Cut | None:
    """The compaction this create makes first (None: none, under the threshold or not asked for).
    `prompt` and `meta`: the response's, as it would run without one; `meta` gains where the
    window starts, and with a compaction the item it made and the previous response the request
    named (the response forks the compaction, not that one). `reused`: the earlier response the
    create would fork (reuse.py), which holds the start of the history after src: the window is
    counted, and the compaction forked, from it. ClientGone when the client left during the
    compaction's prefill (nothing is left behind)."""
    start = window_start(src)
    if start:
        meta["window_start"] = start
    limit = threshold(sv, body)
    if limit is None or conv is not None:
        return None
    described = agent.ResponseTools(None, rt.described, None)  # (the call plan's suffix: the reply's)
    text = agent.prompt(body, described, src)[0]
    if reused is not None:  # (its rest was tokenized when it was found)
        held, new = len(reused.task.tokens) - start, reused.rest_tokens
    else:
        held = len(src.tokens) - start if src is not None else 0
        new = len(await call(task_manager(sv).inputs.encode((separator(sv, src) if src else "") + prompt)))
    if render.continues_prompt(text, {}) or held + new <= limit:
        return None
    made = await compact.make(request, sv, body, described, src, get_owner(request), reused)
    after = body.model_copy(update={"input": [], "instructions": None})  # (all of it is in the compaction)
    meta.update(window_start=len(made.tokens), compacted=compaction.compaction_id(made),
                previous=body.previous_response_id)  # fmt: skip
    return Cut(made, agent.prompt(after, rt, made)[0])


async def kept(sv: Services, c: Cut | None, made: Awaitable[Task], owner: str | None) -> Task:
    """The response's task (`made`: its create or fork); a compaction made for a response that
    could not be created is deleted (nothing of a refused request stays)."""
    try:
        return await made
    except BaseException:
        if c is not None:
            await compact.drop(task_manager(sv), c.task.id, owner)
        raise

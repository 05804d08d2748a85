"""A stored response (a task) as the Responses API's object (its streamed events:
server.api.responses.stream), and the mark that tells a response's task from any other.

Ids: the task `TASK_<hex>` (or `TMP_<hex>` with store: false) is the response `resp_<hex>`; its
message item is `msg_<hex>`, its i-th function call `fc_<hex><i:02x>` with the call id
`call_<hex><i:02x>` (derived, so every read names a call alike). What the request said beyond
generation parameters (instructions, input items, tools) is the task's `meta` parameter
(server.tasks.params; a response stored before it has none: no instructions, no items).

Usage: `input_tokens` = the whole history before the output (the previous responses included, as
OpenAI counts them), `cached_tokens` = those the starting state had already consumed (not
prefilled again), `output_tokens` = generated.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from server.api.openai.agent_render import TokenBytes
from server.api.openai.chat_format import TURN_SEP
from server.api.openai.tools import MARKER, Mode, parse_calls
from server.api.responses.items import compaction_item
from server.api.responses.logprobs import of_message
from server.tasks.records import READY, TASK, Task

_ID = re.compile(r"resp_([0-9a-f]{32})")
STATUS = {
    "stop": "completed",
    "length": "incomplete",
    "stopped": "cancelled",
    "interrupted": "failed",  # (OpenAI's incomplete_details.reason has no "interrupted": see _error)
    "error": "failed",
}


RESPONSE = "response"
"""The tag of a response's task (Task.tag, set when the route makes it; a fork of it by another
route is no response). A /v1/tasks task or a lightning session is no `resp_<hex>` of its id."""

MARK = "\uffff"
"""Servers before the tag column (schema v6) marked tasks by a stop string starting with U+FFFF
(the upgrade moved those marks into the column)."""

UNMARKED_BEFORE = 1796428800.0
"""2026-12-05 00:00 UTC: responses stored before carry no mark at all. Such a task (no tag, no
U+FFFF stop string) still reads as a response, so the chains stored by earlier servers keep
working; a /v1/tasks task of that time does too, as it always did."""


def is_response(t: Task) -> bool:
    """t was created by /v1/responses (a stored one: TMP_ responses are never read back)."""
    if t.kind != TASK:
        return False
    if t.tag is not None:
        return t.tag == RESPONSE
    stop = t.params.get("stop") or ()
    unmarked = not any(isinstance(s, str) and s.startswith(MARK) for s in stop)
    return unmarked and t.created_at < UNMARKED_BEFORE


def task_id(response_id: str) -> str | None:
    """The stored task of a response id (None: not a response id)."""
    m = _ID.fullmatch(response_id)
    return f"TASK_{m.group(1)}" if m else None


def response_id(t: Task) -> str:
    return response_id_of(t.id)


def response_id_of(task_id: str) -> str:
    """The response id of a response's task id."""
    return "resp_" + task_id.split("_", 1)[1]


def status(t: Task) -> str:
    """The response's status: queued while its run waits for a free slot of the engine (the
    task's READY: the sequences ahead of it fill every slot), in_progress while it runs."""
    if t.running:
        return "queued" if t.phase() == READY else "in_progress"
    return STATUS.get(t.finish_reason or "", "failed")


def continues(t: Task) -> bool:
    """The response continues the assistant message its input ended with (continues_prompt)."""
    return continues_prompt(t.prompt, t.params)


def continues_prompt(prompt: str, params: Mapping[str, Any]) -> bool:
    """A response of this prompt and these task parameters continues the assistant message its
    input ended with: its prompt does not end with a fresh "Assistant:" turn (always after a
    blank line: a message's text has none; a forced call's prompt ends with the marker after it).
    Its text then keeps the whitespace the model wrote first (the client joins the two); else
    that whitespace is hidden (the task's `hidden_lead`: no stop string matches in it)."""
    prompt = prompt.removesuffix(f" {MARKER}") if params_mode(params) == "forced" else prompt
    return not (TURN_SEP + prompt).endswith(TURN_SEP + "Assistant:")


def meta(t: Task) -> dict[str, Any]:
    """What the request said beyond generation parameters ({} for a response stored before)."""
    m = t.params.get("meta")
    return m if isinstance(m, dict) else {}


def tool_mode(t: Task) -> Mode | None:
    """t's tool mode (params_mode)."""
    return params_mode(t.params)


def params_mode(params: Mapping[str, Any]) -> Mode | None:
    """The tool mode of a response task with these parameters. None: the response could call no
    tool; "forced": its output is the call list from the first token; "auto": the model could
    write text first (the grammar's trigger); "formatted": the output is the envelope from its
    first character or a text.format reply (an any_of grammar with the marker:
    tools.ToolPlan.with_format; without it, the any_of is text.format's alone behind the gap:
    agents.ready_grammar)."""
    g = params.get("grammar")
    if not isinstance(g, dict) or not g:
        return None
    if g.get("kind") == "any_of":
        return "formatted" if _calls_in(g) else None
    return "auto" if g.get("trigger") else "forced"


def _calls_in(g: dict[str, Any]) -> bool:
    """A stored any_of grammar has the call envelope's alternative (its prefix ends with the marker)."""
    alts = json.loads(g.get("source") or "[]")
    return any(isinstance(a, dict) and str(a.get("prefix", "")).endswith(MARKER) for a in alts)


def _parsed(t: Task) -> tuple[str, list[tuple[str, str]] | None]:
    """(content, calls) of t's output, as its tool mode reads it (tools.parse_calls)."""
    return parse_calls(t.out.text, tool_mode(t) or "auto")


def _hex(t: Task) -> str:
    return t.id.split("_", 1)[1]


def calls(t: Task) -> list[dict[str, Any]]:
    """The function_call items of t's output (none while it runs, or when it holds no complete
    call list: no marker, or cut by max_output_tokens)."""
    if tool_mode(t) is None or t.running:
        return []
    found = _parsed(t)[1] or []
    return [
        {"type": "function_call", "id": f"fc_{_hex(t)}{i:02x}", "call_id": f"call_{_hex(t)}{i:02x}",
         "name": name, "arguments": args, "status": "completed"}
        for i, (name, args) in enumerate(found)
    ]  # fmt: skip


def known_calls(t: Task, made: list[dict[str, Any]]) -> dict[str, str]:
    """{call id: function name} of every call made up to t's end: those its input knew (the
    previous responses', its input's function_call items) and its output's (`made`: calls(t))."""
    known = dict(meta(t).get("calls") or {})
    known.update((c["call_id"], c["name"]) for c in made)
    return known


def output(t: Task, tokenizer: TokenBytes | None = None, state: str | None = None) -> list[dict[str, Any]]:
    """The response's output items: the message (its text; left out when the output is calls
    only), then the function calls; none while it is queued (as its create answered). tokenizer:
    for the message's logprobs (when asked); state: its status(t), read once by the caller (the
    engine may admit the run between two reads)."""
    if (state or status(t)) == "queued":
        return []
    made, cut = calls(t), compacted(t)
    if not made:
        return [*cut, message(t, tokenizer=tokenizer)]
    content = _parsed(t)[0]
    text = content if continues(t) else content.lstrip()
    return cut + ([message(t, text, tokenizer=tokenizer)] if text.strip() else []) + made


def compacted(t: Task) -> list[dict[str, Any]]:
    """[the compaction its create made first (context_management: autocompact.py)], or []."""
    cid = meta(t).get("compacted")
    return [compaction_item(cid)] if cid else []


def _item_status(t: Task) -> str:
    """The message item's status: OpenAI's item has no "cancelled" or "failed"; an answer cut
    short (max_output_tokens, stopped, failed) is "incomplete"."""
    state = status(t)
    if state == "queued":
        return "in_progress"
    return state if state in ("in_progress", "completed") else "incomplete"


def message(
    t: Task, text: str | None = None, status: str | None = None, *, tokenizer: TokenBytes | None = None
) -> dict[str, Any]:
    """t's message item; `text`: its text (default: the output's, less the hidden lead); with
    `tokenizer`, the text's logprobs when the request asked for them (logprobs.py)."""
    keep = continues(t)
    if text is None:
        text = t.out.text if keep else t.out.text.lstrip()
    lps = of_message(t, text, keep, tokenizer)
    return {
        "type": "message",
        "id": "msg_" + t.id.split("_", 1)[1],
        "status": status or _item_status(t),
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": lps}],
    }


def _error(t: Task) -> dict[str, str]:
    """A failed response's `error`. A run the server's stop (a shutdown, restart or crash) cut
    short is "failed" with code server_error, in OpenAI's schema (incomplete_details.reason has only
    max_output_tokens and content_filter): the message says what happened and how to go on."""
    if t.finish_reason != "interrupted":
        return {"code": "server_error", "message": t.out.error or "generation failed"}
    what = "the server stopped (shut down, restarted or crashed) while this response was being generated"
    if t.kind != TASK:  # store: false: nothing of it outlives the server
        return {"code": "server_error", "message": f"{what}; it was not stored (store: false): send the request again"}
    return {
        "code": "server_error",
        "message": f"{what}; its output up to then is kept. Resume it where it stopped with POST "
        f"/v1/tasks/{t.id}/continue (GET /v1/responses/{response_id(t)} then shows the whole answer), "
        "or go on from it with previous_response_id.",
    }


def usage(t: Task) -> dict[str, Any]:
    out = t.completion_tokens
    held = 1 if t.params.get("max_tokens") == 0 else 0  # a prefill-only run feeds all but the last: not cached
    return {
        "input_tokens": t.out_start,
        "output_tokens": out,
        "total_tokens": t.out_start + out,
        "input_tokens_details": {
            "cached_tokens": max(0, t.out_start - t.prompt_tokens - held),
            "cache_write_tokens": 0,
        },
        "output_tokens_details": {"reasoning_tokens": 0},
    }


def response(t: Task, model: str, *, with_output: bool = True, tokenizer: TokenBytes | None = None) -> dict[str, Any]:
    """The response object; `tokenizer`: for the message's logprobs (when asked)."""
    p, m = t.params, meta(t)
    fmt = m.get("format") or p.get("response_format") or {"type": "text"}  # (meta: with tools, agent.task_params)
    if fmt.get("type") == "json_schema":
        inner = fmt.get("json_schema", {})
        described = {"description": inner["description"]} if inner.get("description") is not None else {}
        fmt = {
            "type": "json_schema",
            "name": inner.get("name"),
            **described,
            "schema": inner.get("schema"),
            "strict": inner.get("strict", True),
        }  # fmt: skip  (the output follows the schema either way)
    state = status(t)
    parent, conv = t.parent_id, m.get("conversation")  # (a fork of a head, of a compaction: none; "previous": as sent)
    forked = parent if parent and parent[:4] in ("TASK", "TMP_") and not conv and not m.get("compaction") else None
    before = m["previous"] if "previous" in m else "resp_" + forked.split("_", 1)[1] if forked else None
    return {
        "id": response_id(t),
        "object": "response",
        "created_at": int(t.created_at),
        "status": state,
        "model": model,
        "output": output(t, tokenizer, state) if with_output else [],
        "previous_response_id": before,
        "conversation": {"id": conv} if conv else None,
        "instructions": m.get("instructions"),
        "max_output_tokens": p.get("max_tokens"),
        "temperature": p.get("temperature"),
        "top_p": p.get("top_p"),
        "top_logprobs": m.get("top_logprobs"),
        "text": {"format": fmt, "verbosity": m.get("verbosity") or "medium"},
        "tools": m.get("tools") or [],
        "tool_choice": m.get("tool_choice") or "auto",
        "parallel_tool_calls": m.get("parallel_tool_calls", False),
        "max_tool_calls": m.get("max_tool_calls"),
        "store": t.kind != "tmp",
        "background": bool(m.get("background")),
        "metadata": m.get("metadata") or {},
        "error": _error(t) if state == "failed" else None,
        "incomplete_details": {"reason": "max_output_tokens"} if state == "incomplete" else None,
        "usage": None if t.running else usage(t),
    }


def head(t: Task, model: str, *, waiting: bool = False) -> dict[str, Any]:
    """The response as its stream's first events show it: in progress, no output yet (a replay of
    a finished response starts as its original stream did). waiting: as a background create
    answers, queued while its run waits for a slot."""
    return {
        **response(t, model, with_output=False),
        "status": "queued" if waiting and status(t) == "queued" else "in_progress",
        "error": None,
        "incomplete_details": None,
        "usage": None,
    }

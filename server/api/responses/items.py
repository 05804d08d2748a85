"""A response's input items: rendered into chat turns the way chat renders its messages
(server.api.openai.tools: an assistant message and the function calls after it are one
assistant turn with the calls in the envelope, a function_call_output a Tool turn naming its
call's function), kept with the task for the input items listing (each with an id), and the
calls the conversation knows (a function_call_output must answer one; every call of the previous
response and of the input must be answered).

The listing (`GET /v1/responses/{id}/input_items`) pages through the stored items as OpenAI's
cursor lists do: `limit`, `order`, `after` (an item id of the list)."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from server.api.errors import ApiError
from server.api.openai.tools import ToolError, arguments, envelope, tool_text
from server.api.responses.schemas import Compaction, FunctionCall, FunctionCallOutput, InputMessage

Item = InputMessage | FunctionCall | FunctionCallOutput

MAX_KNOWN_CALLS = 256
"""Calls a response keeps for the next ones to answer (the latest; an older call's id is
unknown to a function_call_output): bounds what a long tool loop stores per response."""
_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}


@dataclass
class Rendered:
    """The turns of an input, its items as stored (with ids), and the calls known after it."""

    turns: list[tuple[str, str]] = field(default_factory=list)
    items: list[dict[str, Any]] = field(default_factory=list)
    calls: dict[str, str] = field(default_factory=dict)
    """{call id: function name}: the previous responses' calls, then this input's."""

    def kept_calls(self) -> dict[str, str]:
        """The latest MAX_KNOWN_CALLS of `calls` (what the task stores)."""
        return dict(list(self.calls.items())[-MAX_KNOWN_CALLS:])


def compaction_item(cid: str) -> dict[str, Any]:
    """The compaction item naming compaction `cid` (server.api.responses.compaction)."""
    return {"type": "compaction", "id": cid, "encrypted_content": cid}


def last_compaction(inp: str | Sequence[Item | Compaction] | None) -> tuple[int, Compaction] | None:
    """The input's last compaction item, and its place (None: it has none)."""
    if isinstance(inp, str) or not inp:
        return None
    return next(((i, it) for i, it in reversed(list(enumerate(inp))) if isinstance(it, Compaction)), None)


def after_compaction(inp: str | Sequence[Item | Compaction] | None) -> str | list[Item]:
    """The input's items after its last compaction item (the whole input without one): those
    before it are in the compaction's state (server.api.responses.compaction)."""
    if isinstance(inp, str):
        return inp
    last = last_compaction(inp)
    after = list(inp or [])[0 if last is None else last[0] + 1 :]
    return [it for it in after if not isinstance(it, Compaction)]  # (none is: for the type)


def render_input(inp: str | Sequence[Item], known: dict[str, str], owed: Sequence[str] = ()) -> Rendered:
    """The input's turns and items; a 400 naming the item's field for one that cannot be rendered
    (arguments that are not JSON, a call_id no earlier call has, an id given twice).
    `known`: the calls of the previous responses (none without previous_response_id); one of them
    sent back as a function_call item is listed but not written into the prompt again.
    `owed`: the call ids of the previous response's output. Each of them, and each function_call
    item of the input, must be answered by a function_call_output of the input, as OpenAI requires
    (else a 400 naming `input`, in OpenAI's words)."""
    if isinstance(inp, str):
        item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": inp}]}
        out = Rendered([("user", inp)], [stored_item(item, None)], dict(known))
    else:
        try:
            out = _render(inp, known)
        except ToolError as exc:
            raise ApiError(400, str(exc), param=exc.param, code="invalid_request") from None
    _check_answered(() if isinstance(inp, str) else inp, owed)
    return out


def _check_answered(inp: Sequence[Item], owed: Sequence[str]) -> None:
    """A 400 for the first call (of `owed`, then of the input's function_call items) that no
    function_call_output of the input answers."""
    answered = {it.call_id for it in inp if isinstance(it, FunctionCallOutput)}
    asked = [*owed, *(it.call_id for it in inp if isinstance(it, FunctionCall))]
    missing = next((c for c in asked if c not in answered), None)
    if missing is not None:
        raise ApiError(400, f"No tool output found for function call {missing}.", param="input",
                       code="invalid_request")  # fmt: skip


def _render(inp: Sequence[Item], known: dict[str, str]) -> Rendered:
    out = Rendered(calls=dict(known))
    turn = _AssistantTurn(out.turns)
    ids: set[str] = set()
    for i, it in enumerate(inp):
        if it.id is not None and it.id in ids:
            raise ToolError(f"input[{i}].id", f"the id {it.id!r} is given to two input items")
        stored = stored_item(it.model_dump(exclude_none=True), it.id)
        ids.add(stored["id"])
        out.items.append(stored)
        if isinstance(it, FunctionCall):  # joins the assistant turn before it (one turn, several calls)
            args = arguments(it.arguments, f"input[{i}].arguments")
            if it.call_id not in known:  # a call of the chain sent back: its state holds it already
                turn.calls.append({"name": it.name, "arguments": args})
            out.calls[it.call_id] = it.name
            continue
        turn.flush()
        if isinstance(it, FunctionCallOutput):
            out.turns.append(("tool", tool_text(_answered(it, i, out.calls), it.text())))
        elif it.role == "assistant":
            turn.content = it.text()  # (its calls may follow)
        else:
            out.turns.append((it.role, it.text()))
    turn.flush()
    return out


def _answered(it: FunctionCallOutput, i: int, calls: dict[str, str]) -> str:
    """The function name of the call a function_call_output answers."""
    if it.call_id not in calls:
        raise ToolError(
            f"input[{i}].call_id",
            f"call_id {it.call_id!r} is not the id of an earlier function call (of this input, or of "
            "the responses before it through previous_response_id)",
        )
    return calls[it.call_id]


@dataclass
class _AssistantTurn:
    """The assistant turn being built: a message's text, then the calls that follow it."""

    turns: list[tuple[str, str]]
    content: str | None = None
    calls: list[dict[str, Any]] = field(default_factory=list)

    def flush(self) -> None:
        if self.content is None and not self.calls:
            return
        text = envelope(self.content or "", self.calls) if self.calls else self.content or ""
        self.turns.append(("assistant", text))
        self.content, self.calls = None, []


def stored_item(item: dict[str, Any], given_id: str | None) -> dict[str, Any]:
    """An input item as the listing shows it: its id (given, else a new one), status completed,
    a message's text as a list of parts (input_text; an assistant's output_text)."""
    kind = item.get("type", "message")
    out = {"type": kind, "id": given_id or f"{_ID_PREFIX[kind]}_{uuid.uuid4().hex}", **item, "status": "completed"}
    if kind == "message" and isinstance(out.get("content"), str):
        part = "output_text" if out["role"] == "assistant" else "input_text"
        out["content"] = [{"type": part, "text": out["content"]}]
    if kind == "message":
        out["content"] = [_part(p) for p in out["content"]]
    return out


def _part(p: dict[str, Any]) -> dict[str, Any]:
    """An output_text part as OpenAI shows one (annotations); input_text: type and text."""
    if p.get("type") == "output_text":
        return {"type": "output_text", "text": p["text"], "annotations": p.get("annotations") or []}
    return {"type": "input_text", "text": p["text"]}


# --- the listing ----------------------------------------------------------------------------------


def page(
    items: Sequence[dict[str, Any]], limit: int, order: Literal["asc", "desc"], after: str | None
) -> dict[str, Any]:
    """One page of the listing: `limit` items after the item `after` (None: from the start) in
    `order` (desc: the last input item first); 400 naming `after` when no item has that id."""
    ordered = list(items) if order == "asc" else list(reversed(items))
    start = 0
    if after is not None:
        at = next((i for i, it in enumerate(ordered) if it.get("id") == after), None)
        if at is None:
            raise ApiError(400, f"after {after!r} is not the id of an item of this list", param="after",
                           code="invalid_request")  # fmt: skip
        start = at + 1
    data = ordered[start : start + limit]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": start + limit < len(ordered),
    }

"""A chat request's messages -> (role, text) turns for the RWKV chat prompt (chat_format):
text parts joined, an assistant message's tool calls written in the call envelope, a tool
message as a Tool turn naming the call it answers (its tool_call_id must be an earlier call's;
as on OpenAI, the tool messages right after an assistant message with tool_calls answer every
one of its calls), and with tools the system turn that describes them (first: it is part of the
cached prefix)."""

from __future__ import annotations

from collections.abc import Sequence

from server.api.errors import ApiError
from server.api.openai.schemas import ChatMessage
from server.api.openai.tools import ToolError, ToolPlan, assistant_text, tool_text


def turns(messages: Sequence[ChatMessage], tool_plan: ToolPlan | None) -> list[tuple[str, str]]:
    """The turns; a 400 naming the message's field for anything that cannot be rendered.
    `tool_plan`: the tools the prompt describes (Agent.described), None: none."""
    try:
        return _turns(messages, tool_plan)
    except ToolError as exc:
        raise ApiError(400, str(exc), param=exc.param, code="invalid_request") from None


def _turns(messages: Sequence[ChatMessage], tool_plan: ToolPlan | None) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = [("system", tool_plan.system_text())] if tool_plan is not None else []
    calls: dict[str, str] = {}  # id -> function name, of the calls made so far
    owed: list[str] = []  # the ids of the last assistant message's calls no tool message answered yet
    for i, m in enumerate(messages):
        if owed and m.role != "tool":
            raise _unanswered(f"messages[{i}].role", owed)
        try:
            text = m.text()
        except ValueError as exc:
            raise ToolError(f"messages[{i}].content", str(exc)) from None
        if m.tool_calls:
            if m.role != "assistant":
                raise ToolError(f"messages[{i}].tool_calls", "only assistant messages carry tool_calls")
            text, ids = assistant_text(text, m.tool_calls, i)
            calls.update(ids)
            owed = list(ids)
        if m.role == "tool":
            text = _tool_turn(m, i, calls, text)
            owed = [c for c in owed if c != m.tool_call_id]
        elif m.tool_call_id is not None:
            raise ToolError(f"messages[{i}].tool_call_id", "only tool messages carry a tool_call_id")
        out.append((m.role, text))
    if owed:
        raise _unanswered("messages", owed)
    return out


def _unanswered(param: str, ids: list[str]) -> ToolError:
    """OpenAI's refusal of calls that the tool messages after their assistant message leave
    unanswered (param: the message that came instead of a tool message; `messages` at the end)."""
    return ToolError(
        param,
        "An assistant message with 'tool_calls' must be followed by tool messages responding to each "
        f"'tool_call_id'. The following tool_call_ids did not have response messages: {', '.join(ids)}",
    )


def _tool_turn(m: ChatMessage, i: int, calls: dict[str, str], text: str) -> str:
    """The text of tool message i: its result, naming the earlier call it answers."""
    param = f"messages[{i}].tool_call_id"
    if m.tool_call_id is None:  # worded as the schema words a missing field
        raise ToolError(param, f"'{param}' is required: the id of the call a tool message answers")
    if m.tool_call_id not in calls:
        raise ToolError(
            param, f"tool_call_id {m.tool_call_id!r} is not the id of a call in an earlier assistant message"
        )
    return tool_text(calls[m.tool_call_id], text)

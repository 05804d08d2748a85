"""Tool calls on the RWKV chat format (docs/agents.md, "Tool calls"): the request's tools and
tool_choice checked into a ToolPlan, the tools described in a system turn, the call envelope
the constrained decoder enforces, the model's output split into content and calls, and earlier
calls and tool results rendered back into the prompt.

The envelope: MARKER followed by a JSON list of calls, written the way the grammar writes JSON
(separators ", " and ": ", no other whitespace):

    <tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]

`auto`: free text until the marker (the grammar's trigger), then the list; `required` or a named
function: the prompt ends with the marker and the grammar covers the whole output (the list).
parallel_tool_calls false, or a named function: the list holds one call; otherwise
1..MAX_PARALLEL (a list max_tokens cuts is no call: finish_reason "length", the text as content).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from server.engine.types import GrammarSpec
from server.tasks.params import MAX_JSON_DEPTH, json_depth

MARKER = "<tool_call>"
MAX_TOOLS = 128
MAX_PARALLEL = 8
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_EMPTY_PARAMS: dict[str, Any] = {"type": "object", "properties": {}}


class ToolError(ValueError):
    """A bad tools / tool_choice / tool message: (param, message) for a 400."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]


@dataclass(frozen=True)
class ToolPlan:
    """What a request with tools does: which tools may be called, and whether one must be."""

    tools: tuple[Tool, ...]
    """The tools the output may call (a named tool_choice: that one)."""
    forced: bool
    """required or a named function: the output is the call list from its first token."""
    parallel: bool
    described: tuple[Tool, ...] = ()
    """The tools the system turn describes: all of the request's (default: `tools`), so a named
    tool_choice neither hides the others from the model nor changes the cached prefix."""

    def grammar(self) -> GrammarSpec:
        schema = {
            "type": "array",
            "minItems": 1,
            "maxItems": MAX_PARALLEL if self.parallel else 1,
            "items": {"anyOf": [_call_schema(t) for t in self.tools]},
        }
        return GrammarSpec.json_schema(json.dumps(schema), trigger="" if self.forced else MARKER)

    def system_text(self) -> str:
        """The system turn describing the tools (single newlines: one turn)."""
        lines = [
            f"You can call tools. To call them, write {MARKER} followed by a JSON list of calls, "
            'each {"name": <tool name>, "arguments": <an object valid for its parameters>}. '
            "Each result comes back in a Tool turn. The tools:"
        ]
        lines += [
            _dumps({"name": t.name, "description": t.description, "parameters": t.parameters})
            for t in self.described or self.tools
        ]
        return "\n".join(lines)

    def prompt_suffix(self) -> str:
        """Appended after the prompt's final "Assistant:" (a forced call starts at once)."""
        return f" {MARKER}" if self.forced else ""


def _call_schema(t: Tool) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": t.name}, "arguments": t.parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _dumps(v: Any) -> str:
    return json.dumps(v, ensure_ascii=False, separators=(", ", ": "))


def shown(tools: Sequence[Any] | None, choice: Any) -> ToolPlan | None:
    """The tools a request's prompt describes: with tool_choice "none" too (no call is possible,
    but the model sees the tools its history may call, and the prompt keeps the prefix of the
    turns before it: as vLLM renders tools whatever the choice). None without tools. Call after
    plan() (which checked them)."""
    if not tools or choice != "none":
        return None
    return ToolPlan(tuple(_tool(i, raw) for i, raw in enumerate(tools)), False, False)


def plan(tools: Sequence[Any] | None, choice: Any, parallel: bool | None) -> ToolPlan | None:
    """The request's ToolPlan (None: no tool can be called); ToolError for bad input."""
    if not tools:
        if choice not in (None, "none", "auto"):
            raise ToolError("tool_choice", f"tool_choice {choice!r} needs tools")
        return None
    if len(tools) > MAX_TOOLS:
        raise ToolError("tools", f"at most {MAX_TOOLS} tools per request ({len(tools)} given)")
    parsed = [_tool(i, raw) for i, raw in enumerate(tools)]
    names = [t.name for t in parsed]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise ToolError("tools", f"two tools are named {dup!r}")
    if choice in (None, "auto"):
        return ToolPlan(tuple(parsed), False, parallel is not False)
    if choice == "none":
        return None
    if choice == "required":
        return ToolPlan(tuple(parsed), True, parallel is not False)
    name = _named(choice)
    if name not in names:
        raise ToolError("tool_choice", f"tool_choice names {name!r}, which is not one of the tools")
    return ToolPlan(tuple(t for t in parsed if t.name == name), True, False, tuple(parsed))  # one call of it


def _named(choice: Any) -> str:
    fn = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ToolError(
            "tool_choice", 'tool_choice: "auto", "none", "required" or {"type": "function", "function": {"name": ...}}'
        )
    return fn["name"]


def _tool(i: int, raw: Any) -> Tool:
    fn = raw.get("function") if isinstance(raw, dict) and raw.get("type") == "function" else None
    if not isinstance(fn, dict):
        raise ToolError(f"tools[{i}]", 'a tool is {"type": "function", "function": {"name", "parameters"}}')
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise ToolError(f"tools[{i}].function.name", "a tool name is 1-64 letters, digits, '_' or '-'")
    params = fn.get("parameters", _EMPTY_PARAMS)
    if not isinstance(params, dict):
        raise ToolError(f"tools[{i}].function.parameters", "parameters is a JSON schema object")
    desc = fn.get("description") or ""
    if not isinstance(desc, str):
        raise ToolError(f"tools[{i}].function.description", "description is text")
    return Tool(name, desc, params)


# --- the model's output ---------------------------------------------------------------------------


def split(text: str, forced: bool) -> tuple[str, list[dict[str, Any]] | None]:
    """(content, calls): the text before the envelope, and the calls in it (None when the output
    holds no complete call list: no marker, or cut by max_tokens)."""
    if forced:
        head, body = "", text
    else:
        at = text.find(MARKER)
        if at < 0:
            return text, None
        head, body = text[:at], text[at + len(MARKER) :]
    try:
        calls = json.loads(body)
    except (ValueError, RecursionError):  # (the grammar bounds the list's shape, not its depth)
        return text, None
    if not isinstance(calls, list) or not calls:
        return text, None
    return head, [_openai_call(c) for c in calls]


def _openai_call(c: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)},
    }


def held_back(text: str) -> int:
    """Characters at the end of `text` that may be the start of the marker (not streamed yet)."""
    for n in range(min(len(MARKER) - 1, len(text)), 0, -1):
        if MARKER.startswith(text[-n:]):
            return n
    return 0


# --- the history ----------------------------------------------------------------------------------


def assistant_text(content: str, calls: Sequence[Any], index: int) -> tuple[str, dict[str, str]]:
    """An assistant message with tool_calls as the model would have written it, and its calls'
    {id: name}; ToolError for a call that is not {"id", "type": "function", "function":
    {"name", "arguments": JSON text}}."""
    out, ids = [], {}
    for j, c in enumerate(calls):
        where = f"messages[{index}].tool_calls[{j}]"
        fn = c.get("function") if isinstance(c, dict) and c.get("type", "function") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(c.get("id"), str):
            raise ToolError(where, 'a tool call is {"id", "type": "function", "function": {"name", "arguments"}}')
        out.append({"name": fn["name"], "arguments": _arguments(fn.get("arguments"), where)})
        ids[c["id"]] = fn["name"]
    content = content.rstrip()  # the answer's content keeps the space the model wrote before the marker
    text = f"{content} {MARKER}{_dumps(out)}" if content else f"{MARKER}{_dumps(out)}"
    return text, ids


def _arguments(raw: Any, where: str) -> Any:
    """A history call's arguments, parsed; ToolError unless they are JSON text nesting at most
    MAX_JSON_DEPTH levels (deeper ones end the parser, or _dumps after it, in a RecursionError:
    a 500, not a 400)."""
    bad = ToolError(f"{where}.function.arguments", f"arguments is JSON text nesting at most {MAX_JSON_DEPTH} levels")
    try:
        args = json.loads(raw or "{}")
    except (TypeError, ValueError, RecursionError):
        raise bad from None
    if json_depth(args) > MAX_JSON_DEPTH:
        raise bad
    return args


def resent_text(text: str, forced: bool) -> str:
    """The assistant turn's text (as _turns renders it) of the message a reply `text` was
    answered as, when a client sends that message back: its content, and its calls in the
    envelope."""
    content, calls = split(text, forced)
    if calls is None:
        return text.lstrip()
    return assistant_text(content.lstrip() if content.strip() else "", calls, 0)[0]


def tool_text(name: str, content: str) -> str:
    """A tool message's turn text (after "Tool: ")."""
    return _dumps({"name": name, "content": content})

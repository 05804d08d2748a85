"""Tool calls on the RWKV chat format (docs/agents.md, "Tool calls"): the request's tools and
tool_choice checked into a ToolPlan, the tools described in a system turn, the call envelope
the constrained decoder enforces, the model's output split into content and calls, and earlier
calls and tool results rendered back into the prompt.

The envelope: MARKER followed by a JSON list of calls, written the way the grammar writes JSON
(separators ", " and ": ", no other whitespace):

    <tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]

`auto`: free text until the marker (the grammar's trigger), then the list; `required` or a named
function: the prompt ends with the marker and the grammar covers the whole output (the list).
`auto` with a JSON format (response_format / text.format): no free text, the output is either the
envelope from its first character or the formatted reply (one any_of grammar: ToolPlan.grammar;
a chat reply has the gap after "Assistant:" before either: agents.chat_ready).
parallel_tool_calls false, or a named function: the list holds one call; otherwise
1..MAX_PARALLEL (a list max_tokens cuts is no call: finish_reason "length", the text as content).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from server.engine.schema_checks import DATA_KEYWORDS
from server.engine.types import GrammarSpec
from server.tasks.response_format import MAX_JSON_DEPTH, MAX_SCHEMA_DEPTH, json_depth, schema_depth

MARKER = "<tool_call>"
MAX_TOOLS = 128
MAX_PARALLEL = 8
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_EMPTY_PARAMS: dict[str, Any] = {"type": "object", "properties": {}}


class ToolError(ValueError):
    """A bad tools / tool_choice / tool message: (param, message, code) for a 400."""

    def __init__(self, param: str, message: str, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.param, self.code = param, code


_CHAT_TOOL_KEYS = frozenset({"type", "function"})
_FUNCTION_KEYS = frozenset({"name", "description", "parameters", "strict"})
"""OpenAI's function definition: chat's `function` object, and the Responses API's tool beside its
"type". Any other key is refused naming it (the routes' unknown-field policy; OpenAI refuses them
too), never ignored."""
_FLAT_OPTIONS: dict[str, tuple[Callable[[Any], bool], str, str]] = {
    "output_schema": (lambda v: v is None or isinstance(v, dict), "output_schema is a JSON schema object",
                      "invalid_request"),  # (ignored: it describes the result the client sends back)
    "defer_loading": (lambda v: v is None or v is False, "defer_loading (tool search) is not supported: "
                      "every tool is loaded", "unsupported_field"),
    "async": (lambda v: v is None or v is False, "async tools are not supported", "unsupported_field"),
    "allowed_callers": (lambda v: v is None or (isinstance(v, list) and "direct" in v),
                        "allowed_callers without \"direct\" is not supported: the model calls tools directly",
                        "unsupported_field"),
}  # fmt: skip
"""The Responses API's further tool options (the SDK's FunctionToolParam): key -> (whether its
value is one this server honours, why not, the error code)."""
_FLAT_KEYS = frozenset({"type", *_FUNCTION_KEYS, *_FLAT_OPTIONS})
"""The keys of a Responses API tool."""


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]


Mode = Literal["forced", "auto", "formatted"]
"""How an answer with tools reads. "forced": the output is the call list from its first token
(the prompt ended with the marker); "auto": text, then maybe the marker and the list;
"formatted": the envelope from its first character or a formatted reply (a marker inside the
reply's JSON is text), either after leading whitespace (a chat reply's gap: agents.chat_ready)."""


@dataclass(frozen=True)
class ToolPlan:
    """What a request with tools does: which tools may be called, and whether one must be."""

    tools: tuple[Tool, ...]
    """The tools the output may call (a named tool_choice: that one; allowed_tools: those listed)."""
    forced: bool
    """required, a named function or allowed_tools' required: the output is the call list from
    its first token."""
    parallel: bool
    described: tuple[Tool, ...] = ()
    """The tools the system turn describes: all of the request's (default: `tools`), so a named
    tool_choice neither hides the others from the model nor changes the cached prefix."""
    reply: GrammarSpec | None = None
    """auto with a JSON format: the format's grammar. The output is then either the call envelope
    from its first character or the formatted reply, no free text (with_format)."""

    @property
    def mode(self) -> Mode:
        """How its answer reads: forced, formatted (auto with a JSON format) or auto."""
        return "forced" if self.forced else "formatted" if self.reply is not None else "auto"

    def with_format(self, fmt: GrammarSpec | None) -> ToolPlan:
        """This plan for a request whose answer has the format `fmt` (response_format,
        text.format; None: text). auto: the answer is a call list or the formatted reply; forced
        (required, a named function): the call list, unchanged (the format is a later turn's)."""
        return self if fmt is None or self.forced else replace(self, reply=fmt)

    def grammar(self) -> GrammarSpec:
        """The answer's grammar: the call list (forced), free text then the list (auto: the
        marker is the trigger), or the list behind the marker or the format's language (auto
        with a format: GrammarSpec.any_of)."""
        schema = {
            "type": "array",
            "minItems": 1,
            "maxItems": MAX_PARALLEL if self.parallel else 1,
            "items": {"anyOf": [_call_schema(t, f"/items/anyOf/{i}") for i, t in enumerate(self.tools)]},
        }
        if self.reply is not None:
            return GrammarSpec.any_of([(MARKER, GrammarSpec.json_schema(json.dumps(schema))), ("", self.reply)])
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


def _call_schema(t: Tool, at: str) -> dict[str, Any]:
    """The schema of a call of `t`, which sits at JSON pointer `at` in the call list's schema:
    its arguments are an object valid for its parameters (whose own local $refs are rebased)."""
    args = _rebased(t.parameters, f"{at}/properties/arguments")
    return {
        "type": "object",
        "properties": {"name": {"const": t.name}, "arguments": {"type": "object", **args}},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _rebased(schema: Any, base: str) -> Any:
    """`schema` (a tool's parameters) with its local references ("#/...": pydantic puts every
    nested model under "$defs" and refers to it as "#/$defs/Name") pointing to the same places
    once it sits at JSON pointer `base` inside another schema: "#/$defs/A" -> "#<base>/$defs/A".
    Each tool keeps its own $defs where they are, so two tools may use the same names."""
    if isinstance(schema, list):
        return [_rebased(v, base) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for k, v in schema.items():
        if k == "$ref" and isinstance(v, str) and v.startswith("#"):
            out[k] = f"#{base}{v[1:]}"
        else:
            out[k] = v if k in DATA_KEYWORDS else _rebased(v, base)
    return out


def _dumps(v: Any) -> str:
    return json.dumps(v, ensure_ascii=False, separators=(", ", ": "))


def shown(tools: Sequence[Any] | None, choice: Any, *, flat: bool = False) -> ToolPlan | None:
    """The tools a request's prompt describes: with tool_choice "none" too (no call is possible,
    but the model sees the tools its history may call, and the prompt keeps the prefix of the
    turns before it: as vLLM renders tools whatever the choice). None without tools. Call after
    plan() (which checked them)."""
    if not tools or choice != "none":
        return None
    return ToolPlan(tuple(_tool(i, raw, flat) for i, raw in enumerate(tools)), False, False)


def plan(tools: Sequence[Any] | None, choice: Any, parallel: bool | None, *, flat: bool = False) -> ToolPlan | None:
    """The request's ToolPlan (None: no tool can be called); ToolError for bad input.
    flat: the Responses API's shapes (a tool {"type": "function", "name", "description",
    "parameters", "strict"}, a named choice {"type": "function", "name"}); else chat's (the
    function's fields under "function")."""
    if not tools:
        if choice not in (None, "none", "auto"):
            raise ToolError("tool_choice", f"tool_choice {choice!r} needs tools")
        return None
    if len(tools) > MAX_TOOLS:
        raise ToolError("tools", f"at most {MAX_TOOLS} tools per request ({len(tools)} given)")
    parsed = [_tool(i, raw, flat) for i, raw in enumerate(tools)]
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
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        return _allowed(choice, parsed, parallel, flat)
    name = _named(choice, flat)
    if name not in names:
        raise ToolError("tool_choice", f"tool_choice names {name!r}, which is not one of the tools")
    return ToolPlan(tuple(t for t in parsed if t.name == name), True, False, tuple(parsed))  # one call of it


def _allowed(choice: dict[str, Any], parsed: list[Tool], parallel: bool | None, flat: bool) -> ToolPlan:
    """tool_choice {"type": "allowed_tools", "mode", "tools"} (chat: under "allowed_tools"): the
    output may call the tools listed (auto), or must call one or more of them (required); the
    system turn describes every tool of the request, so the prompt (and the state a tool loop
    reuses) is the same whichever subset a turn allows, as OpenAI keeps its prompt cache."""
    where = "tool_choice" if flat else "tool_choice.allowed_tools"
    inner = choice if flat else choice.get("allowed_tools")
    outer = {"type", "mode", "tools"} if flat else {"type", "allowed_tools"}
    own = outer if flat else {"mode", "tools"}
    if not isinstance(inner, dict) or set(choice) - outer or set(inner) - own:
        keys = '"mode" and "tools"' if flat else '"allowed_tools": {"mode", "tools"}'
        raise ToolError("tool_choice", f'tool_choice of type "allowed_tools" has {keys}, nothing else')
    mode, listed = inner.get("mode"), inner.get("tools")
    if mode not in ("auto", "required"):
        raise ToolError(f"{where}.mode", f'{where}.mode: "auto" or "required", not {mode!r}')
    if not isinstance(listed, list) or not listed:
        raise ToolError(f"{where}.tools", f"{where}.tools: a list of one or more of the request's tools")
    known = {t.name for t in parsed}
    allowed = set()
    for i, raw in enumerate(listed):
        fn = _function(raw, flat)
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or name not in known:
            raise ToolError(f"{where}.tools[{i}]", f"{where}.tools[{i}] names no function of the request's tools "
                            f"({', '.join(sorted(known))}): {raw!r}")  # fmt: skip
        allowed.add(name)
    subset = tuple(t for t in parsed if t.name in allowed)
    return ToolPlan(subset, mode == "required", parallel is not False, tuple(parsed))


def _function(raw: Any, flat: bool) -> Any:
    """The function fields of a tool or named choice (None: not {"type": "function", ...})."""
    if not isinstance(raw, dict) or raw.get("type") != "function":
        return None
    return raw if flat else raw.get("function")


def _named(choice: Any, flat: bool) -> str:
    fn = _function(choice, flat)
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        shape = '{"type": "function", "name": ...}' if flat else '{"type": "function", "function": {"name": ...}}'
        raise ToolError("tool_choice", f'tool_choice: "auto", "none", "required" or {shape}')
    return fn["name"]


def _tool(i: int, raw: Any, flat: bool) -> Tool:
    fn, where = _function(raw, flat), f"tools[{i}]" if flat else f"tools[{i}].function"
    if not isinstance(fn, dict):
        shape = '"name", "parameters"' if flat else '"function": {"name", "parameters"}'
        raise ToolError(f"tools[{i}]", f'a tool is {{"type": "function", {shape}}}')
    if flat and "function" in fn:  # chat's shape on /v1/responses: named, not its missing "name"
        shape = '{"type": "function", "name", "description", "parameters"}'
        raise ToolError(
            f"tools[{i}].function",
            f"unknown field 'tools[{i}].function': a /v1/responses tool is {shape}, the function's fields at "
            'the tool\'s top level ({"type": "function", "function": {...}} is /v1/chat/completions\' shape)',
        )
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ToolError(f"{where}.name", "a tool name is 1-64 letters, digits, '_' or '-'")
    params = fn.get("parameters")
    if params is None:  # left out, or null: no parameters
        params = _EMPTY_PARAMS
    if not isinstance(params, dict):
        raise ToolError(f"{where}.parameters", "parameters is a JSON schema object")
    if params.get("type", "object") != "object":
        raise ToolError(
            f"{where}.parameters", 'parameters is an object schema ("type": "object"): arguments are an object'
        )
    if json_depth(params) > MAX_JSON_DEPTH or schema_depth(params) > MAX_SCHEMA_DEPTH:
        # (as response_format's schema: the grammar's compile time grows fast with the depth)
        raise ToolError(
            f"{where}.parameters",
            f"parameters nests deeper than {MAX_SCHEMA_DEPTH} schema levels or {MAX_JSON_DEPTH} JSON levels",
        )
    desc = fn.get("description") or ""
    if not isinstance(desc, str):
        raise ToolError(f"{where}.description", "description is text")
    if not isinstance(fn.get("strict", True), (bool, type(None))):
        raise ToolError(f"{where}.strict", "strict is true or false")
    _check_keys(i, raw, fn, flat)
    return Tool(name, desc, params)


def _check_keys(i: int, raw: dict[str, Any], fn: dict[str, Any], flat: bool) -> None:
    """ToolError naming the first key of tool i outside OpenAI's shape (chat: {"type",
    "function": {...}}; flat: the function's keys beside "type", and _FLAT_OPTIONS)."""
    if flat:
        _check_options(i, fn)
        unknown = [f"tools[{i}].{k}" for k in fn if k not in _FLAT_KEYS]
    else:
        unknown = [f"tools[{i}].{k}" for k in raw if k not in _CHAT_TOOL_KEYS]
        unknown += [f"tools[{i}].function.{k}" for k in fn if k not in _FUNCTION_KEYS]
    if unknown:
        raise ToolError(unknown[0], f"unknown field {unknown[0]!r}")


def _check_options(i: int, fn: dict[str, Any]) -> None:
    """ToolError for a Responses tool option (_FLAT_OPTIONS) whose value this server cannot honour."""
    for key, (accepts, why, code) in _FLAT_OPTIONS.items():
        if key in fn and not accepts(fn[key]):
            raise ToolError(f"tools[{i}].{key}", why, code)


# --- the model's output ---------------------------------------------------------------------------


def split(text: str, mode: Mode) -> tuple[str, list[dict[str, Any]] | None]:
    """(content, calls): the text before the envelope, and the calls in it as chat's tool_calls
    (None when the output holds no complete call list: no marker, or cut by max_tokens), as an
    answer of this `mode` reads."""
    head, calls = parse_calls(text, mode)
    return head, None if calls is None else [_openai_call(name, args) for name, args in calls]


def parse_calls(text: str, mode: Mode) -> tuple[str, list[tuple[str, str]] | None]:
    """(content, [(name, arguments as JSON text)]): split's parts, without ids (each API names
    its calls its own way)."""
    if mode == "forced":
        head, body = "", text
    elif mode == "formatted":
        lead = _lead(text)
        if not text.startswith(MARKER, lead):
            return text, None
        head, body = "", text[lead + len(MARKER) :]
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
    return head, _raw_arguments(body, calls)


def _raw_arguments(body: str, calls: list[Any]) -> list[tuple[str, str]]:
    """Each call's (name, arguments) with the arguments' JSON text as the model wrote it: decoded
    and encoded again, a number past a double's range came back as Infinity (not JSON), long
    numbers lost digits and an escaped half of a surrogate pair became a string no JSON encoder
    writes. The grammar writes each call as `{"name": N, "arguments": V}` (its separators); a
    call found otherwise is encoded from its parsed value, as ASCII where it holds a lone
    surrogate."""
    out, pos, decoder = [], 0, json.JSONDecoder()
    for c in calls:
        prefix = '{"name": ' + json.dumps(c["name"], ensure_ascii=False) + ', "arguments": '
        at = body.find(prefix, pos)
        try:
            if at < 0:
                raise ValueError(prefix)
            start = at + len(prefix)
            end = decoder.raw_decode(body, start)[1]
            out.append((c["name"], body[start:end]))
            pos = end
        except (ValueError, RecursionError):
            text = json.dumps(c["arguments"], ensure_ascii=False)
            out.append((c["name"], text if _encodable(text) else json.dumps(c["arguments"])))
    return out


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def _openai_call(name: str, arguments: str) -> dict[str, Any]:
    fn = {"name": name, "arguments": arguments}
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": fn}


def _lead(text: str) -> int:
    """Characters of leading whitespace in `text`."""
    return len(text) - len(text.lstrip())


def held_back(text: str) -> int:
    """Characters at the end of `text` that may be the start of the marker (not streamed yet)."""
    for n in range(min(len(MARKER) - 1, len(text)), 0, -1):
        if MARKER.startswith(text[-n:]):
            return n
    return 0


def content_end(text: str, mode: Mode) -> int:
    """How much of `text` (the output so far) is content for sure, to stream now: none of a
    forced call; with a format all of a reply, none of an output that is or may become the
    envelope; else (auto) the text before the marker or a possible start of it at the end."""
    if mode == "forced":
        return 0
    if mode == "formatted":
        lead = _lead(text)
        return 0 if MARKER.startswith(text[lead : lead + len(MARKER)]) else len(text)
    at = text.find(MARKER)
    return at if at >= 0 else len(text) - held_back(text)


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
        out.append({"name": fn["name"], "arguments": arguments(fn.get("arguments"), f"{where}.function.arguments")})
        if c["id"] in ids:  # (its tool message could not say which call it answers)
            raise ToolError(f"{where}.id", f"two calls of this message have the id {c['id']!r}")
        ids[c["id"]] = fn["name"]
    return envelope(content, out), ids


def envelope(content: str, calls: Sequence[dict[str, Any]]) -> str:
    """An assistant turn with calls ({"name", "arguments": parsed}) as the model writes it: its
    content, one space, the marker and the list."""
    content = content.rstrip()  # the answer's content keeps the space the model wrote before the marker
    return f"{content} {MARKER}{_dumps(calls)}" if content else f"{MARKER}{_dumps(calls)}"


def arguments(raw: Any, param: str) -> Any:
    """A history call's arguments, parsed; ToolError (naming `param`) unless they are JSON text
    nesting at most MAX_JSON_DEPTH levels (deeper ones end the parser, or _dumps after it, in a
    RecursionError: a 500, not a 400)."""
    deep = ToolError(param, f"arguments nest more than {MAX_JSON_DEPTH} levels")
    try:
        args = json.loads(raw or "{}", parse_constant=_not_json)  # NaN / Infinity are not JSON
    except RecursionError:
        raise deep from None
    except (TypeError, ValueError) as exc:
        raise ToolError(param, f"arguments is not JSON text ({exc})") from None
    if json_depth(args) > MAX_JSON_DEPTH:
        raise deep
    return args


def _not_json(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def resent_text(text: str, mode: Mode) -> str:
    """The assistant turn's text (as _turns renders it) of the message a reply `text` was
    answered as, when a client sends that message back: its content, and its calls in the
    envelope."""
    content, calls = split(text, mode)
    if calls is None:
        return text.lstrip()
    return assistant_text(content.lstrip() if content.strip() else "", calls, 0)[0]


def tool_text(name: str, content: str) -> str:
    """A tool message's turn text (after "Tool: ")."""
    return _dumps({"name": name, "content": content})

"""A response's tools and prompt, checked before anything starts (docs/agents.md, "The Responses
API"): the tools and tool_choice (chat's ToolPlan in the Responses shapes, with text.format's
grammar: ToolPlan.with_format; compiled by the engine first, as chat's: behind the gap on a new
assistant turn, agents.ready_grammar), the prompt (the tools' system turn, the instructions, the
input items), and what the task keeps of the request (its `meta` and `grammar` parameters), so
a continue or a restart runs the same grammar and a later response knows the calls made."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from server.api.errors import ApiError
from server.api.grammar import format_spec
from server.api.openai import tools
from server.api.openai.agents import ready_grammar
from server.api.openai.chat_format import CHAT_STOP, build_prompt
from server.api.responses import logprobs, render
from server.api.responses.compaction import compaction_id, is_compaction
from server.api.responses.conversation import Start, render_after
from server.api.responses.items import Item, Rendered, after_compaction, render_input
from server.api.responses.schemas import HistoryInput, ResponseInput, ResponseRequest, TextFormat
from server.api.services import Services
from server.engine.types import GrammarSpec, SamplingParams
from server.tasks.params import grammar_fields
from server.tasks.records import Task


@dataclass(frozen=True)
class ResponseTools:
    plan: tools.ToolPlan | None
    """The tools the output may call (None: no call is possible)."""
    described: tools.ToolPlan | None
    """The tools the prompt describes (with tool_choice "none" too, as on chat)."""
    grammar: GrammarSpec | None
    """The output's grammar, compiled once `ready` (the call grammar: a trigger: auto; none:
    forced; any_of: auto with a format, ToolPlan.with_format; without calls text.format's; either
    behind the gap where the reply opens a new assistant turn: agents.ready_grammar)."""
    fmt: GrammarSpec | None = None
    """text.format's grammar (None: text)."""


def response_tools(body: ResponseInput) -> ResponseTools:
    """The request's tools and text.format checked and planned (a 400 naming the field
    otherwise); the grammar is compiled by `ready`, once the prompt says whether the reply opens a
    new assistant turn."""
    try:
        plan = tools.plan(body.tools, body.tool_choice, body.parallel_tool_calls, flat=True)
        described = plan or tools.shown(body.tools, body.tool_choice, flat=True)
    except tools.ToolError as exc:
        raise ApiError(400, str(exc), param=exc.param, code=exc.code) from None
    fmt = format_spec(response_format(body), param="text.format")  # (a format that is no grammar names it)
    if plan is None:  # (tool_choice "none" too: the format's grammar alone runs)
        return ResponseTools(None, described, fmt, fmt)
    plan = plan.with_format(fmt)  # auto: a call or the formatted reply; forced: the calls
    return ResponseTools(plan, described, plan.grammar(), fmt)


async def ready(sv: Services, rt: ResponseTools, prompt: str) -> ResponseTools:
    """`rt` with its grammar compiled as chat's (agents.ready_grammar): a reply after the
    prompt's fresh "Assistant:" starts with the gap; a bad format is a 400 naming text.format."""
    new_turn = not render.continues_prompt(prompt, {})  # (a forced call's prompt ends with the marker: no gap anyway)
    grammar = await ready_grammar(sv, rt.grammar, rt.plan, rt.fmt, new_turn=new_turn, fmt_param="text.format")
    return replace(rt, grammar=grammar)


def response_format(body: ResponseInput) -> dict[str, Any]:
    """The request's text.format as chat's response_format (what tasks store)."""
    return (body.text.format if body.text is not None else TextFormat()).response_format()


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def prompt_and_meta(
    body: ResponseRequest, rt: ResponseTools, src: Task | None, conv: Start | None = None
) -> tuple[str, dict[str, Any]]:
    """The prompt's text (what follows the previous response's history, if any: `prompt`) and
    the task's `meta`."""
    text, rendered, described = prompt(body, rt, src, conv.items if conv is not None else ())
    meta = _meta(body, rendered, described)
    if conv is not None:
        meta["conversation"] = conv.conv.id
    if src is not None and is_compaction(src):
        meta["compaction"] = compaction_id(src)  # (what it forked: no previous response)
    return text, meta


def prompt(
    body: HistoryInput, rt: ResponseTools, src: Task | None, prior: Sequence[Item] = ()
) -> tuple[str, Rendered, str | None]:
    """The prompt's text, the input rendered, and the digest of the tools described. The tools'
    system turn comes first, unless the previous responses described the same tools (their
    description is in the history already: a tool loop does not repeat it). `prior`: the items
    of the conversation rendered before the input (not the input's: `Rendered.items` holds the
    input's alone). An input with a compaction item renders what follows the last one (`src`:
    that compaction's task)."""
    before = render.meta(src) if src is not None else {}
    made = render.calls(src) if src is not None else []  # (its output parsed once)
    owed = [c["call_id"] for c in made]  # the input must answer them
    inp = after_compaction(body.input)
    known = render.known_calls(src, made) if src is not None else {}
    rendered = render_after(prior, inp, known, owed) if prior else render_input(inp, known, owed)
    turns: list[tuple[str, str]] = []
    described = before.get("described")
    if rt.described is not None:
        text = rt.described.system_text()
        if _digest(text) != described:
            turns.append(("system", text))
        described = _digest(text)
    if body.instructions:
        turns.append(("system", body.instructions))
    text = build_prompt(turns + rendered.turns).text
    if rt.plan is not None:
        text += rt.plan.prompt_suffix()
    return text, rendered, described


def _meta(body: ResponseRequest, rendered: Rendered, described: str | None) -> dict[str, Any]:
    """What a stored response shows of its request, and what the next response needs."""
    return {
        "instructions": body.instructions,
        "input": rendered.items,
        "tools": [_tool(t) for t in body.tools or ()],
        "tool_choice": body.tool_choice or "auto",
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "calls": rendered.kept_calls(),
        "described": described,
        "metadata": body.metadata or {},
        "verbosity": body.text.verbosity if body.text is not None else None,
        "background": bool(body.background),
        "top_logprobs": body.top_logprobs,
        "max_tool_calls": body.max_tool_calls,
    }


def _tool(raw: dict[str, Any]) -> dict[str, Any]:
    """A tool as a response shows it (checked by tools.plan)."""
    strict = raw.get("strict")
    return {
        "type": "function",
        "name": raw["name"],
        "description": raw.get("description"),
        "parameters": raw.get("parameters"),
        "strict": True if strict is None else strict,
    }


def task_params(rt: ResponseTools, meta: dict[str, Any], fmt: dict[str, Any]) -> dict[str, Any]:
    """The task parameters that make a continue or a restart run as this request: its grammar
    ({} when it has none: a fork of a tool response lifts it) and its meta. A task has one
    grammar: with tools that may be called the call grammar holds the format `fmt` (auto) or
    leaves it to a later turn (forced), and a new turn's format runs behind the gap
    (agents.ready_grammar), so the task stores the format as text and its meta keeps `fmt` for
    the response's text.format (render.response); the format's own grammar (a reply that
    continues a message) is stored as the format."""
    own = None if rt.grammar == rt.fmt else rt.grammar
    out = {"grammar": grammar_fields(own), "meta": meta}
    if own is not None and fmt.get("type", "text") != "text":
        out.update(response_format={"type": "text"}, meta={**meta, "format": fmt})
    return out


def sampling_params(sv: Services, body: ResponseRequest, fmt: dict[str, Any]) -> dict[str, Any]:
    """Every generation field, explicit: a response never inherits its previous one's."""
    d, limit = SamplingParams(), sv.settings.max_tokens_limit
    max_tokens = sv.settings.default_max_tokens if body.max_output_tokens is None else body.max_output_tokens
    if limit and max_tokens > limit:
        raise ApiError(
            400,
            f"invalid 'max_output_tokens': {max_tokens} is above this server's limit of {limit}",
            param="max_output_tokens",
            code="invalid_request",
        )
    out = {
        "max_tokens": max_tokens,
        "temperature": d.temperature if body.temperature is None else body.temperature,
        "top_p": d.top_p if body.top_p is None else body.top_p,
        "stop": list(CHAT_STOP),
        "response_format": fmt,
    }
    if body.seed is not None:
        out["seed"] = body.seed
    k = logprobs.requested(body.include, body.top_logprobs)
    if k is not None:
        out["logprobs"] = k
    return out

"""The agent features of an OpenAI request checked before anything starts (docs/agents.md):
tools and tool_choice (a ToolPlan and its call grammar), response_format (its grammar; with tools
that may be called, part of the call grammar: ToolPlan.with_format), logprobs; each grammar
compiled by the engine first, so a bad one is a 400 and nothing is submitted."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from server.api.errors import ApiError
from server.api.grammar import compiled, format_spec, response_grammar
from server.api.openai import tools
from server.api.openai.schemas import ChatRequest, CompletionRequest
from server.api.services import Services
from server.engine.types import GrammarSpec, SamplingParams


@dataclasses.dataclass(frozen=True)
class Agent:
    """What a request asked for beyond free text."""

    tool_plan: tools.ToolPlan | None = None
    grammar: GrammarSpec | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    described: tools.ToolPlan | None = None
    """The tools the prompt describes: the plan's, or with tool_choice "none" the request's
    (tools.shown: described, not callable)."""
    fmt: GrammarSpec | None = None
    """The request's response_format as a grammar (chat: its own, or inside the plan's)."""

    @property
    def any(self) -> bool:
        return self.tool_plan is not None or self.logprobs is not None

    def apply(self, params: Sequence[SamplingParams]) -> list[SamplingParams]:
        if self.grammar is None and self.logprobs is None and self.prompt_logprobs is None:
            return list(params)
        return [
            dataclasses.replace(p, grammar=self.grammar, logprobs=self.logprobs, prompt_logprobs=self.prompt_logprobs)
            for p in params
        ]


def chat_agent(body: ChatRequest) -> Agent:
    """The chat request's tools and format, planned; its grammar NOT compiled yet (chat_ready
    compiles it once the prompt says whether the reply opens a new assistant turn)."""
    try:
        plan = tools.plan(body.tools, body.tool_choice, body.parallel_tool_calls)
    except tools.ToolError as exc:
        raise ApiError(400, str(exc), param=exc.param, code=exc.code) from None
    fmt = format_spec(body.response_format)  # (a format that is no grammar names response_format)
    grammar = fmt
    if plan is not None:  # with a format: a call or the formatted reply (auto), the calls (forced)
        plan = plan.with_format(fmt)
        grammar = plan.grammar()
    return Agent(plan, grammar, body.top(), described=plan or tools.shown(body.tools, body.tool_choice), fmt=fmt)


GAP = " "
"""What the chat format writes between "Assistant:" and the reply (chat_format.build_prompt)."""


async def chat_ready(sv: Services, agent: Agent, *, new_turn: bool) -> Agent:
    """`agent` with its grammar compiled (ready_grammar: with the gap where the reply opens a new
    assistant turn)."""
    if agent.grammar is None:  # (free text: no format either, nothing to compile)
        return agent
    grammar = await ready_grammar(sv, agent.grammar, agent.tool_plan, agent.fmt, new_turn=new_turn)
    return dataclasses.replace(agent, grammar=grammar)


async def ready_grammar(
    sv: Services,
    spec: GrammarSpec | None,
    plan: tools.ToolPlan | None,
    fmt: GrammarSpec | None,
    *,
    new_turn: bool,
    fmt_param: str = "response_format",
) -> GrammarSpec | None:
    """The grammar `spec` (a reply's: `fmt`, or `plan`'s call grammar holding it) compiled: one
    compile of the grammar the reply runs (each is seconds for a rich schema's first use); shared
    by chat (chat_ready) and /v1/responses (responses.agent.ready, `fmt_param` "text.format"). A
    reply that opens a new assistant turn (new_turn) starts a format, or with tools "auto" the
    call-or-format union, with GAP, as a free reply's first token does (" Hello"). The model then
    reads "Assistant: {...}", the chat format it knows, and a client that re-sends the reply as
    history ("Assistant: " + content) re-tokenizes it as generated (' {"' rather than "{"), so the
    conversation cache keeps the reply's state as it is instead of repairing it. (Rendering such
    history without the gap instead would not do: a re-sent message does not say whether a
    grammar wrote it, and "Assistant:{" is one token ":{" where the model would write ":" then
    "{".) The gap is shown to no client (render.Meta.lead and the Responses renderers strip it,
    hidden_lead keeps stop strings out of it). Without it: free text, a triggered grammar (free
    text first) and forced calls (the prompt already ends with " <tool_call>"). A bad grammar is
    a 400 naming `fmt_param` when the format is at fault, else `tools`; a forced plan leaves the
    format to a later turn, which is checked all the same."""
    param = "tools" if plan is not None else fmt_param
    if plan is not None and fmt is not None and plan.reply is None:  # (forced: not in this grammar)
        await compiled(sv, fmt, param=fmt_param)
    if spec is None:
        return None
    if new_turn and not spec.trigger and (plan is None or plan.mode == "formatted"):
        try:
            return await compiled(sv, gapped(spec), param=param)
        except ApiError:  # (a source near the size bound: escaped inside any_of's it is longer) as it is
            pass
    try:
        return await compiled(sv, spec, param=param)
    except ApiError:
        if plan is not None and fmt is not None:  # the format's own fault is named as such
            await compiled(sv, fmt, param=fmt_param)
        raise


def gapped(spec: GrammarSpec) -> GrammarSpec:
    """`spec` with GAP before its output (before each alternative's prefix of an any_of)."""
    alts = spec.alternatives() if spec.kind == "any_of" else [("", spec)]
    return GrammarSpec.any_of([(GAP + p, alt) for p, alt in alts])


async def completion_agent(sv: Services, body: CompletionRequest) -> Agent:
    grammar = await response_grammar(sv, body.response_format)
    scored = body.logprobs if body.echo else None
    return Agent(None, grammar, body.logprobs, scored)

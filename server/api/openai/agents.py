"""The agent features of an OpenAI request checked before anything starts (docs/agents.md):
tools and tool_choice (a ToolPlan and its call grammar), response_format (its grammar; with tools
that may be called, part of the call grammar: ToolPlan.with_format), logprobs; each grammar
compiled by the engine first, so a bad one is a 400 and nothing is submitted."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from server.api.errors import ApiError
from server.api.grammar import compiled, response_grammar
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


async def chat_agent(sv: Services, body: ChatRequest) -> Agent:
    try:
        plan = tools.plan(body.tools, body.tool_choice, body.parallel_tool_calls)
    except tools.ToolError as exc:
        raise ApiError(400, str(exc), param=exc.param, code="invalid_request") from None
    grammar = await response_grammar(sv, body.response_format)  # (a bad format names response_format)
    if plan is not None:  # with a format: a call or the formatted reply (auto), the calls (forced)
        plan = plan.with_format(grammar)
        grammar = await compiled(sv, plan.grammar(), param="tools")
    return Agent(plan, grammar, body.top(), described=plan or tools.shown(body.tools, body.tool_choice))


GAP = " "
"""What the chat format writes between "Assistant:" and the reply (chat_format.build_prompt)."""


async def after_gap(sv: Services, agent: Agent) -> Agent:
    """agent for a reply that opens a new assistant turn: its grammar (a format, or with tools
    "auto" the call-or-format union) starts with GAP, as a free reply's first token does
    (" Hello"). The model then reads "Assistant: {...}", the chat format it knows, and a client
    that re-sends the reply as history ("Assistant: " + content) re-tokenizes it as generated
    (' {"' rather than "{"), so the conversation cache keeps the reply's state as it is instead
    of repairing it. (Rendering such history without the gap instead would not do: a re-sent
    message does not say whether a grammar wrote it, and "Assistant:{" is one token ":{" where
    the model would write ":" then "{".) The gap is shown to no client (render.Meta.lead strips it,
    hidden_lead keeps stop strings out of it). Unchanged: free text, a triggered grammar (free
    text first) and forced calls (the prompt already ends with " <tool_call>")."""
    spec, plan = agent.grammar, agent.tool_plan
    if spec is None or spec.trigger or (plan is not None and plan.mode != "formatted"):
        return agent
    alts = spec.alternatives() if spec.kind == "any_of" else [("", spec)]
    gapped = GrammarSpec.any_of([(GAP + prefix, alt) for prefix, alt in alts])
    try:
        return dataclasses.replace(agent, grammar=await compiled(sv, gapped, param="response_format"))
    except ApiError:  # (a source near the size bound: escaped inside any_of's it is longer) as it was
        return agent


async def completion_agent(sv: Services, body: CompletionRequest) -> Agent:
    grammar = await response_grammar(sv, body.response_format)
    scored = body.logprobs if body.echo else None
    return Agent(None, grammar, body.logprobs, scored)

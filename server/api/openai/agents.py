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


async def completion_agent(sv: Services, body: CompletionRequest) -> Agent:
    grammar = await response_grammar(sv, body.response_format)
    scored = body.logprobs if body.echo else None
    return Agent(None, grammar, body.logprobs, scored)

"""OpenAI's Agents SDK (`openai-agents`) against a real server, as an agent developer points it at
us, through both of its OpenAI models (chat completions and the Responses API): a function tool
called with valid arguments and its result handed back (the SDK's tool loop, plain and
streamed), and a typed final output (its `output_type`, our JSON-schema grammar), also for an
agent with tools (a call or the typed answer: one grammar). On a random-weight model the answers
are noise, so the runs force what the SDK lets a user force: `tool_choice="required"` and one
call a turn (a tool's arguments come from the grammar), a seed, and schemas whose values are
short (an enum, a bounded integer)."""

from __future__ import annotations

from typing import Literal

import pytest
from pydantic import BaseModel, Field
from util_server import async_sdk, server_fixture

agents = pytest.importorskip("agents", reason="needs the openai-agents package (the test extra)")
from agents import (  # noqa: E402
    Agent,
    MaxTurnsExceeded,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)

set_tracing_disabled(True)  # the SDK would send traces to OpenAI
FORCED = ModelSettings(tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=64)


class Pick(BaseModel):
    n: int = Field(ge=0, le=9)
    answer: Literal["yes", "no"]


server = server_fixture()


@pytest.fixture(params=["chat", "responses"])
def model(server, request):
    if request.param == "chat":
        return OpenAIChatCompletionsModel(model="rwkv", openai_client=async_sdk(server, timeout=120))
    return OpenAIResponsesModel(model="rwkv", openai_client=async_sdk(server, timeout=120))


def weather_tool(calls: list[str]):
    @function_tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"sunny in {city}"

    return get_weather


def assert_each_call_answered_then_a_message(new_items, calls: list[str]) -> None:
    """A run's new items: a call item and its output item for each time the tool ran, and a
    message last (the run ended with an answer, not a call)."""
    kinds = [item.type for item in new_items]
    assert kinds.count("tool_call_item") == len(calls) == kinds.count("tool_call_output_item")
    assert kinds[-1] == "message_output_item"


async def test_a_forced_tool_call_runs_the_tool(model):
    calls: list[str] = []
    agent = Agent(name="w", instructions="Use the tool.", tools=[weather_tool(calls)], model=model,
                  model_settings=FORCED, tool_use_behavior="stop_on_first_tool")  # fmt: skip
    result = await Runner.run(agent, "What is the weather in Paris?")
    assert len(calls) == 1 and result.final_output == f"sunny in {calls[0]}"


async def test_the_tool_loop_sends_each_result_back(model):
    """run_llm_again with the call forced every turn: each turn's request holds the calls and
    results of the turns before it (chat: assistant tool_calls and `tool` messages; Responses:
    function_call and function_call_output items), until the SDK's turn limit."""
    calls: list[str] = []
    agent = Agent(name="w", instructions="Use the tool.", tools=[weather_tool(calls)], model=model,
                  model_settings=FORCED, reset_tool_choice=False)  # fmt: skip
    with pytest.raises(MaxTurnsExceeded):
        await Runner.run(agent, "What is the weather in Rome?", max_turns=3)
    assert len(calls) == 3


async def test_the_tool_loop_hands_the_result_back(server):
    """run_llm_again: the tool's result goes back to the model and the next turn, with
    tool_choice reset to auto, answers. (Chat only: that answer is free text, cut by max_tokens
    on a random model, and the SDK's Responses model refuses an `incomplete` response, as it
    would OpenAI's.)"""
    calls: list[str] = []
    model = OpenAIChatCompletionsModel(model="rwkv", openai_client=async_sdk(server, timeout=120))
    agent = Agent(name="w", instructions="Use the tool, then answer.", tools=[weather_tool(calls)], model=model,
                  model_settings=FORCED)  # fmt: skip
    result = await Runner.run(agent, "What is the weather in Rome?", max_turns=6)
    assert calls and isinstance(result.final_output, str) and result.final_output
    assert_each_call_answered_then_a_message(result.new_items, calls)


async def test_a_streamed_run_calls_the_tool(model):
    calls: list[str] = []
    agent = Agent(name="w", instructions="Use the tool.", tools=[weather_tool(calls)], model=model,
                  model_settings=FORCED, tool_use_behavior="stop_on_first_tool")  # fmt: skip
    run = Runner.run_streamed(agent, "What is the weather in Rome?")
    events = [ev.type async for ev in run.stream_events()]
    assert "raw_response_event" in events and len(calls) == 1
    assert run.final_output == f"sunny in {calls[0]}"


async def test_a_typed_final_output(model):
    agent = Agent(name="s", instructions="Answer.", model=model, output_type=Pick,
                  model_settings=ModelSettings(temperature=0, max_tokens=64))  # fmt: skip
    result = await Runner.run(agent, "Pick a digit, and say yes or no.")
    assert isinstance(result.final_output, Pick)


async def test_prompt_cache_retention_is_accepted(server):
    """The SDK sends ModelSettings' prompt_cache_retention (and context_management) to the
    Responses API: a caching hint, accepted as it is (every response's state is kept anyway)."""
    model = OpenAIResponsesModel(model="rwkv", openai_client=async_sdk(server, timeout=120))
    settings = ModelSettings(temperature=0, max_tokens=64, prompt_cache_retention="24h")
    agent = Agent(name="s", instructions="Answer.", model=model, output_type=Pick, model_settings=settings)
    result = await Runner.run(agent, "Pick a digit, and say yes or no.")
    assert isinstance(result.final_output, Pick)


async def test_top_logprobs_give_the_message_its_logprobs(server):
    """ModelSettings.top_logprobs: the SDK asks the Responses API for the message's logprobs
    (include message.output_text.logprobs); the typed answer's tokens come with theirs, taken
    before the JSON grammar's mask (a forced token may be improbable, never impossible)."""
    model = OpenAIResponsesModel(model="rwkv", openai_client=async_sdk(server, timeout=120))
    settings = ModelSettings(temperature=0, max_tokens=64, top_logprobs=2)
    agent = Agent(name="s", instructions="Answer.", model=model, output_type=Pick, model_settings=settings)
    result = await Runner.run(agent, "Pick a digit, and say yes or no.")
    assert isinstance(result.final_output, Pick)
    part = result.raw_responses[-1].output[0].content[0]
    assert part.logprobs and all(len(e.top_logprobs) == 2 and e.logprob > float("-inf") for e in part.logprobs)
    assert part.text in b"".join(bytes(e.bytes) for e in part.logprobs).decode("utf-8", "replace")


TYPED = ModelSettings(tool_choice="required", parallel_tool_calls=False, temperature=1.0, top_p=1.0, max_tokens=64,
                      extra_body={"seed": 0})  # fmt: skip
"""The first turn's call forced; then (tool_choice reset to auto) a call or the typed answer:
sampled, seed 0 answers on the second turn (checked by running; other seeds call again)."""


async def test_tools_and_a_typed_output(model):
    """An agent with a tool and an output_type: the SDK sends the tools with the output's JSON
    schema on every turn (response_format / text.format). The first turn's call is forced; after
    it the SDK resets tool_choice to auto, and the answer is a call or the typed JSON (one
    grammar): the run ends with a Pick."""
    calls: list[str] = []
    agent = Agent(name="t", instructions="Use the tool, then answer.", tools=[weather_tool(calls)], model=model,
                  output_type=Pick, model_settings=TYPED)  # fmt: skip
    result = await Runner.run(agent, "What is the weather in Paris? Pick a digit.", max_turns=4)
    assert calls and isinstance(result.final_output, Pick)
    assert_each_call_answered_then_a_message(result.new_items, calls)


async def test_a_streamed_run_with_tools_and_a_typed_output(model):
    calls: list[str] = []
    agent = Agent(name="t", instructions="Use the tool, then answer.", tools=[weather_tool(calls)], model=model,
                  output_type=Pick, model_settings=TYPED)  # fmt: skip
    run = Runner.run_streamed(agent, "What is the weather in Paris? Pick a digit.", max_turns=4)
    events = [ev.type async for ev in run.stream_events()]
    assert "raw_response_event" in events and calls and isinstance(run.final_output, Pick)

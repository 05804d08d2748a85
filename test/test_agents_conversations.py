"""OpenAI's Agents SDK with the server keeping the conversation, its two ways against a real
server: `Runner.run(conversation_id=...)` (each turn sends only its new items, the server renders
the rest from the conversation, starting from its last response's state) and the
OpenAIConversationsSession (the SDK lists the conversation's items, sends them as input and adds
each run's new items back). On a random-weight model the tool is forced, one call a turn, as in
test_agents_sdk.py."""

from __future__ import annotations

from typing import Literal

import pytest
from util_server import async_sdk, server_fixture

agents = pytest.importorskip("agents", reason="needs the openai-agents package (the test extra)")
from agents import (  # noqa: E402
    Agent,
    MaxTurnsExceeded,
    ModelSettings,
    OpenAIConversationsSession,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)

set_tracing_disabled(True)  # the SDK would send traces to OpenAI
FORCED = ModelSettings(tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=64)

server = server_fixture()


def weather_agent(server, calls: list[str], **kw) -> Agent:
    @function_tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"sunny in {city}"

    model = OpenAIResponsesModel(model="rwkv", openai_client=async_sdk(server, timeout=120))
    return Agent(name="w", instructions="Use the tool.", tools=[get_weather], model=model, model_settings=FORCED, **kw)


async def test_a_run_on_a_server_side_conversation(server):
    """Three turns of forced calls: each turn after the first sends only the tool's result; the
    server knows the calls from the conversation (an unknown call_id would be a 400), and the
    conversation holds the whole loop in order."""
    client = async_sdk(server)
    conv = await client.conversations.create()
    calls: list[str] = []
    agent = weather_agent(server, calls, reset_tool_choice=False)
    with pytest.raises(MaxTurnsExceeded):
        await Runner.run(agent, "What is the weather in Rome?", conversation_id=conv.id, max_turns=3)
    assert len(calls) == 3
    items = [i async for i in client.conversations.items.list(conv.id, order="asc")]
    kinds = [i.type for i in items]
    assert kinds == ["message", "function_call", "function_call_output", "function_call", "function_call_output",
                     "function_call"], kinds  # fmt: skip
    assert items[0].content[0].text == "What is the weather in Rome?"
    calls_made = [i for i in items if i.type == "function_call"]
    outputs = [i for i in items if i.type == "function_call_output"]
    assert [o.call_id for o in outputs] == [c.call_id for c in calls_made[:2]]
    assert [o.output for o in outputs] == [f"sunny in {c}" for c in calls[:2]]
    # each call's response (its id is in the call's: render.calls): the 2nd and 3rd started from
    # the state of the one before, so all it had taken in was cached
    responses = [await client.responses.retrieve("resp_" + c.id[3:-2]) for c in calls_made]
    for before, r in zip(responses, responses[1:]):
        assert r.conversation.id == conv.id
        assert r.usage.input_tokens_details.cached_tokens >= before.usage.input_tokens + before.usage.output_tokens - 1


async def test_a_session_keeps_the_history_in_a_conversation(server):
    calls: list[str] = []
    agent = weather_agent(server, calls, tool_use_behavior="stop_on_first_tool")
    session = OpenAIConversationsSession(openai_client=async_sdk(server))
    first = await Runner.run(agent, "Weather in Paris?", session=session)
    assert first.final_output == f"sunny in {calls[0]}"
    conv_id = session.session_id
    assert conv_id.startswith("conv_")
    second = await Runner.run(agent, "And in Rome?", session=session)  # the history goes back as input
    assert second.final_output == f"sunny in {calls[1]}"
    history = await session.get_items()
    kinds = [i["type"] for i in history]
    assert kinds == ["message", "function_call", "function_call_output"] * 2, kinds
    assert [i["content"][0]["text"] for i in history if i["type"] == "message"] == ["Weather in Paris?",
                                                                                   "And in Rome?"]  # fmt: skip
    assert len(await session.get_items(limit=2)) == 2
    last = await session.pop_item()
    assert last["type"] == "function_call_output" and len(await session.get_items()) == 5
    await session.clear_session()
    client = async_sdk(server)
    with pytest.raises(Exception) as ei:
        await client.conversations.retrieve(conv_id)
    assert ei.value.status_code == 404

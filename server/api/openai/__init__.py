"""The OpenAI protocol: /v1/chat/completions, /v1/completions, /v1/models.

routes.py         /v1/completions, /v1/models and the chat handler; the route of
                  /v1/chat/completions is server.api.lightning.v1_chat's (the path is shared with
                  lightning's V1 batch), which hands an OpenAI body to that handler
schemas.py        request bodies on server.api.sampling.SamplingFields: fields honoured, ignored
                  or refused
messages.py       chat messages -> (role, text) turns (tool calls and results included)
chat_format.py    turns -> the RWKV chat prompt, split into a cacheable prefix and the rest
prefix_cache.py   prefill-once states of shared chat prefixes
start.py          where a request starts: a named state template, the conversation cache
conversation.py   the conversation cache: states at the end of earlier requests, per key
settling.py       a request tracked until its states are kept; the repair slots
agents.py         tools, tool_choice, response_format and logprobs checked and compiled first
tools.py          tool calls on the RWKV chat format: plan, grammar, parsing of the output
render.py         response bodies and pre-encoded SSE chunk bytes (the plain requests)
agent_render.py   response bodies and chunks of requests with tools or logprobs

The engine jobs and their stream (ChoiceStream) are server.api.generation's, shared with
lightning's batch routes. Nothing here imports server.api.lightning: lightning depends on this
package (its V1 route and OpenAI-style route re-serve OpenAI's handler and shapes), never the
reverse (test/test_import_layers.py).
"""

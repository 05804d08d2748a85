"""rwkv_lightning's HTTP API on this server (docs/lightning.md): batch prompts in `contents`, the
Immersive Translate custom API, batch fill-in-the-middle, a big-batch stream, its OpenAI-style
chat route, and server-side chat sessions (`session_id`, branches by `dialogue_idx`).

Every prompt is one engine sequence submitted through the shared engine (so separate requests
share batches); the sessions are persistent tasks of the TaskManager. Lightning's field names
and per-route defaults live in `schemas`, its answer shapes in `render`, the sessions in
`sessions`, and the route of the path V1 shares with the OpenAI chat (POST /v1/chat/completions)
in `v1_chat`. Lightning depends on server.api.openai (that path's chat handler and body, the
shapes its OpenAI-style route re-serves), never the reverse. Importing this package does no
work (the auth middleware reads `paths`).
"""

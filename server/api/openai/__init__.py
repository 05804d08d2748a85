"""The OpenAI protocol: routes (routes.py), request bodies (schemas.py), the engine sequences of
a request (jobs.py), response and chunk bytes (render.py), its SSE stream (stream.py), the chat
prompt format (chat_format.py) and the chat-prefix state cache (prefix_cache.py)."""

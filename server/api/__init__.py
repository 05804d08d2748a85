"""The HTTP layer: one package per protocol, the modules they share, one streaming layer.

app.py          the FastAPI app: lifespan (load, start, drain, stop), routers, the outermost ASGI layer
services.py     Services: what routes use of the running server (engine, tasks, metrics, ...)
loading.py      loading the model, tokenizer and engine (in a thread); the start-up facts
middleware.py   request ids, JSON bodies, body limit, API keys, last-resort errors, the access log
http_limits.py  uvicorn's httptools protocol with header and body read deadlines
errors.py       the error shape, ApiError, the engine errors' statuses
handlers.py     exception handlers (every error in the error shape)
openapi.py      /openapi.json: every status a route answers, the error model, SSE beside JSON
sampling.py     SamplingFields: the sampling fields of the OpenAI and task bodies (bounds,
                defaults, the unknown-fields policy)
grammar.py      a request's response_format or tool grammar, compiled before anything starts
metrics.py      Prometheus metrics: the text format and every family it holds
latency.py      Recorder: a request's latency histograms fed per batch of tokens
ops.py          /health, /metrics and /docs

openai/         /v1/chat/completions, /v1/completions, /v1/models
responses/      /v1/responses, /v1/conversations: OpenAI's Responses and Conversations APIs on
                persistent tasks
tasks/          /v1/tasks/*: the task API
lightning/      rwkv_lightning's routes (its batch, translate, FIM, state sessions, OpenAI-style)
states/         state files: upload, list, delete, export; those loaded at start
streaming/      the SSE response and StreamSource, the one stream interface that four streams
                implement (OpenAI and lightning jobs, tasks, responses, lightning sessions)

The dashboard (/ui) is server.webui, beside this package. docs/architecture.md maps every module.
"""

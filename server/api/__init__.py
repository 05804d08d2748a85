"""The HTTP layer, one package per protocol.

app.py          the FastAPI app: lifespan (load, start, drain, stop), routes, middleware
services.py     Services: what routes use of the running server (engine, tasks, metrics, ...)
loading.py      loading the model, tokenizer and engine; the start-up facts
sampling.py     the sampling fields of every route: bounds, defaults, the unknown-fields policy
errors.py       the error shape, ApiError, the engine errors' statuses
handlers.py     exception handlers (every error in the error shape)
middleware.py   request ids, JSON bodies, body limit, API keys, the access log
metrics.py      Prometheus metrics and the per-request latency Recorder
ops.py          /health and /metrics
openai/         /v1/chat/completions, /v1/completions, /v1/models
tasks/          /v1/tasks/*
streaming/      the SSE response and the one stream interface both protocols implement
"""

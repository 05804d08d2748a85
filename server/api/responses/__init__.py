"""The OpenAI Responses API (/v1/responses) on the task layer: a stored response is a persistent
task (docs/agents.md, "The Responses API")."""

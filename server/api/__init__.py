"""HTTP layer: FastAPI app, task routes, OpenAI routes, ops routes."""

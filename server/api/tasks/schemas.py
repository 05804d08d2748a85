"""Request bodies of the task routes (docs/task-api.md), on the shared sampling base
(server.api.sampling: bounds, defaults, the unknown-fields policy; errors are 422)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from server.api.sampling import SamplingFields, Text, TokenId, TokenIds


class GenParams(SamplingFields):
    """Generation parameters (all optional; absent = the task's / the server's defaults)."""

    stream: bool | None = None
    """true: answer as SSE (null or absent: JSON)."""
    response_format: Annotated[
        dict[str, Any] | None,
        Field(
            description='constrain the output: {"type": "json_object"} or {"type": "json_schema", '
            '"json_schema": {"name", "schema"}} (OpenAI\'s shape; {"type": "text"}: free)'
        ),
    ] = None


class CreateBody(GenParams):
    prompt: Annotated[Text | TokenIds, Field(description="text, or token ids; never empty")]


class FimBody(GenParams):
    prefix: str
    suffix: str | None = None
    """null or absent: no suffix."""


class UpdateBody(GenParams):
    prompt: Annotated[
        str | list[TokenId] | None, Field(description="text or token ids fed after the history; empty or absent: none")
    ] = None


class EmptyBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

"""Request bodies of the task routes (docs/task-api.md), on the shared sampling base
(server.api.sampling: bounds, defaults, the unknown-fields policy; errors are 422)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from server.api.sampling import SamplingFields


class GenParams(SamplingFields):
    """Generation parameters (all optional; absent = the task's / the server's defaults)."""

    stream: bool = False


class CreateBody(GenParams):
    prompt: str | list[int]


class FimBody(GenParams):
    prefix: str
    suffix: str = ""


class UpdateBody(GenParams):
    prompt: str | list[int] | None = None


class EmptyBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

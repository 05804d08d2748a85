"""Request bodies of the OpenAI routes (pydantic). Unknown fields are accepted and ignored, as the
OpenAI SDK sends many; fields we cannot honour (tools, logprobs, ...) are refused with 400."""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_N = 16
MAX_STOP = 16


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[ContentPart], None] = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for p in self.content:
            if p.type != "text" or p.text is None:
                raise ValueError(f"content part of type {p.type!r} is not supported (text only)")
            parts.append(p.text)
        return "\n".join(parts)


class SamplingFields(BaseModel):
    """Fields shared by chat and completions (OpenAI names + RWKV extras)."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    max_tokens: int | None = Field(None, ge=0, le=10_000_000)
    temperature: float | None = Field(None, ge=0, le=5)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=1_000_000)
    """RWKV extra: 0 or -1 = no top-k cut."""
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Union[str, list[str], None] = None
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    penalty_decay: float | None = Field(None, gt=0, le=1)
    ignore_eos: bool = False
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: Any) -> Any:
        items = [v] if isinstance(v, str) else (v or [])
        if len(items) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings")
        if any(s == "" for s in items):
            raise ValueError("stop strings must not be empty")
        return v

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=0, le=10_000_000)
    few_shot: bool = False
    """RWKV extra: prefix the prompt with the server's few-shot dialogues."""
    logprobs: bool | None = None
    tools: list[Any] | None = None
    functions: list[Any] | None = None
    response_format: dict[str, Any] | None = None


class CompletionRequest(SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    suffix: str | None = None
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: Any) -> Any:
        if isinstance(v, list):
            if not v:
                raise ValueError("prompt must not be an empty list")
            if len(v) > 64:
                raise ValueError("at most 64 prompts per request")
            if isinstance(v[0], list) and any(not p for p in v):
                raise ValueError("token id lists must not be empty")
        return v

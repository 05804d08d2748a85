"""Request bodies of the OpenAI routes, on the shared sampling base (server.api.sampling: bounds,
defaults, the unknown-fields policy).

Every field of the official OpenAI API for the endpoint is accepted (openai SDK:
types/chat/completion_create_params.py, types/completion_create_params.py). Each is honoured,
ignored where ignoring cannot change the answer, or refused (400 naming it) where it would:
`unsupported()` says which. tools, tool_choice, response_format and logprobs are honoured
(docs/agents.md). Our extras: top_k, repetition_penalty, penalty_decay,
stop_token_ids, ignore_eos (server.api.sampling), state, and few_shot (chat).
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from server.api.sampling import MaxTokens, Penalty, SamplingFields, TokenId
from server.engine.types import MAX_LOGPROBS

MAX_N = 16
MAX_PROMPTS = 64
MAX_COMPLETION_LOGPROBS = 5
"""OpenAI's bound on the legacy completions' logprobs."""


def _short_keys(pairs: dict[str, str]) -> dict[str, str]:
    """A metadata key over 64 characters is an error of `metadata` (a key's own error would name
    the key's text as the field)."""
    long = next((k for k in pairs if len(k) > 64), None)
    if long is not None:
        raise ValueError(f"a key has at most 64 characters ({long[:16]!r}... has {len(long)})")
    return pairs


Metadata = (
    Annotated[dict[str, Annotated[str, Field(max_length=512)]], Field(max_length=16), AfterValidator(_short_keys)]
    | None
)
"""OpenAI's `metadata`: at most 16 pairs of text, keys of at most 64 characters, values of at most
512 (chat ignores it; /v1/responses stores it with the response)."""


class StreamOptions(BaseModel):
    # strict as the body (SamplingFields): a nested model does not inherit it, and "yes" or 1 would
    # be read as true
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # ignored: our chunks carry no obfuscation padding


class ContentPart(BaseModel):
    """One part of a message's content; only text parts can be used."""

    model_config = ConfigDict(extra="allow")  # other part types carry their own keys (refused by type)
    type: str
    text: str | None = None


_NEEDS_CONTENT = ("system", "developer", "user", "tool")
"""The roles whose messages must have content (OpenAI's; an assistant's may be null: tool_calls)."""


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None  # ignored: the RWKV chat format has no speaker names
    refusal: str | None = None  # ignored: an earlier answer's refusal text is not part of the prompt
    audio: dict[str, Any] | None = None
    tool_calls: list[Any] | None = None
    """An assistant message's calls (rendered in the tool-call envelope: server.api.openai.tools)."""
    tool_call_id: str | None = None
    """A tool message: the id of the call it answers (an earlier assistant message's)."""
    function_call: dict[str, Any] | None = None
    # ignored: fields of the SDK's own answer message, which a client sends back as history as it
    # is (`messages.append(completion.choices[0].message)` after `parse()` or `stream()`)
    annotations: list[Any] | None = None
    parsed: Any = None  # (the content, parsed by the SDK: the content is what is rendered)

    def text(self) -> str:
        """The message's text (ValueError when it has a part or a field that is not text)."""
        if self.audio is not None or self.function_call is not None:
            raise ValueError("audio and (legacy) function calls in messages are not supported (text only)")
        if self.content is None:
            if self.role in _NEEDS_CONTENT:
                raise ValueError(f"a {self.role} message needs its content (only an assistant's may be null)")
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for p in self.content:
            if p.type == "refusal" and self.role == "assistant":
                continue  # (as the refusal field: an earlier answer's refusal is not part of the prompt)
            if p.type != "text":
                raise ValueError(f"content part of type {p.type!r} is not supported (text only)")
            if p.text is None:
                raise ValueError("a text content part needs its 'text'")
            if p.model_extra:
                raise ValueError(f"unknown field {next(iter(p.model_extra))!r} in a text content part")
            parts.append(p.text)
        return "\n".join(parts)


class OpenAIFields(SamplingFields):
    """Fields shared by chat and completions: OpenAI names + the shared sampling fields."""

    error_status: ClassVar[int] = 400

    model: str | None = None  # any name: this server serves one model
    n: int | None = Field(None, ge=1, le=MAX_N)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    frequency_penalty: Penalty = None
    """OpenAI's name of repetition_penalty (RWKV alpha_frequency), with our bounds."""
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # ignored (an end-user id for abuse monitoring)
    state: str | None = Field(None, min_length=1, max_length=64)
    """RWKV extra: start from the state template `_<state>` (a state file loaded with --state or
    uploaded to /v1/states/<state>, or any template); its pending tokens are fed first."""

    @property
    def choices(self) -> int:
        return self.n or 1

    def prompt_count(self) -> int:
        """How many prompts the request holds (each is sampled `choices` times)."""
        return 1

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_fields(self) -> dict[str, Any]:
        fields = super().sampling_fields()
        if self.stream_options is not None and not self.stream:  # (OpenAI refuses it too)
            raise self.invalid("stream_options is only allowed when stream is true", "stream_options")
        if self.frequency_penalty is not None:
            if self.repetition_penalty is not None:
                raise self.invalid(
                    "give frequency_penalty or repetition_penalty (one field, two names), not both", "frequency_penalty"
                )
            fields["repetition_penalty"] = self.frequency_penalty
        return fields

    def unsupported(self) -> tuple[str, str] | None:
        """(field, why) of the first given field this server cannot honour, or None."""
        if self.logit_bias:
            return "logit_bias", "logit_bias is not supported"
        return None


class ChatRequest(OpenAIFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: MaxTokens = None
    """OpenAI's newer name of max_tokens (it wins when both are given)."""
    few_shot: bool = False
    """RWKV extra: prefix the prompt with the server's few-shot dialogues."""
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Any] | None = None
    """Function tools (server.api.openai.tools; checked there: 400 naming the tool)."""
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None
    """text, json_object or json_schema (server.tasks.response_format.format_grammar)."""
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    web_search_options: dict[str, Any] | None = None
    moderation: dict[str, Any] | None = None
    # ignored: they cannot change the answer
    metadata: Metadata = None
    store: bool | None = None
    service_tier: str | None = None
    prediction: dict[str, Any] | None = None  # a latency hint: the answer is the same without it
    reasoning_effort: str | None = None  # the model does not reason in hidden tokens
    verbosity: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None

    def sampling_fields(self) -> dict[str, Any]:
        fields = super().sampling_fields()
        if self.max_completion_tokens is not None:
            fields["max_tokens"] = self.max_completion_tokens
        return fields

    def max_tokens_name(self) -> str:
        return "max_tokens" if self.max_completion_tokens is None else "max_completion_tokens"

    def top(self) -> int | None:
        """The engine's logprobs (None: off): top_logprobs alternatives when logprobs is true."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def unsupported(self) -> tuple[str, str] | None:
        if self.functions:
            return "functions", "the legacy functions field is not supported (use tools)"
        if self.function_call is not None and self.function_call not in ("none", "auto"):
            return "function_call", "the legacy function_call field is not supported (use tool_choice)"
        if self.top_logprobs and not self.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs: true (not supported without it)"
        if self.audio is not None or (self.modalities and set(self.modalities) != {"text"}):
            return ("audio" if self.audio is not None else "modalities"), "audio output is not supported (text only)"
        if self.web_search_options is not None:
            return "web_search_options", "web search is not supported"
        if self.moderation is not None:
            return "moderation", "moderation policies are not supported"
        return super().unsupported()


class CompletionRequest(OpenAIFields):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    suffix: str | None = None
    echo: bool | None = None
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    """The legacy completions' logprobs: this many alternatives per token (0..5)."""
    best_of: int | None = None
    response_format: dict[str, Any] | None = None
    """RWKV extra on completions: text, json_object or json_schema, as on chat."""

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: Any) -> Any:
        if isinstance(v, list):
            if not v:
                raise ValueError("prompt must not be an empty list")
            if len(v) > MAX_PROMPTS and not isinstance(v[0], int):  # a flat id list is one prompt
                raise ValueError(f"at most {MAX_PROMPTS} prompts per request")
            if isinstance(v[0], list) and any(not p for p in v):
                raise ValueError("token id lists must not be empty")
        return v

    def text_prompts(self) -> bool:
        """The prompts are text (not token ids)."""
        return isinstance(self.prompt, str) or isinstance(self.prompt[0], str)

    def prompt_count(self) -> int:
        p = self.prompt
        return len(p) if isinstance(p, list) and not isinstance(p[0], int) else 1

    def unsupported(self) -> tuple[str, str] | None:
        if self.best_of is not None and self.best_of != self.choices:
            return "best_of", "best_of is not supported (use n)"
        if self.echo and self.suffix is not None:  # as OpenAI: the echo would show the FIM prompt
            return "echo", "echo is not supported with suffix"
        if self.suffix and not self.text_prompts():  # FIM wraps text: ids have no place for it
            return "suffix", "suffix (fill-in-the-middle) is not supported with token id prompts (send text)"
        return super().unsupported()

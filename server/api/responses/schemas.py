"""Request bodies of POST /v1/responses and /v1/responses/input_tokens (the fields of the official
API this server honours or can ignore; an unknown field is a 400 naming it, server.api.sampling's
policy)."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationInfo, field_validator

from server.api.openai.schemas import Metadata
from server.api.sampling import MaxTokens
from server.engine.types import LIMITS, MAX_LOGPROBS

MAX_INPUT_ITEMS = 1024


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["input_text", "output_text", "text"]
    text: str
    annotations: list[Any] | None = None  # ignored (output_text parts sent back)
    logprobs: list[Any] | None = None  # ignored (output_text parts sent back)


def _str_or_parts(v: Any) -> str | None:
    """The branch of a text-or-parts field by the value's JSON type (None: neither): a bad part
    is then named by its place (`input[0].content[0].type`), not reported as "Input should be a
    valid string" for the whole field. (Tags in type form: param_of drops them.)"""
    return "str" if isinstance(v, str) else "list[part]" if isinstance(v, list) else None


_TEXT_OR_PARTS = Discriminator(
    _str_or_parts, custom_error_type="text_or_parts", custom_error_message="Input should be text or a list of parts"
)
MessageContent = Annotated[Annotated[str, Tag("str")] | Annotated[list[ContentPart], Tag("list[part]")], _TEXT_OR_PARTS]


class InputMessage(BaseModel):
    """A message item ({"role", "content"}, optionally "type": "message")."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: MessageContent
    id: str | None = Field(None, max_length=200)  # kept (the input items listing shows it)
    status: str | None = None  # ignored

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)


class FunctionCall(BaseModel):
    """A call the model made ({"type": "function_call", "call_id", "name", "arguments"}), sent
    back: rendered as the assistant turn that made it (server.api.openai.tools.envelope)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=200)
    name: str
    arguments: str
    id: str | None = Field(None, max_length=200)  # kept (the input items listing shows it)
    status: Literal["in_progress", "completed", "incomplete"] | None = None  # ignored


class OutputText(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["input_text", "output_text"]
    text: str


ToolOutput = Annotated[Annotated[str, Tag("str")] | Annotated[list[OutputText], Tag("list[part]")], _TEXT_OR_PARTS]


class FunctionCallOutput(BaseModel):
    """A tool's result for an earlier call ({"type": "function_call_output", "call_id", "output"}):
    a Tool turn naming the call's function. Its call_id must be an earlier call's (this input's
    or the previous responses')."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=200)
    output: ToolOutput
    id: str | None = Field(None, max_length=200)  # kept (the input items listing shows it)
    status: Literal["in_progress", "completed", "incomplete"] | None = None  # ignored

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "\n".join(p.text for p in self.output)


class Compaction(BaseModel):
    """A compaction item (POST /v1/responses/compact's output), sent back: the history before it
    is the compaction's state (server.api.responses.compaction)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["compaction"]
    encrypted_content: str = Field(min_length=1, max_length=200)
    """The compaction it names (`cmp_<hex>`: opaque to a client)."""
    id: str | None = Field(None, max_length=200)  # ignored (encrypted_content names it)
    created_by: str | None = None  # ignored


_KINDS = {"function_call": "FunctionCall", "function_call_output": "FunctionCallOutput"}


def _kind_of(kinds: dict[str, str]) -> Any:
    """The union branch of an input item (tags in class-name form: param_of drops them); a type
    not in `kinds` is the message branch's (its validation names the bad type)."""

    def kind_of(v: Any) -> str:
        kind = v.get("type", "message") if isinstance(v, dict) else getattr(v, "type", "message")
        return kinds.get(kind, "InputMessage") if isinstance(kind, str) else "InputMessage"

    return kind_of


_ITEMS = (
    Annotated[InputMessage, Tag("InputMessage")]
    | Annotated[FunctionCall, Tag("FunctionCall")]
    | Annotated[FunctionCallOutput, Tag("FunctionCallOutput")]
)
InputItem = Annotated[_ITEMS, Discriminator(_kind_of(_KINDS))]
"""An item of a conversation, or of a response's input after its last compaction item."""
ResponseItem = Annotated[
    _ITEMS | Annotated[Compaction, Tag("Compaction")], Discriminator(_kind_of({**_KINDS, "compaction": "Compaction"}))
]
"""An item of a response's (or a compaction's) input."""


class TextFormat(BaseModel):
    """text.format: {"type": "text" | "json_object" | "json_schema", "name", "schema", "strict"}."""

    model_config = ConfigDict(extra="forbid", strict=True)  # (a nested model does not inherit strict)
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None

    def response_format(self) -> dict[str, Any]:
        """OpenAI chat's response_format of this format (what tasks store)."""
        if self.type != "json_schema":
            return {"type": self.type}
        inner = {"name": self.name or "output", "schema": self.schema_}
        given = {"description": self.description, "strict": self.strict}  # (echoed as sent: render.response)
        return {"type": "json_schema", "json_schema": {**inner, **{k: v for k, v in given.items() if v is not None}}}


class TextOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: TextFormat = TextFormat()
    verbosity: Literal["low", "medium", "high"] | None = None
    """Echoed in the response's `text` (the default "medium", as OpenAI shows it); the answer is
    the same (the model has no verbosity setting)."""


class Reasoning(BaseModel):
    """reasoning: {"effort", "summary"} (ignored: no hidden reasoning, no summary of it)."""

    model_config = ConfigDict(extra="forbid")
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None  # (the older name of summary)


class ContextManagement(BaseModel):
    """{"type": "compaction", "compact_threshold"}: a create whose history since its last compaction
    holds more tokens (default: max_prompt_tokens) compacts it first (responses.autocompact)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["compaction"]
    compact_threshold: int | None = Field(None, ge=1, le=2**31 - 1)


class StreamOptions(BaseModel):
    """stream_options: {"include_obfuscation"} (ignored: the events carry no obfuscation padding)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    include_obfuscation: bool | None = None


class PromptCacheOptions(BaseModel):
    """prompt_cache_options: caching hints, honoured as they are (every response's state is kept
    anyway); only `prewarm: true` asks for something else (checked by the route)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    mode: Literal["implicit", "explicit"] | None = None
    ttl: Literal["30m", "12h"] | None = None
    prewarm: bool | None = None
    comparison_response_id: str | None = None  # (cache diagnostics: none here)


def _bounds(name: str) -> Any:
    lo, hi = LIMITS[name]
    return Field(None, ge=lo, le=hi)


_INPUT = Annotated[
    Annotated[str, Tag("str")]
    | Annotated[list[ResponseItem], Field(min_length=1, max_length=MAX_INPUT_ITEMS), Tag("list[ResponseItem]")],
    Discriminator(lambda v: "str" if isinstance(v, str) else "list[ResponseItem]"),  # (errors: the list's only)
]


class HistoryInput(BaseModel):
    """The fields that make a history: a compaction's whole body (CompactRequest), a response's
    first (ResponseInput)."""

    # as SamplingFields: no coercion of types, no NaN or infinities
    model_config = ConfigDict(extra="forbid", populate_by_name=True, strict=True, allow_inf_nan=False)
    error_status: ClassVar[int] = 400

    model: str | None = None  # any name: this server serves one model
    input: _INPUT | None = None
    """Required on create; the count of none is that of the instructions and the history."""
    instructions: str | None = None
    """A system turn before the input (not carried to a later response, as OpenAI does)."""
    previous_response_id: str | None = Field(None, min_length=1, max_length=80)


class CompactRequest(HistoryInput):
    """The body of POST /v1/responses/compact: the history to compact (server.api.responses.compaction)."""

    image: dict[str, Any] | None = None  # null only: no image input here (refused by the route)
    # ignored: they cannot change the compaction
    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    prompt_cache_options: PromptCacheOptions | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None


class ResponseInput(HistoryInput):
    """The fields that make a response's prompt: the body of POST /v1/responses/input_tokens (which
    counts that prompt's tokens), and the first fields of ResponseRequest's."""

    text: TextOptions | None = None
    tools: list[Any] | None = None
    """Function tools, {"type": "function", "name", "description", "parameters", "strict"}
    (server.api.openai.tools.plan checks them: a 400 naming the tool's field)."""
    tool_choice: str | dict[str, Any] | None = None
    """"none", "auto" (the default), "required" or {"type": "function", "name"}."""
    parallel_tool_calls: bool | None = None
    reasoning: Reasoning | None = None
    """Ignored, as chat's reasoning_effort: the model does not reason in hidden tokens."""
    conversation: str | dict[str, Any] | None = None
    """A conversation's id, or {"id"}: its items come before the input, and the response's items
    join it (server.api.responses.conversation); not with previous_response_id."""
    truncation: Literal["auto", "disabled"] | None = None  # ignored: a history is never cut


class ResponseRequest(ResponseInput):
    input: _INPUT  # (required here)
    max_output_tokens: MaxTokens = None
    temperature: Annotated[float | None, _bounds("temperature")] = None
    top_p: Annotated[float | None, _bounds("top_p")] = None
    seed: Annotated[int | None, _bounds("seed")] = None  # RWKV extra
    store: bool = True
    stream: bool = False
    include: list[str] | None = None
    """Extra output data to include: "message.output_text.logprobs" (the message's logprobs:
    server.api.responses.logprobs); the others ask for items never made here
    (checks.NOTHING_TO_INCLUDE: accepted, adding nothing)."""
    metadata: Metadata = None
    """Stored with the response and shown with it (OpenAI's bounds: 16 pairs, keys of at most 64
    characters, values of at most 512)."""
    background: bool | None = None
    """True: the run is not tied to the request (read back by GET, stopped by POST .../cancel:
    server.api.responses.background); it needs `store`."""
    max_tool_calls: int | None = Field(None, ge=0, le=2**31 - 1)
    """A bound on calls to built-in tools (OpenAI's meaning: function calls are not counted):
    there are none here, so it bounds nothing; echoed. `parallel_tool_calls` bounds a reply's
    function calls to one."""
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    """The alternatives per token of the message's logprobs (with include's
    "message.output_text.logprobs"; without it none are returned, as OpenAI's)."""
    context_management: list[ContextManagement] | None = Field(None, max_length=1)  # [] asks nothing
    # null only (the route refuses a value: unsupported_field, naming it and why; typed as the
    # SDK sends them, so a value is refused as unsupported, not as malformed)
    prompt: dict[str, Any] | None = None
    """A stored prompt ({"id", "version", "variables"}): no prompt templates here."""
    access_programs: dict[str, Any] | None = None
    background_options: dict[str, Any] | None = None
    image: dict[str, Any] | None = None
    moderation: dict[str, Any] | None = None
    # caching hints: every response's state is kept anyway (docs/agents.md)
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    prompt_cache_options: PromptCacheOptions | None = None
    # ignored: they cannot change the answer
    stream_options: StreamOptions | None = None
    user: str | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None

    @field_validator("store", "stream", mode="before")
    @classmethod
    def _null_is_default(cls, v: Any, info: ValidationInfo) -> Any:
        """null is the field's default (as on chat; SDKs send null for a field not set)."""
        return cls.model_fields[info.field_name].default if v is None and info.field_name else v

"""Request bodies of the rwkv_lightning routes: lightning's field names, its defaults per route
(its document: V1 / FIM / state routes share one set, V2, big-batch, translate and its
OpenAI-style route have their own), our bounds (server.engine.types.LIMITS).

As on lightning, unknown fields are accepted and ignored (its clients send `pad_zero`, `noise`,
...): these bodies do not follow our routes' unknown-fields policy. A value of the wrong type or
outside the bounds is a 400 in our error shape naming the field (the app's validation handler).
Lightning's names map onto ours: alpha_presence = presence_penalty, alpha_frequency =
repetition_penalty, alpha_decay = penalty_decay, stop_tokens = stop (strings).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator
from typing_extensions import Self

from server.api.errors import ApiError
from server.api.openai.schemas import ChatRequest
from server.api.sampling import bad_text
from server.engine.types import LIMITS, SamplingParams, check_fields

if TYPE_CHECKING:
    from server.api.services import Services


def _bounded(name: str) -> Any:
    lo, hi = LIMITS[name]
    return Field(ge=lo, le=hi)


MaxTokens = Annotated[int, _bounded("max_tokens")]
Temperature = Annotated[float, _bounded("temperature")]
TopK = Annotated[int, _bounded("top_k")]
TopP = Annotated[float, _bounded("top_p")]
Alpha = Annotated[float, _bounded("presence_penalty")]
Decay = Annotated[float, _bounded("penalty_decay")]


def _at_least_one(n: int) -> int:
    return max(1, n)


def _no_empty(stops: list[str]) -> list[str]:
    return [s for s in stops if s]


ChunkSize = Annotated[
    int,
    AfterValidator(_at_least_one),
    Field(description="tokens per streamed flush (0 or less: 1, as lightning; more than the answer: one flush)"),
]
"""lightning's chunk_size: its batch stream flushes every token at 0 (and below), its state stream
takes max(1, chunk_size); it has no upper bound, and a value larger than the answer simply
flushes once, at the end (the flush rule compares token counts: any size works)."""
StopTokens = Annotated[list[str], AfterValidator(_no_empty), Field(description="stop strings (empty ones dropped)")]
"""lightning's stop_tokens: empty strings are dropped, as lightning does (a stop string that
matches everywhere would end every answer at once); the rest are checked as our `stop`."""
USER_STOP = ["\nUser:"]
OUR_NAMES = {
    "stop": "stop_tokens",
    "presence_penalty": "alpha_presence",
    "repetition_penalty": "alpha_frequency",
    "penalty_decay": "alpha_decay",
}


def limits(sv: Services) -> tuple[int, int]:
    """(vocab_size, max_tokens_limit): what `sampling()` checks a request against."""
    return sv.shape.vocab_size, sv.settings.max_tokens_limit


def capped(fields: dict[str, Any], max_tokens_limit: int) -> dict[str, Any]:
    """fields with max_tokens at most the server's Settings.max_tokens_limit (0: no limit).
    lightning has no such bound and its defaults are large (8192), so its clients get the
    limit rather than an error they would not expect."""
    if max_tokens_limit and int(fields.get("max_tokens", 0)) > max_tokens_limit:
        return {**fields, "max_tokens": max_tokens_limit}
    return fields


def sampling_params(fields: dict[str, Any], vocab_size: int, max_tokens_limit: int = 0) -> SamplingParams:
    """SamplingParams from fields by our names (all given), checked: a 400 naming the field by
    lightning's name when one cannot be used (e.g. a stop string over 256 characters)."""
    fields = capped(fields, max_tokens_limit)
    try:
        check_fields(fields, vocab_size)
    except ValueError as exc:
        msg = str(exc)
        name = next((k for k in fields if f"'{k}'" in msg), None)
        if name in OUR_NAMES:
            msg = msg.replace(f"'{name}'", f"'{OUR_NAMES[name]}'")
        raise ApiError(400, msg, param=OUR_NAMES.get(name or "", name), code="invalid_request") from None
    return SamplingParams.from_fields(fields, int(fields["max_tokens"]))


class Credential(BaseModel):
    model_config = ConfigDict(extra="ignore")
    password: str | None = Field(None, description="an API key of this server (or send Authorization: Bearer)")

    @model_validator(mode="after")
    def _valid_text(self) -> Self:
        """Every string of a lightning body (of every body: they all derive from this one) is
        valid Unicode text. A lone surrogate (JSON's "\\ud800" escapes parse, UTF-8 cannot carry
        one) could be neither tokenized faithfully nor stored nor echoed in the answer (`model`,
        `session_id`, `source_lang` are). Raised as an ApiError, which pydantic and FastAPI pass
        through (only a ValueError would become a validation error): a 400 naming the field,
        before the route runs."""
        bad = bad_text(self)
        if bad is not None:
            raise ApiError(400, f"invalid '{bad[0]}': {bad[1]}", param=bad[0], code="invalid_request")
        return self


class NativeFields(Credential):
    """The fields of lightning's native routes (V1, FIM, state), with its defaults."""

    model: str = Field("rwkv7", description="a label for the answer; this server serves one model")
    max_tokens: MaxTokens = 8192
    stop_tokens: StopTokens = Field(default_factory=lambda: list(USER_STOP))
    temperature: Temperature = 1.0
    top_k: TopK = 50
    top_p: TopP = 0.6
    alpha_presence: Alpha = 2.0
    alpha_frequency: Alpha = 0.2
    alpha_decay: Decay = 0.996
    stream: bool = False
    chunk_size: ChunkSize = 4
    pad_zero: bool | None = Field(None, description="accepted, no effect: every prompt is its own sequence")
    ignore_eos: bool = Field(False, description="(ours) keep generating past the end-of-text token")

    def fields(self, stop: list[str] | None = None) -> dict[str, Any]:
        """The sampling fields by our names (stop: these strings instead of stop_tokens)."""
        return {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_k": self.top_k,
            "top_p": self.top_p,
            "presence_penalty": self.alpha_presence,
            "repetition_penalty": self.alpha_frequency,
            "penalty_decay": self.alpha_decay,
            "stop": list(self.stop_tokens if stop is None else stop),
            "ignore_eos": self.ignore_eos,
        }

    def sampling(self, vocab_size: int, max_tokens_limit: int = 0, stop: list[str] | None = None) -> SamplingParams:
        return sampling_params(self.fields(stop), vocab_size, max_tokens_limit)


class LightningV1Body(NativeFields):
    """POST /v1/chat/completions with `contents` (a body with `messages` is the OpenAI route's)."""

    contents: list[str] = Field(default_factory=list, description="prompts (raw text), one choice each")


class LightningV2Body(LightningV1Body):
    """POST /v2/chat/completions: V1's fields, the V2 sampler's defaults."""

    top_k: TopK = 500
    top_p: TopP = 0.5
    alpha_presence: Alpha = 1.0
    alpha_frequency: Alpha = 0.1
    alpha_decay: Decay = 0.99


def chat_kind(v: Any) -> str:
    """Which body POST /v1/chat/completions got: `contents` without `messages` is lightning's."""
    if isinstance(v, dict):
        return "LightningV1Body" if "contents" in v and not v.get("messages") else "ChatRequest"
    return type(v).__name__ if isinstance(v, (ChatRequest, LightningV1Body)) else "ChatRequest"


ChatOrContents = Annotated[
    Annotated[ChatRequest, Tag("ChatRequest")] | Annotated[LightningV1Body, Tag("LightningV1Body")],
    Discriminator(chat_kind),
]
"""The body of POST /v1/chat/completions: an OpenAI chat request, or lightning's batch (oneOf in
the OpenAPI document; errors name the field of the body it was taken for)."""


class BigBatchBody(Credential):
    """POST /big_batch/completions: temperature is its only sampling field; always streamed."""

    contents: list[str] = Field(default_factory=list)
    max_tokens: MaxTokens = 8192
    stop_tokens: StopTokens = Field(default_factory=lambda: list(USER_STOP))
    temperature: Temperature = 1.0
    chunk_size: ChunkSize = 4
    stream: bool = Field(True, description="ignored: this route always streams")
    ignore_eos: bool = Field(False, description="(ours) keep generating past the end-of-text token")

    def sampling(self, vocab_size: int, max_tokens_limit: int = 0) -> SamplingParams:
        return sampling_params(
            {
                "max_tokens": self.max_tokens,
                "temperature": self.temperature,
                "top_k": 0,
                "top_p": 1.0,
                "presence_penalty": 0.0,
                "repetition_penalty": 0.0,
                "stop": list(self.stop_tokens),
                "ignore_eos": self.ignore_eos,
            },
            vocab_size,
            max_tokens_limit,
        )


class FimBody(NativeFields):
    """POST /FIM/v1/batch-FIM: prefix[i] and suffix[i] make prompt i; stop_tokens is ignored."""

    prefix: list[str] = Field(default_factory=list)
    suffix: list[str] = Field(default_factory=list)


class TranslateBody(Credential):
    """POST /translate/v1/batch-translate (the Immersive Translate custom API)."""

    source_lang: str = "auto"
    target_lang: str
    text_list: list[str]
    placeholders: list[str] | None = Field(None, description="accepted, not used")
    max_tokens: MaxTokens = Field(2048, description="(ours) tokens per translation; lightning's fixed 2048")


class StateBody(NativeFields):
    """POST /state/chat/completions: one prompt, continuing the session's state."""

    session_id: str | None = None
    contents: list[str] = Field(default_factory=list, description="exactly one prompt")


class MultiStateBody(StateBody):
    """POST /multi_state/chat/completions: `dialogue_idx` (a required key; 0 or null = a new
    root, as lightning's `int(dialogue_idx or 0)`)."""

    dialogue_idx: int | None = 0


class DeleteBody(Credential):
    session_id: str | None = None
    delete_prefix: bool | None = False  # null: false (lightning reads `body.get("delete_prefix", False)`)


class ChatMessage(BaseModel):
    """A message of lightning's OpenAI-style route: any role (system, developer, user and
    assistant are used, others ignored); text content, or parts of which the text ones are read."""

    model_config = ConfigDict(extra="ignore")
    role: str = "user"
    content: str | list[dict[str, Any] | str] | None = None


class ChatStyleBody(NativeFields):
    """POST /openai/v1/chat/completions: lightning's single-choice chat, with its defaults."""

    messages: list[ChatMessage] = Field(default_factory=list)
    system: str | None = None
    contents: list[str] = Field(default_factory=list, description="the first one is a user message")
    max_tokens: MaxTokens = 4096
    top_k: TopK = 20
    alpha_presence: Alpha = 1.0
    alpha_frequency: Alpha = 0.1
    enable_think: bool = False
    use_prefix_cache: bool = Field(True, description="take the system block's state from the chat-prefix cache")
    chunk_size: ChunkSize | None = None  # type: ignore[assignment]
    """Tokens per streamed flush (lightning: 1 when streamed)."""

"""The sampling fields every generation route accepts: one set of names, bounds and defaults, and
the one mapping from a request to `SamplingParams`.

Both route families build their request bodies on `SamplingFields`: the OpenAI routes
(server.api.openai.schemas, errors 400) and the task routes (server.api.tasks.schemas, errors 422).
- Bounds: `server.engine.types.LIMITS` (checked by pydantic, so the error names the field), then
  `checked_fields` before anything is submitted: every string of the body is valid Unicode text
  (no lone surrogate, which no UTF-8 byte sequence can carry), max_tokens within
  `Settings.max_tokens_limit`, and `check_fields` (stop strings: count, length; stop_token_ids
  inside the vocabulary).
- Defaults: a field that is absent (or null) takes `SamplingParams`' default (max_tokens:
  `Settings.default_max_tokens`); the mapping is `SamplingParams.from_fields`.
- The OpenAI names map onto ours: `frequency_penalty` is `repetition_penalty` (RWKV's
  alpha_frequency), `max_completion_tokens` is `max_tokens`.

Types are strict (pydantic's strict mode, inherited by every request body built on
`SamplingFields`): a value of the wrong JSON type is refused naming the field, never coerced.

Unknown fields, on every route: a field that no route knows is refused with an error that names
it ("unknown field 'x'": 400 on the OpenAI routes, 422 on the task routes), never silently
ignored. The OpenAI routes accept every field of the official OpenAI API for their endpoint and
either honour it, ignore it where ignoring cannot change the answer (user, metadata, store,
service_tier, prompt_cache_key, ...), or refuse it with a 400 naming it where ignoring would
change the answer's meaning (the legacy functions, a non-empty logit_bias, audio, ...): see
server.api.openai.schemas (tools, response_format and logprobs are honoured: docs/agents.md).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from server.api.errors import ApiError
from server.engine.types import FIELDS, LIMITS, MAX_STOP_TOKEN_IDS, SamplingParams, check_fields
from server.tokenizer.vocab import VOCAB_SIZE


def _bounds(name: str, doc: str = "") -> Any:
    lo, hi = LIMITS[name]
    return Field(ge=lo, le=hi, description=doc or None)


MaxTokens = Annotated[int | None, _bounds("max_tokens", "tokens to generate; 0 = prefill only")]
TokenId = Annotated[StrictInt, Field(ge=0, lt=VOCAB_SIZE)]
"""A token id: a JSON integer (never a bool or a float) in the tokenizer's id space; the loaded
model's vocabulary is checked too before anything is submitted."""
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
Text = Annotated[str, Field(min_length=1)]
"""A prompt text: never empty."""
Penalty = Annotated[float | None, _bounds("repetition_penalty")]
_FIELD_IN_MESSAGE = re.compile(r"^invalid '(\w+)'")


class SamplingFields(BaseModel):
    """The sampling fields (all optional: absent = the server's default)."""

    # strict: a wrong JSON type is refused, never converted ("5" or true for an int, "yes" for a
    # bool, 2.0 for an int), as OpenAI's API refuses them; an integer is still a valid float.
    # allow_inf_nan=False: NaN and the infinities (Python's JSON parser reads them) are "not a
    # finite number", not "above the maximum" as the bounds would say
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
    error_status: ClassVar[int] = 422
    """HTTP status of a bad value found after parsing (the route family's validation status)."""

    max_tokens: MaxTokens = None
    temperature: Annotated[float | None, _bounds("temperature", "0 = greedy")] = None
    top_p: Annotated[float | None, _bounds("top_p")] = None
    top_k: Annotated[int | None, _bounds("top_k", "-1 or 0 = no top-k cut")] = None
    presence_penalty: Annotated[float | None, _bounds("presence_penalty")] = None
    repetition_penalty: Penalty = None
    penalty_decay: Annotated[float | None, _bounds("penalty_decay")] = None
    seed: Annotated[int | None, _bounds("seed")] = None
    stop: Annotated[str | list[str] | None, Field(description="stop strings (never part of the text)")] = None
    stop_token_ids: Annotated[list[TokenId] | None, Field(max_length=MAX_STOP_TOKEN_IDS)] = None
    ignore_eos: Annotated[bool | None, Field(description="keep generating past the end-of-text token")] = None

    def sampling_fields(self) -> dict[str, Any]:
        """The given sampling fields by our names (FIELDS), unchecked."""
        return {k: v for k in FIELDS if (v := getattr(self, k)) is not None}

    def checked_fields(self, vocab_size: int, max_tokens_limit: int = 0) -> dict[str, Any]:
        """sampling_fields() once the whole body passed the checks made before anything is
        submitted (valid text everywhere, max_tokens within `max_tokens_limit` when that is not
        0, `check_fields`): an ApiError naming the field otherwise."""
        bad = bad_text(self)
        if bad is not None:
            raise self.invalid(f"invalid '{bad[0]}': {bad[1]}", bad[0])
        fields = self.sampling_fields()
        if max_tokens_limit and fields.get("max_tokens", 0) > max_tokens_limit:
            name = self.max_tokens_name()
            raise self.invalid(
                f"invalid '{name}': {fields['max_tokens']} is above this server's limit of {max_tokens_limit} tokens",
                name,
            )
        try:
            check_fields(fields, vocab_size)
        except ValueError as exc:
            m = _FIELD_IN_MESSAGE.match(str(exc))
            raise self.invalid(str(exc), m.group(1) if m else None) from None
        return fields

    def max_tokens_name(self) -> str:
        """The name the request gave max_tokens under."""
        return "max_tokens"

    def sampling_params(self, vocab_size: int, default_max_tokens: int, max_tokens_limit: int = 0) -> SamplingParams:
        """The request's SamplingParams (absent fields: the defaults)."""
        return SamplingParams.from_fields(self.checked_fields(vocab_size, max_tokens_limit), default_max_tokens)

    @classmethod
    def invalid(cls, message: str, param: str | None) -> ApiError:
        return ApiError(cls.error_status, message, param=param, code="invalid_request")


def bad_text(value: Any, path: str = "") -> tuple[str, str] | None:
    """(field, why) of the first string in a parsed body that is not valid Unicode text (a lone
    surrogate: JSON's \\ud800 escapes parse, but no UTF-8 can carry one, so it could be neither
    tokenized faithfully nor stored nor answered), or None. A string inside a list is named by
    the list (`stop`, `prompt`); one inside an object of a list by its place (`messages[0].content`).
    Walks with its own stack, in document order: a body may nest as deep as the JSON parser
    allows, past Python's recursion limit."""
    stack: list[tuple[str, Any]] = [(path, value)]
    while stack:
        at, v = stack.pop()
        if isinstance(v, str):
            why = _surrogate(v)
            if why is not None:
                return at, why
        else:
            stack.extend(reversed(_children(at, v)))
    return None


def _surrogate(text: str) -> str | None:
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"not valid UTF-8 text: a lone surrogate U+{ord(text[exc.start]):04X} at character {exc.start}"
    return None


def _children(path: str, value: Any) -> list[tuple[str, Any]]:
    """bad_text's (path, value) pairs under one value, in order (an object's keys are text too)."""
    if isinstance(value, BaseModel):
        items: Any = [(k, getattr(value, k)) for k in type(value).model_fields]
        items += list((value.model_extra or {}).items())
        return [((f"{path}.{k}" if path else k), v) for k, v in items]
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in ((path, k), ((f"{path}.{k}" if path else str(k)), v))]
    if isinstance(value, (list, tuple)):
        return [((path if isinstance(v, str) else f"{path}[{i}]"), v) for i, v in enumerate(value)]
    return []

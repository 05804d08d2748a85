"""The checks of a /v1/responses body that no schema expresses: text that is no valid Unicode,
and fields the server knows but cannot honour (a 400 `unsupported_field` naming the field)."""

from __future__ import annotations

from server.api.errors import ApiError
from server.api.responses.logprobs import LOGPROBS
from server.api.responses.schemas import HistoryInput, ResponseInput, ResponseRequest
from server.api.sampling import bad_text

NOTHING_TO_INCLUDE = frozenset({
    "file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
    "message.input_image.image_url", "computer_call_output.output.image_url", "code_interpreter_call.outputs",
    "reasoning.encrypted_content",
})  # fmt: skip
"""`include` values that ask for data of items this server never makes (no built-in tools, image
input or reasoning items): accepted, adding nothing (some clients send
`reasoning.encrypted_content` with every request). The other value OpenAI knows,
`message.output_text.logprobs` (LOGPROBS), asks for the message's logprobs (logprobs.py)."""


def check_text(body: HistoryInput) -> None:
    """A 400 naming the first text of the body that is no valid Unicode."""
    bad = bad_text(body)
    if bad is not None:
        raise ApiError(400, f"invalid '{bad[0]}': {bad[1]}", param=bad[0], code="invalid_request")


def check_input(body: ResponseInput) -> None:
    """A 400 for text that is no valid Unicode, or both a conversation and a previous response."""
    check_text(body)
    if body.conversation is not None and body.previous_response_id is not None:
        raise ApiError(400, "conversation and previous_response_id are mutually exclusive: give one of them",
                       param="conversation", code="invalid_request")  # fmt: skip


def check_supported(body: ResponseRequest) -> None:
    """A 400 unsupported_field naming a given field this route cannot honour."""
    check_input(body)
    if body.conversation is not None and not body.store:
        raise ApiError(400, "store: false in a conversation (a response's items join the conversation, so it is "
                       "stored): omit store, or send the history as input without conversation", param="store",
                       code="invalid_request")  # fmt: skip
    if body.background and not body.store:
        raise ApiError(400, "background: true with store: false (a background response is read back by its id, "
                       "so it is stored): omit store, or leave background out", param="background",
                       code="invalid_request")  # fmt: skip
    _check_include(body.include or [])
    refused = {  # field -> why, where its value asks for what this route does not do
        "prompt": body.prompt is not None
        and "prompt (stored prompt templates: send the prompt's text as instructions and input)",
        "access_programs": body.access_programs is not None and "access_programs",
        "background_options": body.background_options is not None and "background_options",
        "image": body.image is not None and "image (no image input here)",
        "moderation": body.moderation is not None and "moderation (no moderation policies)",
        "prompt_cache_options.prewarm": body.prompt_cache_options is not None
        and body.prompt_cache_options.prewarm
        and "prompt_cache_options.prewarm (for a response with no output, send max_output_tokens: 0)",
    }
    for param, why in refused.items():
        if why:
            raise ApiError(400, f"{why} is not supported on /v1/responses", param=param, code="unsupported_field")


def _check_include(include: list[str]) -> None:
    """A 400 naming `include` for a value OpenAI does not know (a typo would otherwise ask for nothing)."""
    for i, value in enumerate(include):
        if value not in NOTHING_TO_INCLUDE and value != LOGPROBS:
            known = ", ".join(sorted(NOTHING_TO_INCLUDE | {LOGPROBS}))
            raise ApiError(400, f"invalid 'include[{i}]': {value!r} is none of {known}", param=f"include[{i}]",
                           code="invalid_request")  # fmt: skip

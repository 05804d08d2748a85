"""Checking a request's grammar before anything starts: the response_format mapping
(server.tasks.response_format.format_grammar) and the engine's compile, in a worker thread (the
first compile builds the vocabulary tables and imports the library: seconds, once), so a schema the
engine refuses is the request's error (400 on the OpenAI routes, 422 on the task routes) and
never reaches a submission. docs/agents.md."""

from __future__ import annotations

import asyncio
from typing import Any

from server.api.errors import ApiError
from server.api.services import Services
from server.engine.types import GrammarSpec
from server.tasks.response_format import format_grammar


async def compiled(sv: Services, spec: GrammarSpec, *, param: str, status: int = 400) -> GrammarSpec:
    """spec, once the engine compiled it (cached there for the submission); ApiError otherwise."""
    try:
        spec.check()
        await asyncio.to_thread(sv.engine.compile_grammar, spec)
    except ValueError as exc:
        raise ApiError(status, f"invalid '{param}': {exc}", param=param, code="invalid_schema") from None
    return spec


async def response_grammar(
    sv: Services, fmt: Any, *, param: str = "response_format", status: int = 400
) -> GrammarSpec | None:
    """The compiled grammar of a response_format (None: plain text, or no format given)."""
    spec = format_spec(fmt, param=param, status=status)
    return None if spec is None else await compiled(sv, spec, param=param, status=status)


def format_spec(fmt: Any, *, param: str = "response_format", status: int = 400) -> GrammarSpec | None:
    """The grammar of a response_format, not compiled yet (None: plain text, or no format given);
    ApiError for a format that is no grammar at all."""
    if fmt is None:
        return None
    try:
        return format_grammar(fmt)
    except ValueError as exc:
        raise ApiError(
            status, str(exc).replace("'response_format'", f"'{param}'"), param=param, code="invalid_request"
        ) from None

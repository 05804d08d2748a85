"""One prefill-only request through the engine's API: the state after a run of tokens, for the
callers that keep states (a template made from a task whose state is gone, the conversation cache,
the chat-prefix cache). Not the engine's own code: a client of EngineAPI, on the event loop."""

from __future__ import annotations

from collections.abc import Sequence

from server.engine.protocol import EngineAPI, StateLike
from server.engine.types import LENGTH, STOP, RequestFailedError, SamplingParams


async def prefill_state(
    engine: EngineAPI,
    tokens: Sequence[int],
    *,
    request_id: str,
    init_state: StateLike | None = None,
    history: int = 0,
    what: str = "prefill",
) -> StateLike:
    """The state after feeding every one of `tokens` from `init_state` (None: zeros); `history`
    as EngineAPI.submit's. RequestFailedError (naming `what`) when the engine ends it otherwise;
    a caller that leaves aborts it."""
    h = engine.submit(
        list(tokens),
        SamplingParams(max_tokens=0),
        init_state=init_state,
        return_state=True,
        request_id=request_id,
        history=history,
    )
    try:
        res = await h.wait()
    except BaseException:
        h.abort()
        raise
    if res.state is None or res.pending_tokens or res.finish_reason not in (STOP, LENGTH):
        unfed = f", {len(res.pending_tokens)} token(s) unfed" if res.pending_tokens else ""
        raise RequestFailedError(f"{what} failed: {res.error or res.finish_reason}{unfed}")
    return res.state

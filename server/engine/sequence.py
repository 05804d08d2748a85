"""`EngineSeq`: one request as the scheduler sees it: token ids and progress, no text (the text
is its `text.RequestText`'s, the output processor's). Pure Python (no torch).

Token accounting (the invariant the engine's returned state relies on):

    tokens fed into the slot's state  = prompt[:n_fed] + output_ids[:n_out_fed]
    pending_tokens                    = prompt[n_fed:] + output_ids[n_out_fed:]

While decoding, the last generated token is the only pending one; it is fed by the next decode
row. A stop token (EOS or one of `stop_token_ids`) is never appended to `output_ids` nor fed.
"""

from __future__ import annotations

import time
from typing import Any

from .types import EOS_TOKEN, SamplingParams

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"


class EngineSeq:
    """Created by the engine at submission, driven by the scheduler."""

    def __init__(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        *,
        seed: int = 0,
        init_state: Any = None,
        return_state: bool = False,
    ):
        self.request_id = request_id
        self.prompt = prompt
        self.params = params
        self.seed = seed
        """Resolved seed of the random stream (params.seed, or one drawn at submission)."""
        self.init_state = init_state
        """Starting state (batch-1 State) until the admission hands it to the runner."""
        self.return_state = return_state
        self.status = WAITING
        self.slot = -1
        self.n_fed = 0
        self.n_out_fed = 0
        self.output_ids: list[int] = []
        self.finish_reason: str | None = None
        self.stop_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos and params.grammar is None else frozenset((EOS_TOKEN,))
        )  # a grammar allows EOS only where its text may end: there it ends the request
        self.has_stops = has_stop_strings(params)
        """Its end also depends on its text: decided by the output processor's stop check."""
        self.t_submit = time.monotonic()
        self.t_first: float | None = None

    @property
    def prefilling(self) -> bool:
        return self.n_fed < len(self.prompt)

    @property
    def finished(self) -> bool:
        return self.status == FINISHED

    def pending_tokens(self) -> list[int]:
        """Tokens of prompt + output not yet fed into this sequence's state."""
        return self.prompt[self.n_fed :] + self.output_ids[self.n_out_fed :]


def has_stop_strings(params: SamplingParams) -> bool:
    return any(params.stop)

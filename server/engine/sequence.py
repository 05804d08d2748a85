"""Per-sequence bookkeeping: prompt progress, generated tokens, text with stop strings held back.

Pure Python (no torch): the scheduler and its unit tests use it without a model.

Token accounting of one sequence (the invariant the engine's returned state relies on):

    tokens fed into the slot's state  = prompt[:n_fed] + output_ids[:n_out_fed]
    pending_tokens                    = prompt[n_fed:] + output_ids[n_out_fed:]

While decoding, the last generated token is the only pending one; it is fed by the next decode
row. A stop token (EOS or one of `stop_token_ids`) is never appended to `output_ids` nor fed.
"""

from __future__ import annotations

import codecs
import time
from typing import Any, Protocol, Sequence as Seq

from .types import ABORT, EOS_TOKEN, ERROR, LENGTH, STOP, Event, SamplingParams

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"


class TextDecoder(Protocol):
    """What the sequence needs from a detokenizer (`server.tokenizer.IncrementalDecoder`)."""

    def push(self, ids: list[int]) -> str: ...

    def flush(self) -> str: ...


class FastDecoder:
    """`IncrementalDecoder` semantics (a UTF-8 incremental decoder with errors="replace" over the
    tokens' bytes) with one table lookup per token: the engine's per-token detokenizer."""

    _tables: dict[int, tuple[Any, tuple[bytes, ...]]] = {}  # id(tokenizer) -> (tokenizer, bytes per id)

    def __init__(self, tokenizer: Any, vocab_size: int = 65536):
        entry = FastDecoder._tables.get(id(tokenizer))
        if entry is None or entry[0] is not tokenizer:
            n = getattr(tokenizer, "vocab_size", vocab_size)
            entry = (tokenizer, tuple(tokenizer.token_bytes(i) for i in range(n)))
            FastDecoder._tables[id(tokenizer)] = entry
        self._table = entry[1]
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._decode = self._utf8.decode

    def push_one(self, token: int) -> str:
        return self._decode(self._table[token])

    def push(self, ids: list[int]) -> str:
        return self._decode(b"".join(self._table[t] for t in ids))

    def flush(self) -> str:
        out = self._decode(b"", True)
        self._utf8.reset()
        return out


class StopMatcher:
    """Finds stop strings in streamed text, holding back any tail that could still start one.

    `feed(text)` returns (text safe to emit, matched). Once matched, the text from the start of
    the stop string on is dropped. `flush()` releases the held-back tail at the end.
    """

    def __init__(self, stops: Seq[str]):
        self.stops = tuple(s for s in stops if s)
        self.held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        if not self.stops:
            return text, False
        buf = self.held + text
        cut = min((i for i in (buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.held = ""
            return buf[:cut], True
        keep = self._longest_partial(buf)
        self.held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep], False

    def _longest_partial(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of some stop string."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:n]):
                    best = n
                    break
        return best

    def flush(self) -> str:
        out, self.held = self.held, ""
        return out


class Sequence:
    """One request inside the engine (created by the engine, driven by the scheduler)."""

    def __init__(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        decoder: TextDecoder,
        *,
        seed: int = 0,
        init_state: Any = None,
        return_state: bool = False,
        sink: Any = None,
    ):
        self.request_id = request_id
        self.prompt = prompt
        self.params = params
        self.decoder = decoder
        self._push_one = getattr(decoder, "push_one", None) or (lambda t: decoder.push([t]))
        self.seed = seed
        """Resolved seed of the random stream (params.seed, or one drawn at submission)."""
        self.init_state = init_state
        """Starting state (batch-1 State) until the runner copied it into the slot."""
        self.return_state = return_state
        self.sink = sink
        """The engine's handle for this sequence (opaque to the scheduler)."""
        self.status = WAITING
        self.slot = -1
        self.state_queued = False
        """True once the scheduler queued the copy-out of this sequence's final state."""
        self.n_fed = 0
        self.n_out_fed = 0
        self.output_ids: list[int] = []
        self.text_parts: list[str] = []
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.stop_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else frozenset((EOS_TOKEN,))
        )
        self.matcher = StopMatcher(params.stop)
        self._has_stops = bool(self.matcher.stops)
        self.t_submit = time.monotonic()
        self.t_first: float | None = None
        self.t_finish: float | None = None

    # --- queries --------------------------------------------------------------------------
    @property
    def prefilling(self) -> bool:
        return self.n_fed < len(self.prompt)

    @property
    def finished(self) -> bool:
        return self.status == FINISHED

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    def pending_tokens(self) -> list[int]:
        """Tokens of prompt + output not yet fed into this sequence's state."""
        return self.prompt[self.n_fed :] + self.output_ids[self.n_out_fed :]

    # --- state changes (called by the scheduler) ------------------------------------------
    def consume(self, n_prompt: int) -> None:
        """This step fed n_prompt prompt tokens (prefill), or the pending output token (0)."""
        if n_prompt:
            self.n_fed += n_prompt
            if not self.prefilling and self.t_first is None and self.params.max_tokens == 0:
                self.t_first = time.monotonic()
        else:
            self.n_out_fed += 1

    def add_token(self, token: int) -> Event | None:
        """Record a sampled token; return this step's event (finishing the sequence if needed)."""
        if self.t_first is None:
            self.t_first = time.monotonic()
        if token in self.stop_ids:
            return self.finish(STOP)
        out = self.output_ids
        out.append(token)
        text = self._push_one(token)
        if self._has_stops:
            text, matched = self.matcher.feed(text)
            if matched:
                return self._finish_event(STOP, [token], text)
        if len(out) >= self.params.max_tokens:
            return self._finish_event(LENGTH, [token], text + self._flush_text())
        self.text_parts.append(text)
        return Event(text, [token], len(out))

    # --- the split form of add_token (engine fast path: ids before the next launch, text after) ---
    def record(self, token: int) -> bool:
        """The id-only part of add_token (no text): count the token, decide a stop token id or
        max_tokens; True if the sequence finished. Only for sequences WITHOUT stop strings (their
        end depends on text). `emit(token)` must follow, before anything else touches the sequence."""
        if self.t_first is None:
            self.t_first = time.monotonic()
        if token in self.stop_ids:
            self._end(STOP)
            return True
        out = self.output_ids
        out.append(token)
        if len(out) >= self.params.max_tokens:
            self._end(LENGTH)
            return True
        return False

    def emit(self, token: int) -> Event:
        """The text part of add_token after record(token): the same Event add_token returns."""
        reason = self.finish_reason
        if reason is None:
            text = self._push_one(token)
            self.text_parts.append(text)
            return Event(text, [token], len(self.output_ids))
        if reason == STOP:  # a stop token id: not emitted
            tail = self._flush_text()
            self.text_parts.append(tail)
            return Event(tail, [], len(self.output_ids), True, STOP)
        text = self._push_one(token) + self._flush_text()
        self.text_parts.append(text)
        return Event(text, [token], len(self.output_ids), True, reason)

    def _end(self, reason: str) -> None:
        self.status = FINISHED
        self.finish_reason = reason
        self.t_finish = time.monotonic()

    def finish(self, reason: str, error: str | None = None) -> Event:
        """End the sequence now (stop token, abort, error, prefill-only done)."""
        self.error = error
        tail = self._flush_text() if reason in (STOP, LENGTH, ABORT) else ""
        return self._finish_event(reason, [], tail)

    def _flush_text(self) -> str:
        text, matched = self.matcher.feed(self.decoder.flush())
        return text if matched else text + self.matcher.flush()

    def _finish_event(self, reason: str, ids: list[int], text: str) -> Event:
        if reason == ERROR:
            text = ""
        self.text_parts.append(text)
        self.status = FINISHED
        self.finish_reason = reason
        self.t_finish = time.monotonic()
        return Event(text, ids, len(self.output_ids), True, reason)

"""The text of one request: its incremental detokenizer, its stop strings, the events it gets.
Pure Python (no torch). Owned by the output processor (output.py), engine thread only.

`RequestText` turns the request's output token ids into `Event`s; `StopRequestText` (a request
with stop strings) holds back any tail of text that could still become a stop string, and is
told each token BEFORE the next step is planned (`match`), because a stop string ends the request.
(The SSE streams that send those events to clients are server.api.streaming's.)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from .plan import Finished
from .sequence import has_stop_strings
from .types import ERROR, STOP, Event, SamplingParams, TokenLogprob

if TYPE_CHECKING:
    from .handle import RequestHandle


class TextDecoder(Protocol):
    """What a RequestText needs from a detokenizer (`server.tokenizer.IncrementalDecoder`)."""

    def push_one(self, token: int) -> str: ...

    def flush(self) -> str: ...


class StopMatcher:
    """Finds stop strings in streamed text, holding back any tail that could still start one.

    `feed(text)` returns (text safe to emit, matched). Once matched, the text from the start of
    the stop string on is dropped. `flush()` releases the held-back tail at the end.
    `shown`: text already emitted before this matcher's (a continued output's end, TextLead):
    a stop string may begin there, and none of it is emitted again.
    `hidden_lead`: the leading whitespace of the fed text is hidden from the client (a chat
    reply's gap after "Assistant:", SamplingParams.hidden_lead): it is emitted as it comes but never part
    of a match; stop strings are matched from its first other character on (`shown` is then
    ignored: nothing before that character can begin a stop string).
    """

    def __init__(self, stops: Sequence[str], shown: str = "", hidden_lead: bool = False):
        self.stops = tuple(s for s in stops if s)
        self.held = ""
        self.skip = 0  # leading characters of `held` that were shown before (from `shown`)
        self.gap = hidden_lead and bool(self.stops)  # still inside the hidden leading whitespace
        if shown and self.stops and not self.gap:
            keep = self._longest_partial(shown)
            self.held, self.skip = shown[len(shown) - keep :], keep

    def feed(self, text: str) -> tuple[str, bool]:
        if not self.stops:
            return text, False
        if self.gap:
            rest = text.lstrip()  # (what the route strips: str.lstrip of the whole reply)
            if not rest:
                return text, False
            self.gap = False
            out, hit = self._feed(rest)
            return text[: len(text) - len(rest)] + out, hit
        return self._feed(text)

    def _feed(self, text: str) -> tuple[str, bool]:
        buf = self.held + text
        cut = min((i for i in (buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.held, skip, self.skip = "", self.skip, 0
            return buf[skip:cut], True
        end = len(buf) - self._longest_partial(buf)
        self.held = buf[end:]
        if self.skip:  # part of what is safe now was shown before
            skip, self.skip = self.skip, max(0, self.skip - end)
            return buf[skip:end], False
        return buf[:end], False

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
        out, self.held, skip, self.skip = self.held, "", self.skip, 0
        return out[skip:]


class LogprobLog:
    """A request's logprobs (SamplingParams.logprobs / prompt_logprobs): the output processor
    sets `next` to the value of the token the next event outputs, and appends prompt values."""

    def __init__(self, tokens: bool, prompt: bool):
        self.tokens: list[TokenLogprob] | None = [] if tokens else None
        self.prompt: list[TokenLogprob] | None = [] if prompt else None
        self.next: TokenLogprob | None = None
        self._prompt_sent = False

    def annotate(self, ev: Event) -> Event:
        """Attach the logprob of ev's token (and, on the first event, the prompt's)."""
        if self.tokens is not None:
            ev.logprobs = []
            if ev.token_ids and self.next is not None:
                ev.logprobs.append(self.next)
                self.tokens.append(self.next)
            self.next = None
        if self.prompt is not None and not self._prompt_sent:
            ev.prompt_logprobs = list(self.prompt)
            self._prompt_sent = True
        return ev


class RequestText:
    """The output side of one request without stop strings."""

    lp: LogprobLog | None = None
    """Its logprobs, when the request asked for them."""

    def __init__(self, request_id: str, handle: RequestHandle, decoder: TextDecoder):
        self.request_id = request_id
        self.handle = handle
        """The request's handle (handle.RequestHandle): where its events are delivered."""
        self.decoder = decoder
        self._push = decoder.push_one
        self.parts: list[str] = []
        self.n = 0  # tokens output so far

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def emit(self, token: int) -> Event:
        """The event of one more output token of a request that goes on (the per-token path:
        the push is inlined, StopRequestText overrides it)."""
        text = self._push(token)
        self.parts.append(text)
        self.n += 1
        return Event(text, [token], self.n)

    def close(self, end: Finished) -> Event:
        """The request's last event: its last token's text when end.token is set, then what the
        decoder and the stop matcher held back (not after a matched stop string: the text ends
        where the stop string starts). An error's event has no text."""
        if end.reason == ERROR:
            return Event("", [], len(end.token_ids), True, ERROR)
        ids = [] if end.token is None else [end.token]
        text = self._token_text(end.token) if end.token is not None else ""
        if not (end.reason == STOP and end.token is not None):
            text += self._tail()
        self.parts.append(text)
        return Event(text, ids, len(end.token_ids), True, end.reason)

    def _token_text(self, token: int) -> str:
        return self._push(token)

    def _tail(self) -> str:
        return self.decoder.flush()


class StopRequestText(RequestText):
    """A request with stop strings: `match(token)` runs before the next plan (the scheduler's
    apply asks), the event of that token comes from what it found."""

    def __init__(
        self,
        request_id: str,
        handle: RequestHandle,
        decoder: TextDecoder,
        stops: Sequence[str],
        shown: str = "",
        hidden_lead: bool = False,
    ):
        super().__init__(request_id, handle, decoder)
        self.matcher = StopMatcher(stops, shown, hidden_lead)
        self._staged: str | None = None  # the safe text of the token last matched

    def match(self, token: int) -> bool:
        """Feed one token's text; True when a stop string was reached."""
        text, hit = self.matcher.feed(self._push(token))
        self._staged = text
        return hit

    def _token_text(self, token: int) -> str:
        text, self._staged = self._staged, None
        if text is None:  # the engine always matches first (Scheduler.apply's match_stops)
            raise RuntimeError(f"the text of token {token} was not checked for stop strings")
        return text

    def emit(self, token: int) -> Event:
        text = self._token_text(token)
        self.parts.append(text)
        self.n += 1
        return Event(text, [token], self.n)

    def _tail(self) -> str:
        text, hit = self.matcher.feed(self.decoder.flush())
        return text if hit else text + self.matcher.flush()


def open_text(request_id: str, handle: RequestHandle, decoder: TextDecoder, params: SamplingParams) -> RequestText:
    lead = params.lead
    if lead is not None:
        for t in lead.token_ids:  # the decoder goes on after them: their text was shown before
            decoder.push_one(t)
    if has_stop_strings(params):
        shown = lead.text if lead is not None else ""
        st: RequestText = StopRequestText(request_id, handle, decoder, params.stop, shown, params.hidden_lead)
    else:
        st = RequestText(request_id, handle, decoder)
    if params.logprobs is not None or params.prompt_logprobs is not None:
        st.lp = LogprobLog(params.logprobs is not None, params.prompt_logprobs is not None)
    return st

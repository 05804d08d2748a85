"""Plain data that crosses the engine's boundary: parameters in, events and results out.

No torch import here: the scheduler, the task layer and the API all use these types
(`Result.state`'s `State` is imported for the type checker only).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, get_type_hints

if TYPE_CHECKING:  # (imports torch at run time)
    from server.model.state import State

# finish reasons
STOP = "stop"  # EOS, a stop token id or a stop string
LENGTH = "length"  # max_tokens reached
ABORT = "abort"  # aborted by request identity (client left, /stop)
ERROR = "error"  # the request failed (the engine survives)

OVERFLOW_TOKEN = -1
"""A sampler's token for a row whose kept set may reach past its candidates (resampled exactly:
server.engine.sampler)."""
NONFINITE_TOKEN = -3
"""A sampler's token for a row whose logits hold a NaN or +inf (the model's activations left the
dtype's range: an extreme state or NaN weights). That request fails alone (Scheduler.apply)."""
NONFINITE_MESSAGE = (
    "the model's logits became NaN or infinite for this request: its starting state or its input "
    "drove the activations out of range (a state file with extreme values, or a checkpoint with "
    "NaN weights, does this)"
)

EOS_TOKEN = 0

MAX_LOGPROBS = 20
"""The most alternatives (top logprobs) a token can report (OpenAI's bound)."""


LIMITS: dict[str, tuple[float, float]] = {
    "max_tokens": (0, 1_048_576),
    "temperature": (0.0, 5.0),
    "top_p": (0.0, 1.0),
    "top_k": (-1, 1_000_000),
    "presence_penalty": (-10.0, 10.0),
    "repetition_penalty": (-10.0, 10.0),
    "penalty_decay": (0.0, 1.0),
    "seed": (0, 2**63 - 1),
    "logprobs": (0, MAX_LOGPROBS),
    "prompt_logprobs": (0, MAX_LOGPROBS),
}
"""The one set of bounds (inclusive) of the sampling fields, shared by every route family.
top_k -1 and 0 both mean "no top-k cut" (the SDK sends -1)."""

MAX_STOP_STRINGS = 16
MAX_STOP_TOKEN_IDS = 64
MAX_STOP_CHARS = 256
"""Bounds on stop rules (count of strings, count of token ids, characters per string)."""

FIELDS = (
    "max_tokens",
    "temperature",
    "top_k",
    "top_p",
    "presence_penalty",
    "repetition_penalty",
    "penalty_decay",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
)
"""The names of SamplingParams' fields as requests and stored task parameters spell them. A new
sampling field: its name here, its type and default on SamplingParams (the one type table:
FIELD_KINDS is derived from it), its bounds in LIMITS, its line in SamplingParams.from_fields and
in server.api.sampling.SamplingFields (test_tasks_parts checks that one agrees), its key on
server.tasks.params.TaskParams (checked at import). docs/architecture.md: "Adding a sampling
parameter"."""


GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "lark", "ebnf", "structural_tag", "any_of")
MAX_GRAMMAR_CHARS = 200_000
MAX_TRIGGER_CHARS = 64
MAX_ALTERNATIVES = 8
"""Alternatives of one any_of grammar."""


@dataclass(frozen=True)
class GrammarSpec:
    """A constraint on the generated text (plain, hashable data; compiled grammars are cached by
    it, server.engine.grammar). The text the grammar describes is the whole output, or, with a
    trigger, the output that follows the trigger's first occurrence.

    kind            source
    json_schema     a JSON schema (JSON text); output: one JSON value valid for it
    json_object     "" (ignored); output: one JSON object
    regex           a regular expression the whole output matches
    lark            a Lark grammar (the library's dialect; rule `start`)
    ebnf            a GBNF / EBNF grammar (rule `root`)
    structural_tag  the grammar library's structural-tag JSON (tags with begin / schema / end)
    any_of          a JSON list of alternatives {"prefix": text, "kind": ..., "source": ...}
                    (kinds above, no trigger); output: one alternative's prefix, then its
                    language (an answer that is either a tool call list or a formatted reply)

    JSON output is written with the separators ", " and ": " and no other whitespace.
    """

    kind: str
    source: str = ""
    trigger: str = ""
    """"" = the grammar applies from the first generated token. Otherwise the output is free
    text until it contains `trigger`; the grammar then applies to the text after it (the trigger
    is output, not part of the grammar's language). While free, a row pays no mask work except
    that a token which would complete the trigger AND run past its end is not allowed (so the
    grammar always starts on a token boundary; single-byte tokens keep every text reachable)."""

    @classmethod
    def json_schema(cls, schema: str | dict, trigger: str = "") -> GrammarSpec:
        """A json_schema spec from a schema given as JSON text or as a dict."""
        import json

        return cls("json_schema", schema if isinstance(schema, str) else json.dumps(schema), trigger)

    @classmethod
    def any_of(cls, alternatives: Sequence[tuple[str, GrammarSpec]]) -> GrammarSpec:
        """One grammar whose output is `prefix` then the language of `spec`, for one of the
        (prefix, spec) alternatives (specs without triggers)."""
        import json

        alts = [{"prefix": p, "kind": a.kind, "source": a.source} for p, a in alternatives]
        return cls("any_of", json.dumps(alts))

    def alternatives(self) -> list[tuple[str, GrammarSpec]]:
        """An any_of spec's (prefix, spec) alternatives; ValueError if its source is not a list
        of 1..MAX_ALTERNATIVES of them, each of another kind and without a trigger."""
        import json

        try:
            raw = json.loads(self.source)
        except ValueError:
            raw = None
        if not isinstance(raw, list) or not 1 <= len(raw) <= MAX_ALTERNATIVES:
            raise ValueError(f"an any_of grammar is a JSON list of 1 to {MAX_ALTERNATIVES} alternatives")
        out = []
        for a in raw:
            ok = isinstance(a, dict) and set(a) <= {"prefix", "kind", "source"}
            if not ok or not all(isinstance(a.get(k, ""), str) for k in ("prefix", "kind", "source")):
                raise ValueError('an any_of alternative is {"prefix": text, "kind": kind, "source": text}')
            spec = GrammarSpec(a.get("kind", ""), a.get("source", ""))
            if spec.kind == "any_of":
                raise ValueError("an any_of alternative cannot be an any_of grammar")
            spec.check()
            out.append((a.get("prefix", ""), spec))
        return out

    def check(self) -> None:
        """Raise ValueError for a spec that cannot be compiled whatever the library says (kind,
        sizes); the compiler checks the source itself (server.engine.grammar)."""
        if self.kind not in GRAMMAR_KINDS:
            raise ValueError(f"invalid grammar kind {self.kind!r}: one of {', '.join(GRAMMAR_KINDS)}")
        if len(self.source) > MAX_GRAMMAR_CHARS:
            raise ValueError(f"the grammar has more than {MAX_GRAMMAR_CHARS} characters")
        if not self.source and self.kind != "json_object":
            raise ValueError(f"a {self.kind} grammar needs a source")
        if len(self.trigger) > MAX_TRIGGER_CHARS:
            raise ValueError(f"a grammar trigger has at most {MAX_TRIGGER_CHARS} characters")
        if self.kind == "any_of":
            self.alternatives()


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One token's log-probability under the model, and the most probable alternatives.

    The distribution is log_softmax of the model's raw logits for that position: before the
    penalties, the temperature, top-p / top-k and any grammar mask (what the model thinks, as
    OpenAI reports it). A token a grammar forced can therefore have a low logprob."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    """(token id, logprob) of the k most probable tokens, most probable first (k = the
    request's logprobs / prompt_logprobs; ties in id order)."""


@dataclass(frozen=True)
class TextLead:
    """The end of an output that a request's text continues (a task's continue without a new
    prompt). The request's detokenizer starts after `token_ids` (the last output tokens, whose
    bytes may end inside a character: that character then completes in this request's text), and
    its stop strings are matched over `text` (the output's last characters, already shown) +
    this request's text: a stop string that began in `text` ends this request, which then shows
    nothing of it (what `text` showed stays shown)."""

    token_ids: tuple[int, ...] = ()
    text: str = ""


@dataclass(frozen=True)
class SamplingParams:
    """Per-sequence generation parameters. The defaults here are the server's defaults for every
    route (max_tokens aside: Settings.default_max_tokens); LIMITS bounds them."""

    max_tokens: int = 256
    """Tokens to generate; 0 = prefill only (the sequence ends with its state ready)."""
    temperature: float = 1.0
    """0 = greedy."""
    top_p: float = 0.3
    top_k: int = 0
    """0 = no top-k cut."""
    presence_penalty: float = 0.5
    """Added once to a token's penalty on its first occurrence (RWKV `alpha_presence`)."""
    repetition_penalty: float = 0.5
    """Added to a token's penalty on every later occurrence (RWKV `alpha_frequency`)."""
    penalty_decay: float = 0.996
    """All penalties are multiplied by this before each new token is counted."""
    seed: int | None = None
    """Seed of this sequence's counter-based random stream (None: a random seed)."""
    stop: tuple[str, ...] = ()
    """Stop strings (matched on text across token boundaries, never emitted)."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end the sequence (EOS, id 0, always does unless ignore_eos)."""
    ignore_eos: bool = False
    """EOS does not end the sequence (a constrained row still ends at EOS: see `grammar`)."""
    grammar: GrammarSpec | None = None
    """Constrained decoding: only tokens the grammar allows are sampled; EOS is allowed exactly
    when the grammar accepts the output so far, and ends the sequence then ("stop"). A grammar
    that allows no token at all mid-way ends it with "error"."""
    logprobs: int | None = None
    """None: off. k in [0, 20]: each generated token's TokenLogprob with k alternatives
    (Event.logprobs, Result.logprobs)."""
    prompt_logprobs: int | None = None
    """None: off. k in [0, 20]: the TokenLogprob of every prompt token after the first, given
    the tokens before it (Result.prompt_logprobs, and on the first event). Such a prompt is fed
    one token per step (each position's logits come from the decode), so it prefills slower."""
    lead: TextLead | None = None
    """The output this request's text continues (None: its text starts afresh)."""
    grammar_prefix: tuple[int, ...] = ()
    """With `grammar`: the tokens of the output this request continues (a task's continue without
    a new prompt), which the grammar reads before the request's first token, so the whole output
    fits it (an output that already fits it whole can only end: EOS). A prefix that does not fit
    is refused by submit (ValueError). Internal, like `lead`: not a request field."""
    hidden_lead: bool = False
    """The output's leading whitespace is not shown to its client (a chat reply after
    "Assistant:": the OpenAI chat route strips that gap): stop strings are matched from its
    first other character on, so none matches inside the hidden gap; the gap is still output
    (Event.text) and dropped by the route."""

    @classmethod
    def from_fields(cls, fields: Mapping[str, Any], default_max_tokens: int) -> SamplingParams:
        """The one mapping from request / stored fields (FIELDS names; absent or None = default)
        to SamplingParams. Values are assumed checked against LIMITS (`check_fields`)."""
        d = cls()
        get = lambda k, dv: dv if fields.get(k) is None else fields[k]
        stop = get("stop", ())
        return cls(
            max_tokens=int(get("max_tokens", default_max_tokens)),
            temperature=float(get("temperature", d.temperature)),
            top_p=float(get("top_p", d.top_p)),
            top_k=max(0, int(get("top_k", d.top_k))),  # -1 (the SDK's "no cut") == 0
            presence_penalty=float(get("presence_penalty", d.presence_penalty)),
            repetition_penalty=float(get("repetition_penalty", d.repetition_penalty)),
            penalty_decay=float(get("penalty_decay", d.penalty_decay)),
            seed=None if fields.get("seed") is None else int(fields["seed"]),
            stop=(stop,) if isinstance(stop, str) else tuple(stop),
            stop_token_ids=tuple(int(t) for t in get("stop_token_ids", ())),
            ignore_eos=bool(get("ignore_eos", False)),
        )


_JSON_KINDS: dict[Any, str] = {
    int: "int",
    int | None: "int",
    float: "float",
    bool: "bool",
    tuple[str, ...]: "texts",
    tuple[int, ...]: "token_ids",
}
"""The JSON kind of each SamplingParams field type a FIELDS name may have: int (an integer, never a
bool), float (an integer or a float, never a bool), bool, texts (a string or a list of strings:
stop strings), token_ids (a list of integers). The task layer checks stored parameters by kind
(server.tasks.params); a new type needs its kind here and there."""


def field_kinds(cls: type = SamplingParams, names: Sequence[str] = FIELDS) -> dict[str, str]:
    """{name: JSON kind} of the fields `names` of the dataclass cls, read from its field types (so
    a field's type is written once, on SamplingParams); TypeError naming a name that is not a
    field of cls or whose type has no kind in _JSON_KINDS."""
    hints = get_type_hints(cls)
    out = {}
    for name in names:
        if name not in hints:
            raise TypeError(f"sampling field {name!r} is not a field of {cls.__name__}")
        kind = _JSON_KINDS.get(hints[name])
        if kind is None:
            raise TypeError(f"sampling field {name!r}: its type {hints[name]} has no JSON kind (types._JSON_KINDS)")
        out[name] = kind
    return out


FIELD_KINDS = field_kinds()
"""The JSON kind of each FIELDS name, in FIELDS' order (derived at import: a FIELDS name that is
not a SamplingParams field, or of a type without a kind, fails the import)."""


def check_fields(fields: dict[str, Any], vocab_size: int) -> None:
    """Raise ValueError naming the first field outside LIMITS (or a stop rule that cannot be
    used: too many, empty, not valid text, a token id outside the vocabulary)."""
    for k, (lo, hi) in LIMITS.items():
        v = fields.get(k)
        if v is not None and not lo <= v <= hi:
            raise ValueError(f"invalid '{k}': {v!r} is outside [{lo}, {hi}]")
    stop = fields.get("stop")
    stops = [stop] if isinstance(stop, str) else list(stop or ())
    if len(stops) > MAX_STOP_STRINGS:
        raise ValueError(f"invalid 'stop': at most {MAX_STOP_STRINGS} stop strings")
    for s in stops:
        if not s or len(s) > MAX_STOP_CHARS:
            raise ValueError(f"invalid 'stop': each stop string has 1 to {MAX_STOP_CHARS} characters")
        try:
            s.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("invalid 'stop': not valid UTF-8 text (a lone surrogate?)") from None
    ids = list(fields.get("stop_token_ids") or ())
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise ValueError(f"invalid 'stop_token_ids': at most {MAX_STOP_TOKEN_IDS} ids")
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"invalid 'stop_token_ids': {bad} is outside the vocabulary [0, {vocab_size})")


@dataclass(slots=True)
class Event:
    """One step's output for one sequence (delivered once per engine step)."""

    text: str
    """New text since the previous event (UTF-8 safe, stop strings held back)."""
    token_ids: list[int]
    """New token ids since the previous event."""
    n_tokens: int
    """Tokens generated so far by this sequence (after this event)."""
    finished: bool = False
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None
    """With SamplingParams.logprobs: one per id of token_ids (else None)."""
    prompt_logprobs: list[TokenLogprob] | None = None
    """With SamplingParams.prompt_logprobs: on the request's first event only."""


@dataclass
class Result:
    """Everything about a finished sequence."""

    request_id: str
    text: str
    token_ids: list[int]
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    prefill_time: float = 0.0
    """Seconds from submission to the first generated token (or to the end of prefill)."""
    gen_time: float = 0.0
    """Seconds spent generating after the prefill."""
    state: State | None = None
    """Final state (a batch-1 `State` on the CPU) when it was asked for, else None."""
    error: str | None = None
    logprobs: list[TokenLogprob] | None = None
    """With SamplingParams.logprobs: one per id of token_ids."""
    prompt_logprobs: list[TokenLogprob] | None = None
    """With SamplingParams.prompt_logprobs: one per prompt token after the first (entry j is the
    logprob of prompt token j + 1 given tokens 0..j)."""
    pending_tokens: list[int] = field(default_factory=list)
    """Tokens of prompt + token_ids NOT yet fed into `state` (normally the last generated token;
    empty after a stop token or a prefill-only request). To continue exactly as if the sequence
    had never stopped, submit `pending_tokens + new_prompt_tokens` with `init_state=state`."""

    @property
    def usage(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }


@dataclass
class EngineStats:
    running: int = 0
    waiting: int = 0
    slots: int = 0
    decode_tok_s: float = 0.0
    prefill_tok_s: float = 0.0
    step_ms: float = 0.0
    steps: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    engines: int = 1
    """Engines behind this API: one per device of --devices (EngineRouter), else 1."""
    engines_alive: int = 1
    """Those of `engines` whose loop runs (a single engine reports 1: its is_alive tells)."""
    extra: dict[str, float] = field(default_factory=dict)
    """The engine's step figures by name (stats.StatsTracker: times, counts), for /metrics."""


class EngineError(Exception):
    """Base class of errors the engine raises to its callers."""


class QueueFullError(EngineError):
    """The waiting queue is full (HTTP 429)."""


class PromptTooLongError(EngineError):
    """The prompt has more tokens than allowed (HTTP 413)."""

    def __init__(self, tokens: int, limit: int) -> None:
        super().__init__(f"prompt has {tokens} tokens (max {limit})")
        self.tokens, self.limit = tokens, limit


class EngineDeadError(EngineError):
    """The engine loop died; no request can make progress (HTTP 503)."""


class RequestFailedError(EngineError):
    """This request failed inside the engine (others were unaffected)."""

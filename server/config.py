"""One typed settings object for the whole server.

Every field can be set by an environment variable `RWKV_<FIELD>` (upper case) and by a CLI flag
`--<field-with-dashes>`; the CLI takes its defaults from the environment, which takes its defaults
from the dataclass. Field docs are the attribute docstrings below (also used for `--help`).
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import itertools
import logging
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, get_type_hints

CHOICES: dict[str, tuple[str, ...]] = {
    "dtype": ("auto", "fp32", "fp16", "bf16"),
    "state_dtype": ("auto", "fp32", "fp16"),
    "quant": ("none", "int8", "fp8"),
    "sparse_ffn": ("auto", "on", "off"),
    "kernels": ("auto", "torch", "cuda"),
    "state_store_dtype": ("native", "fp16"),
    "log_level": ("debug", "info", "warning", "error"),
}
"""The values of the settings that take one of a few (the CLI's flag choices, checked again for
values from the environment; the model loader's and the task store's arguments of the same names)."""

ABOVE_ZERO = frozenset({"prefill_chunk", "lease_timeout", "max_body_bytes", "max_prompt_tokens"})
"""The number settings that must be above 0; every other int or float setting must be 0 or more,
and no float setting may be NaN or infinite (server.checks.numbers_problem)."""

UPPER_BOUNDS: dict[str, int] = {"max_batch": 65_536}
"""The settings that size memory up front, with their largest value, refused before anything loads:
the slot pool's, allocated as the engine starts (a slot holds a state and 5 bytes a vocabulary token
of sampler rows: 20 GiB of rows alone at 65,536, 64x the batches measured). A state's bytes are
the model's: server.api.loading checks the pool against the device's memory before allocating it."""

FOREIGN_VARIABLES = frozenset({"RWKV_JIT_ON", "RWKV_CUDA_ON", "RWKV_V7_ON", "RWKV_FUZZ_EXAMPLES"})
"""RWKV_* variables not warned about: the `rwkv` package's switches, the fuzz tests' count."""


@dataclass(frozen=True)
class Settings:
    # --- model -------------------------------------------------------------------------------
    model: str = ""
    """Checkpoint: a path to an RWKV-7 .pth file or `synthetic:<preset>[:seed]` (presets tiny,
    0.1b, 0.4b, 1.5b, 2.9b, 7.2b; or a shape, `L<layers>-C<width>[-V<vocab>]`). Empty:
    `synthetic:tiny` (random weights, random outputs)."""
    device: str = "auto"
    """Torch device: `cpu`, `cuda`, `cuda:1`, or `auto` (cuda when available, else cpu)."""
    devices: str = ""
    """Several devices, one engine each (its own model copy, slots, queue and CUDA graphs) behind
    one server: `cuda:0,cuda:1`, or `all` (every CUDA GPU). New requests go to the engine with the
    most free slots; states live in host memory, so any engine continues any task. Empty: one
    engine on `device`."""
    dtype: str = "auto"
    """Compute dtype: fp32, fp16, bf16, or auto (fp16 on cuda, fp32 on cpu)."""
    state_dtype: str = "auto"
    """Precision of the WKV state kept per sequence: fp32, fp16, or auto (fp16 on cuda, fp32 on
    cpu). fp16 halves state memory and is faster at large batches; its error is a quarter of the
    fp16 activations' (docs/performance.md, "fp16 or fp32 state")."""
    quant: str = "none"
    """8-bit weights for the layers' r/k/v/o and FFN linears, quantized as the checkpoint loads
    (per-output-channel scales; the embedding and LoRAs stay 16-bit, and so does the head, plus an
    int8 copy of it that products of up to 8 rows read): `none`, `int8` (weight-only: half the
    weight memory, for a larger model on a smaller card; faster than 16-bit weights only at small
    batches) or `fp8` (e4m3; past 64 rows also fp8 activations per token on compute capability
    8.9+; faster than 16-bit weights at most batch sizes; with it, by default, a transposed copy of
    the FFN value codes: see `--sparse-ffn`). `python run.py quantize MODEL.pth OUT.pth --quant
    int8` writes an 8-bit copy that later starts load as it is (no `--quant` needed; fewer bytes to
    read, no quantizing). Speed, memory and quality figures: docs/performance.md, "8-bit
    weights"."""
    sparse_ffn: str = "auto"
    """One-stream decode's FFN value projection reads only the weight rows of relu^2's nonzero
    inputs (about half of a random model's, most of a trained one's) from a transposed copy of its
    weights (CUDA, fp16 models: the product takes fp16 activations): `auto` (with `--quant fp8`,
    where the copy is 8-bit), `on` (also int8 and 16-bit weights: the copy costs as much memory as
    the FFN value weights, worth it where most inputs are zero), `off`. Figures: docs/performance.md,
    "Skipping relu^2's zeros"."""
    kernels: str = "auto"
    """Which ops run the model on cuda: `auto` (the CUDA kernels of kernels/, built at first start,
    else pure torch), `torch` (pure-torch ops and the torch sampler everywhere), `cuda` (the kernels,
    or fail at start-up when they cannot be built). On cpu the ops are always pure torch."""
    kernel_cache: str = "~/.cache/rwkv-server/kernels"
    """Folder of the built CUDA kernels (one subfolder per GPU arch, head size and source hash)."""
    debug_load_delay: float = 0.0
    """Test hook: seconds to sleep before loading the model (the tests of the not-ready state)."""

    # --- engine --------------------------------------------------------------------------------
    max_batch: int = 0
    """Slots in the state pool = most sequences decoding at once (at most 65,536). 0: 256 on cuda, 32 on cpu."""
    step_token_budget: int = 2048
    """Most tokens (decode + prefill chunks) one engine step processes; bounds decode latency
    while long prompts prefill."""
    prefill_chunk: int = 512
    """Longest prompt chunk a single sequence prefills in one step (1 or more)."""
    max_queue: int = 4096
    """Most sequences waiting for a slot; more submissions are refused (HTTP 429). 0: no bound."""
    max_prompt_tokens: int = 65536
    """Longest prompt accepted, in tokens (longer: HTTP 413; 1 or more)."""
    default_max_tokens: int = 256
    """max_tokens when a request gives none (at most max_tokens_limit, when that is set)."""
    max_tokens_limit: int = 0
    """Largest max_tokens a request may ask for (beyond it: HTTP 400 / 422 naming max_tokens).
    0: only the API's own bound (1,048,576)."""
    cuda_graphs: bool = True
    """Capture decode steps as CUDA graphs (one per batch bucket) on cuda."""
    prefill_graph_len: int = 512
    """With cuda_graphs: a step's prefill of up to 4 sequences of at most this many tokens each
    replays a CUDA graph (one per count and length bucket, all captured at start-up) instead of
    issuing its ~55 launches a layer from Python; 0 = always eager."""
    stats_interval: float = 10.0
    """Seconds between engine stats log lines (0 disables the line)."""

    # --- tasks / storage ---------------------------------------------------------------------
    db: str = "rwkv_tasks.db"
    """Task database: a SQLite file path, or a database URL (sqlite:///..., postgresql://user@host/db;
    the async drivers aiosqlite / asyncpg are implied, or name one: postgresql+asyncpg://...). No
    other database is supported. Not empty: `sqlite://` is one in memory, whose tasks are lost at exit
    (a warning says so). Logs and messages show a URL's password as ***."""
    state_cache_bytes: int = 2 * 1024**3
    """Budget in bytes of the in-memory LRU cache of task states."""
    db_budget_bytes: int = 20 * 1024**3
    """Budget in bytes of the states stored in the database (the least recently used
    non-template states are dropped first; their text stays)."""
    tmp_task_ttl: float = 600.0
    """Seconds a finished TMP_ task is kept in memory (0: dropped once it ends)."""
    writer_queue: int = 64
    """Bound of the background state-writer queue (writers wait when it is full)."""
    tmp_state_bytes: int = 256 * 1024**2
    """Budget in bytes of the states of finished TMP_ tasks (least recently used dropped first;
    their text stays for tmp_task_ttl, and a fork or continue re-feeds their tokens)."""
    write_behind_bytes: int = 8 * 1024**3
    """Most bytes of finished tasks' states held in memory waiting to be written to the database
    (a task is shown finished once its row is committed; its state follows). Beyond, the oldest
    waiting states are not written: their tasks are rebuilt from their tokens when continued."""
    state_store_dtype: str = "native"
    """How task states are stored in the database: `native` (their working dtypes; exact) or
    `fp16` (an fp32 WKV state down-cast: half the bytes, but a continuation from it is not exactly
    the one the model computed; docs/deployment.md)."""
    db_busy_timeout: float = 30.0
    """Seconds a request waits on the task database before it answers 503 with Retry-After:
    SQLite, for another process's write lock (a replica on the same file); PostgreSQL, to
    connect, for another transaction's lock, or for a statement's answer (plus a slack of up to
    5 s, more for a state written: docs/deployment.md)."""

    # --- replicas ----------------------------------------------------------------------------
    instance_name: str = ""
    """This server's name among the servers sharing one database; empty: `<hostname>:<port>`
    (`<hostname>/<host>:<port>` when --host is one address, not 0.0.0.0; with `--port 0` a name
    of its own each start), the same across restarts. A restart marks interrupted the tasks its
    earlier run left running (clients continue them). A start under a given name that a live
    server uses is refused (status 2); one a crashed server left is taken once its lease
    expires, up to --lease-timeout later (docs/deployment.md)."""
    public_url: str = ""
    """The URL clients reach this server at (behind a load balancer: its own address); named in
    the 409 that another replica answers for a task running here."""
    lease_timeout: float = 30.0
    """Seconds without a heartbeat after which a server is taken for dead and the tasks it was
    running are marked interrupted by the others (heartbeats every third of it; more than 0)."""

    # --- states and the conversation cache -----------------------------------------------------
    states: str = ""
    """RWKV-7 state files (tuned states) loaded at start as public read-only templates `_NAME`:
    `NAME=PATH,NAME=PATH,...` (or the repeatable --state NAME=PATH). A file that does not fit the
    model stops the start with a message naming it and the key."""
    state_upload_bytes: int = 256 * 1024**2
    """Largest state file accepted by the upload route (POST /v1/states/NAME; 413 beyond)."""
    conversation_cache_bytes: int = 4 * 1024**3
    """Budget in bytes of the OpenAI routes' conversation cache (states at the end of earlier
    requests, by exact token prefix; a request that extends one prefills only the rest); 0 turns
    it off."""
    conversation_cache_min_tokens: int = 512
    """Keep a request's states only when its prompt plus its max_tokens reach this many tokens, or
    it is part of a conversation in progress (a chat with an earlier reply, or a request that
    started from a kept state): keeping costs a state's copy to host memory and back, which for a
    one-off short exchange costs more than prefilling its tokens again (docs/states.md). 0: keep
    every one."""
    conversation_cache_shared: bool = False
    """Let an API key's requests start from conversation states that another key's requests left
    (default: each key has its own)."""

    # --- HTTP --------------------------------------------------------------------------------
    host: str = "127.0.0.1"
    """Address to listen on."""
    port: int = 8000
    """Port to listen on (0 to 65535; 0: a free port, logged once bound)."""
    api_keys: str = ""
    """Comma-separated API keys; when set (or api_key_file is), /v1 routes need
    `Authorization: Bearer <key>`. Empty: no keys from here; a value that holds no key (`,`)
    stops the start."""
    api_key_file: str = ""
    """File with one API key per line (blank lines and # comments ignored). A file that cannot
    be read or holds no key stops the start (the routes are never left open by mistake)."""
    cors_origins: str = "*"
    """Comma-separated origins whose web pages a browser lets call this server (CORS); `*`: any
    (rwkv_lightning's default, so its browser clients work unchanged). Empty: no CORS answers
    (pages of other origins are blocked). Exposed beyond this host: set API keys, or list origins."""
    direct_stream: bool = True
    """One-choice SSE streams are written to their sockets by the engine thread (no event-loop
    work per token) when the connection allows it: uvicorn's httptools protocol, plain TCP,
    HTTP/1.1 (server.api.streaming.direct); task streams are written by their task's updates, without a
    reader per stream (the same writer). Off: every stream runs on the event loop."""
    max_body_bytes: int = 8 * 1024**2
    """Largest request body accepted (HTTP 413 beyond; 1 or more)."""
    header_timeout: float = 30.0
    """Seconds a client has to send a request's headers (from its first byte, or from the
    connection's start); beyond: 408 and the connection is closed. 0: no limit."""
    body_timeout: float = 30.0
    """Seconds a client has to send a request's body once its headers came; beyond: 408. 0: no limit."""
    keep_alive_timeout: int = 75
    """Seconds an idle HTTP/1.1 connection is kept open for its next request. Longer than the
    clients' own idle expiry (httpx and the OpenAI SDK: 5 s) and a load balancer's (often 60 s),
    so that a client never sends a request on a connection the server is closing that moment
    (the request would fail with a read error, and a POST is not retried)."""
    max_connections: int = 4096
    """Most connections (and requests in progress) at once; beyond them new requests get 503
    `too_many_connections` with `Retry-After` (`/health` and `/metrics` stay answered). 0: no bound."""
    few_shot: str = ""
    """Path of a few-shot dialogue file prefixed to chat prompts when a request asks for it; a
    file given here that cannot be read (as UTF-8 text) stops the start. Empty: the project's
    few_shot.txt (read when a request first asks for it; missing, such a request answers 500)."""
    log_level: str = "info"
    """Log level: debug, info, warning, error (in any case: `DEBUG` too)."""
    access_log: bool = False
    """Log every request at info level, one line each: client, method, path, status and time (off:
    only refused and failed requests are logged at info; successes at debug)."""

    def __post_init__(self) -> None:
        if 0 < self.max_tokens_limit < self.default_max_tokens:  # the cap holds for the default too
            object.__setattr__(self, "default_max_tokens", self.max_tokens_limit)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Settings from `RWKV_*` variables (of `env`, default the process environment), then
        explicit overrides (e.g. from the CLI)."""
        settings, bad = cls.from_env_lenient(env, **overrides)
        if bad:
            raise ValueError(next(iter(bad.values())))
        return settings

    @classmethod
    def from_env_lenient(
        cls, env: Mapping[str, str] | None = None, **overrides: Any
    ) -> tuple[Settings, dict[str, str]]:
        """from_env, with each field whose variable cannot be read at its default instead, and
        the message of each such variable by field name (for --help, and the commands that
        do not use the setting: the command that does refuses it)."""
        env = os.environ if env is None else env
        hints = get_type_hints(cls)
        values: dict[str, Any] = {}
        bad: dict[str, str] = {}
        for f in fields(cls):
            key = "RWKV_" + f.name.upper()
            if key in env:
                try:
                    values[f.name] = _parse(hints[f.name], env[key], key)
                except ValueError as exc:
                    bad[f.name] = str(exc)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values), bad

    def replace(self, **changes: Any) -> Settings:
        return dataclasses.replace(self, **changes)

    def resolved_device(self) -> str:
        """The device of the first engine (the dtype and slot defaults follow it)."""
        if self.devices.strip():
            return self.resolved_devices()[0]
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def resolved_devices(self) -> list[str]:
        """One device per engine; ValueError for a list that cannot run (no GPU for `all`, a
        GPU named twice, CUDA and CPU mixed: their dtype defaults differ)."""
        spec = self.devices.strip()
        if not spec:
            return [self.resolved_device()]
        if spec == "all":
            import torch

            n = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if n == 0:
                raise ValueError("devices=all: no CUDA GPU is visible")
            return [f"cuda:{i}" for i in range(n)]
        devs = [d.strip() for d in spec.split(",") if d.strip()]
        devs = [f"{d}:0" if d == "cuda" else d for d in devs]
        for d in devs:
            if not re.fullmatch(r"cpu|cuda:\d+", d):
                raise ValueError(f"devices: {d!r} is not cpu, cuda or cuda:N")
        gpus = [d for d in devs if d != "cpu"]
        if len(set(gpus)) != len(gpus):
            raise ValueError(f"devices: a GPU is named twice in {spec!r}")
        if gpus and len(gpus) != len(devs):
            raise ValueError(f"devices: {spec!r} mixes CUDA and CPU engines")
        return devs

    def resolved_dtype(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "fp16" if self.resolved_device().startswith("cuda") else "fp32"

    def resolved_state_dtype(self) -> str:
        if self.state_dtype != "auto":
            return self.state_dtype
        return "fp16" if self.resolved_device().startswith("cuda") else "fp32"

    def resolved_max_batch(self, device: str | None = None) -> int:
        """The slots of an engine on `device` (default: the resolved device)."""
        if self.max_batch > 0:
            return self.max_batch
        return 256 if (device or self.resolved_device()).startswith("cuda") else 32

    def resolved_model(self) -> str:
        return self.model or "synthetic:tiny"

    def state_files(self) -> list[tuple[str, str]]:
        """(NAME, PATH) of `states`; ValueError for an entry that is not NAME=PATH. Entries are
        split at newlines and at commas followed by `NAME=` (a path may hold other commas)."""
        out = []
        for item in _STATE_SPLIT.split(self.states):
            item = item.strip()
            if not item:
                continue
            name, eq, path = item.partition("=")
            if not eq or not name.strip() or not path.strip():
                raise ValueError(f"{item!r} is not NAME=PATH")
            out.append((name.strip(), path.strip()))
        return out

    def cors_origin_list(self) -> list[str]:
        """cors_origins as a list (empty: CORS off)."""
        return [o.strip() for o in self.cors_origins.split(",") if o.strip()]

    def api_key_set(self) -> frozenset[str]:
        """The keys of api_keys and api_key_file. ValueError (one line, naming the setting) for a
        source that is set but gives no key, or a key file that cannot be read: a server meant
        to need keys must not start with its routes open."""
        keys = {k.strip() for k in self.api_keys.split(",") if k.strip()}
        if self.api_keys.strip() and not keys:
            raise ValueError("api-keys: holds no key (comma-separated keys; empty for none)")
        if self.api_key_file:
            keys |= _key_file(self.api_key_file)
        return frozenset(keys)

    def db_shown(self) -> str:
        """`db` as logs and messages show it: a URL's password replaced by ***."""
        return redact_url(self.db)

    def db_in_memory(self) -> bool:
        """`db` names an in-memory SQLite database (`:memory:`, `sqlite://`): its tasks are lost at exit."""
        scheme, sep, path = self.db.partition("?")[0].partition("://")
        return self.db == ":memory:" or (scheme.startswith("sqlite") and sep > "" and path in ("", "/:memory:"))

    def listen_url(self, port: int | None = None) -> str:
        """http://HOST:PORT (an IPv6 address in brackets), `port` or the setting's."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port if port is None else port}"


_warned: set[str] = set()


def warn_unknown_variables(env: Mapping[str, str] | None = None) -> list[str]:
    """Log a warning, once a process, for each RWKV_* variable of `env` (default the process
    environment) that is no setting (a misspelt RWKV_API_KEY would leave the routes open
    silently), naming the closest setting's variable; FOREIGN_VARIABLES aside. The lines logged."""
    env = os.environ if env is None else env
    names = ["RWKV_" + f.name.upper() for f in fields(Settings)]
    lines = []
    for key in sorted(k for k in env if k.upper().startswith("RWKV_") and k not in names and k not in _warned):
        if key.upper() in FOREIGN_VARIABLES:
            continue
        close = difflib.get_close_matches(key.upper()[5:], [n[5:] for n in names], n=1)  # (past the common RWKV_)
        hint = f" (did you mean RWKV_{close[0]}?)" if close else ""
        lines.append(f"{key} is no setting of this server: ignored{hint}")
        _warned.add(key)
        logging.getLogger("server.config").warning("%s", lines[-1])
    return lines


def _key_file(path: str) -> set[str]:
    """The keys of an API key file (one a line; blank lines and # comments skipped)."""
    try:
        with open(path, encoding="utf-8") as fh:
            keys = {line.strip() for line in fh if line.strip() and not line.strip().startswith("#")}
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise ValueError(f"api-key-file {path}: cannot read it ({why})") from None
    if not keys:
        raise ValueError(f"api-key-file {path}: holds no key (one key a line; blank lines and # comments are skipped)")
    return keys


_URL_PASSWORD = re.compile(r"(://[^\s/@:]*:)[^\s]*@")  # up to the last @: a password may hold one
_QUERY_PASSWORD = re.compile(r"([?&]password=)[^&#\s]*")


def redact_url(text: str) -> str:
    """`text` (a database URL, or a message or log line holding one) with the URLs' passwords
    (`scheme://user:PASSWORD@host/...`, `?password=...`) replaced by ***."""
    return _QUERY_PASSWORD.sub(r"\1***", _URL_PASSWORD.sub(r"\1***@", text))


_STATE_SPLIT = re.compile(r"\n|,(?=\s*[A-Za-z0-9][A-Za-z0-9_.\-]*=)")


def whole_number(raw: str) -> int:
    """An integer setting's value: a whole number, also written with an exponent (`2e9`, `1e3`);
    ValueError for a fraction (`1.5`, `1.5e0`), a suffix, or anything else."""
    text = raw.strip()
    if re.fullmatch(r"[+-]?[0-9]+", text):
        return int(text)
    if re.fullmatch(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)[eE][+-]?[0-9]+", text):
        value = float(text)
        if math.isfinite(value) and value.is_integer():
            return int(value)
    raise ValueError(raw)


def _parse(typ: Any, raw: str, name: str) -> Any:
    try:
        if typ is bool:  # an empty value is refused too: it reads as neither on nor off
            low = raw.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if typ is int:
            return whole_number(raw)
        if typ is float:
            return float(raw)
        return raw
    except ValueError:
        what = {bool: "boolean (1/true/yes/on or 0/false/no/off)", int: "whole number"}.get(
            typ, getattr(typ, "__name__", str(typ))
        )
        raise ValueError(f"{name}={raw!r} is not a valid {what}") from None


def field_docs() -> dict[str, str]:
    """Attribute docstrings of Settings, for --help."""
    src = inspect.getsource(Settings)
    tree = ast.parse(src)
    docs: dict[str, str] = {}
    body = tree.body[0].body  # type: ignore[attr-defined]
    for prev, node in itertools.pairwise(body):
        if (isinstance(prev, ast.AnnAssign) and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)):  # fmt: skip
            docs[prev.target.id] = " ".join(node.value.value.split())  # type: ignore[union-attr]
    return docs


__all__ = ["Settings", "field", "field_docs", "whole_number"]

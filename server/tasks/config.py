"""What the task layer takes from outside: its configuration and the protocols of the objects it
is given (tokenizer, model shape, latency recorder). The engine's protocol is
`server.engine.protocol.EngineAPI`.

`TaskConfig` holds the few settings the task layer reads; `TaskConfig.of(settings)` takes them
from `server.config.Settings` (or from anything with those attributes), so the layer depends on
these fields only, not on the whole settings object.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from server.engine.types import Event


class TaskSettings(Protocol):
    """The fields of `server.config.Settings` the task layer reads."""

    @property
    def db(self) -> str: ...

    @property
    def state_cache_bytes(self) -> int: ...

    @property
    def db_budget_bytes(self) -> int: ...

    @property
    def tmp_task_ttl(self) -> float: ...

    @property
    def writer_queue(self) -> int: ...

    @property
    def default_max_tokens(self) -> int: ...

    @property
    def max_tokens_limit(self) -> int: ...

    @property
    def tmp_state_bytes(self) -> int: ...

    @property
    def write_behind_bytes(self) -> int: ...

    @property
    def state_store_dtype(self) -> str: ...

    @property
    def instance_name(self) -> str: ...

    @property
    def host(self) -> str: ...

    @property
    def port(self) -> int: ...

    @property
    def public_url(self) -> str: ...

    @property
    def lease_timeout(self) -> float: ...

    @property
    def db_busy_timeout(self) -> float: ...


STORE_DTYPES = {"native": None, "fp16": "float16"}
"""Settings.state_store_dtype -> the codec's wkv_dtype (None: the working dtype)."""


@dataclass(frozen=True)
class TaskConfig:
    """Configuration of the task layer (the Settings fields of the same names)."""

    db: str = "rwkv_tasks.db"
    """Task database: a SQLite path or a database URL (server.tasks.store.database_url)."""
    state_cache_bytes: int = 2 * 1024**3
    """Budget of the in-memory LRU of task states."""
    db_budget_bytes: int = 20 * 1024**3
    """Budget of the non-template states stored in the database."""
    tmp_task_ttl: float = 600.0
    """Seconds a finished TMP_ task stays in memory."""
    writer_queue: int = 64
    """Bound of the background writer's queue."""
    default_max_tokens: int = 256
    """max_tokens of a run whose parameters give none."""
    max_tokens_limit: int = 0
    """Most tokens one run generates (0: no limit): a run's max_tokens, given or inherited from
    its task (made when the server's limit was higher), is capped at it."""
    tmp_state_bytes: int = 256 * 1024**2
    """Budget of the states of finished TMP_ tasks (their text stays for tmp_task_ttl)."""
    write_behind_bytes: int = 8 * 1024**3
    """Most bytes of finished tasks' states waiting to be written to the database."""
    state_store_dtype: str = "native"
    """How states are stored: "native" (their working dtypes, exact) or "fp16" (the WKV part
    down-cast: half the bytes, not exact)."""
    instance_name: str = ""
    """This server's stable name among the servers of one database (server.tasks.lease); ""
    here: a name of its own (host-pid-random). `of(settings)` fills in the default (server_name:
    `<hostname>:<port>`, or `<hostname>/<address>:<port>` for a server bound to one address)."""
    public_url: str = ""
    """The URL clients reach this server at, named to them when a task runs here (replicas)."""
    lease_timeout: float = 30.0
    """Seconds without a heartbeat after which an instance's running tasks are interrupted."""
    db_busy_timeout: float = 30.0
    """Seconds a SQLite write waits for another process's lock before answering 503."""

    def __post_init__(self) -> None:
        if self.state_store_dtype not in STORE_DTYPES:
            raise ValueError(f"state_store_dtype {self.state_store_dtype!r}: one of {sorted(STORE_DTYPES)}")
        if self.lease_timeout <= 0:
            raise ValueError("lease_timeout must be positive")

    @classmethod
    def of(cls, settings: TaskSettings) -> TaskConfig:
        """The task layer's fields of `settings` (a TaskConfig is returned as it is)."""
        if isinstance(settings, TaskConfig):
            return settings
        return cls(
            db=settings.db,
            state_cache_bytes=int(settings.state_cache_bytes),
            db_budget_bytes=int(settings.db_budget_bytes),
            tmp_task_ttl=float(settings.tmp_task_ttl),
            writer_queue=int(settings.writer_queue),
            default_max_tokens=int(settings.default_max_tokens),
            max_tokens_limit=int(settings.max_tokens_limit),
            tmp_state_bytes=int(settings.tmp_state_bytes),
            write_behind_bytes=int(settings.write_behind_bytes),
            state_store_dtype=settings.state_store_dtype,
            instance_name=server_name(settings.instance_name, int(settings.port), settings.host),
            public_url=settings.public_url,
            lease_timeout=float(settings.lease_timeout),
            db_busy_timeout=float(settings.db_busy_timeout),
        )


class ModelShapeLike(Protocol):
    """What the task layer needs of `server.model.state.ModelShape`."""

    @property
    def vocab_size(self) -> int: ...

    def signature(self) -> str:
        """Identifies the state layout; stored with every state, checked when one is loaded."""
        ...


class TokenizerLike(Protocol):
    def encode(self, text: str) -> Sequence[int]: ...

    def decode(self, ids: Sequence[int]) -> str:
        """UTF-8 text of ids, invalid or incomplete bytes as U+FFFD (what the engine's stream
        shows once flushed)."""
        ...

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        """The bytes of ids, concatenated."""
        ...


class TimedRun(Protocol):
    """What a latency recorder reads and keeps on a run (`server.tasks.records.Run`)."""

    t_last: float | None


class LatencyRecorder(Protocol):
    """Latency metrics of one run (the HTTP layer's Recorder): called per batch of events the
    run's pump takes, and once when the run ends."""

    def on_batch(self, run: TimedRun, batch: list[Event]) -> None: ...

    def finish(self) -> None: ...


LatencyFactory = Callable[[], LatencyRecorder]
"""Makes the recorder of each new run."""


WILDCARD_HOSTS = ("", "0.0.0.0")
"""--host values (every IPv4 address) the default name leaves out, as it did before it named the
address: two servers at 0.0.0.0 cannot share a port, so `<hostname>:<port>` stays one server's.
`::` is named: with net.ipv6.bindv6only set, a server at `::` and one at 0.0.0.0 share a port."""


def server_name(name: str = "", port: int | None = None, host: str = "") -> str:
    """This server's stable name: `name`; else, on a port, `<hostname>:<port>` for a server
    listening on every IPv4 address (`--host 0.0.0.0`) and `<hostname>/<host>:<port>` for one
    bound to an address (`127.0.0.1`; `::1` as `[::1]`, `::` too); else (no port, or port 0: any free
    port, which two servers of one host share) `<hostname>-<pid>-<random>`, a name of its own.

    A start under a name takes the earlier instances of that name for dead (server.tasks.lease):
    the name is what two live servers can never share, the address they listen on: one machine
    can run servers on one port at 127.0.0.1 and 127.0.0.2 (or at 127.0.0.1 and ::1), not two at
    one address. A server restarted with the same --host and --port keeps its name, and so marks
    interrupted, at once, the tasks its earlier instance left running (clients continue them).
    The machine's hostname is shortened, never the address and port, to fit the 72 characters."""
    if name:
        return name[:72]
    if port:
        where = f":{port}" if host in WILDCARD_HOSTS else f"/[{host}]:{port}" if ":" in host else f"/{host}:{port}"
        return f"{socket.gethostname()[: max(8, 72 - len(where))]}{where}"[:72]
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"[:72]

"""What the task layer takes from outside: its configuration and the protocols of the objects it
is given (tokenizer, model shape, latency recorder). The engine's protocol is
`server.engine.protocol.EngineAPI`.

`TaskConfig` holds the few settings the task layer reads; `TaskConfig.of(settings)` takes them
from `server.config.Settings` (or from anything with those attributes), so the layer depends on
these fields only, not on the whole settings object.
"""

from __future__ import annotations

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

    @classmethod
    def of(cls, settings: TaskSettings) -> TaskConfig:
        """The task layer's fields of `settings` (a TaskConfig is returned as it is)."""
        if isinstance(settings, TaskConfig):
            return settings
        return cls(db=settings.db, state_cache_bytes=int(settings.state_cache_bytes),
                   db_budget_bytes=int(settings.db_budget_bytes), tmp_task_ttl=float(settings.tmp_task_ttl),
                   writer_queue=int(settings.writer_queue), default_max_tokens=int(settings.default_max_tokens))


class ModelShapeLike(Protocol):
    """What the task layer needs of `server.model.state.ModelShape`."""

    @property
    def vocab_size(self) -> int: ...

    def signature(self) -> str:
        """Identifies the state layout; stored with every state, checked when one is loaded."""
        ...


class TokenizerLike(Protocol):
    def encode(self, text: str) -> Sequence[int]: ...


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

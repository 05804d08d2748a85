"""Tasks: records, the TaskManager (composed of runs, persistence and an inventory over one state
cache and a SQLite/PostgreSQL store), the state codec.

Importing this package touches no CUDA and compiles nothing."""

from server.tasks.cache import StateCache
from server.tasks.codec import StateCodecError, decode_state, encode_state
from server.tasks.config import TaskConfig
from server.tasks.errors import (
    TaskConflict,
    TaskElsewhere,
    TaskError,
    TaskForbidden,
    TaskInvalid,
    TaskNotFound,
    TaskStale,
    TaskUnavailable,
)
from server.tasks.manager import TaskManager
from server.tasks.migrate import SchemaTooNewError
from server.tasks.params import fim_prompt
from server.tasks.records import (
    FINISHED,
    PREFILL,
    READY,
    RUNNING,
    TASK,
    TEMPLATE,
    TMP,
    Task,
)
from server.tasks.store import Store

__all__ = [
    "FINISHED",
    "PREFILL",
    "READY",
    "RUNNING",
    "TASK",
    "TEMPLATE",
    "TMP",
    "SchemaTooNewError",
    "StateCache",
    "StateCodecError",
    "Store",
    "Task",
    "TaskConfig",
    "TaskConflict",
    "TaskElsewhere",
    "TaskError",
    "TaskForbidden",
    "TaskInvalid",
    "TaskManager",
    "TaskNotFound",
    "TaskStale",
    "TaskUnavailable",
    "decode_state",
    "encode_state",
    "fim_prompt",
]

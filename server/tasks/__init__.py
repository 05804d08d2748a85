"""Tasks: records, the TaskManager (LRU state cache + SQLite/PostgreSQL store), the state codec.

Importing this package touches no CUDA and compiles nothing."""

from server.tasks.codec import StateCodecError, decode_state, encode_state
from server.tasks.errors import TaskConflict, TaskError, TaskForbidden, TaskInvalid, TaskNotFound
from server.tasks.manager import TaskManager
from server.tasks.migrate import SchemaTooNewError
from server.tasks.params import fim_prompt
from server.tasks.records import FINISHED, PREFILL, READY, RUNNING, TASK, TEMPLATE, TMP, Task
from server.tasks.store import Store

__all__ = [
    "TaskManager", "Task", "Store", "TaskError", "TaskNotFound", "TaskForbidden", "TaskConflict",
    "TaskInvalid", "SchemaTooNewError", "StateCodecError", "encode_state", "decode_state",
    "fim_prompt", "PREFILL", "READY", "RUNNING", "FINISHED", "TMP", "TASK", "TEMPLATE",
]

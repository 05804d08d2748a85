"""Errors of the task layer; each carries the HTTP status the API maps it to."""

from __future__ import annotations


class TaskError(Exception):
    status = 400
    code = "task_error"
    retry_after: float | None = None
    """Seconds a client should wait before retrying (the route's Retry-After header), if any."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class TaskNotFound(TaskError):
    status, code = 404, "task_not_found"


class TaskForbidden(TaskError):
    status, code = 403, "template_read_only"


class TaskConflict(TaskError):
    status, code = 409, "task_conflict"


class TaskElsewhere(TaskConflict):
    """The task runs on another server of the same database (a replica): stream, continue or
    stop it there. Names the instance and, when that server advertises one, its URL."""

    code = "task_running_elsewhere"

    def __init__(self, task_id: str, instance: str | None, url: str | None, what: str) -> None:
        where = f"instance {instance!r}" + (f" ({url})" if url else "")
        super().__init__(f"task {task_id} is running on {where}; {what} it there, or once it has finished")
        self.task_id, self.instance, self.url, self.where = task_id, instance, url, where


class TaskStale(TaskConflict):
    """The task changed in the database since this server read it (another replica ran it)."""

    code = "task_changed"


class TaskTagTaken(TaskConflict):
    """Another task of this owner has the tag (a session name another replica took meanwhile);
    nothing was stored."""

    code = "task_tag_taken"


class TaskStateLost(TaskConflict):
    """The task's history starts from a state template's state (a state file), and both its own
    state and that template's are lost or corrupt: it cannot be rebuilt from its tokens."""

    code = "state_lost"


class TaskInvalid(TaskError):
    status, code = 422, "invalid_task_request"


class TaskUnavailable(TaskError):
    """The task database cannot take the write now (locked beyond the busy timeout, disk full,
    unreachable): nothing was stored or changed; retry after `retry_after` seconds."""

    status, code = 503, "database_unavailable"
    retry_after = 1.0

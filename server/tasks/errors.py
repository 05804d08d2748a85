"""Errors of the task layer; each carries the HTTP status the API maps it to."""

from __future__ import annotations


class TaskError(Exception):
    status = 400
    code = "task_error"

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


class TaskInvalid(TaskError):
    status, code = 422, "invalid_task_request"

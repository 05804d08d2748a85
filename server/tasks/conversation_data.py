"""The plain data of the conversations' rows (server/tasks/conversations.py: the queries), and the
refusals of their operations (the routes map each to an answer: server/api/responses/joins.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class ConversationError(Exception):
    """A conversation operation refused; nothing was written."""


class ConversationNotFound(ConversationError):
    """No conversation of that id for this owner (or none at all)."""


class ItemNotFound(ConversationError):
    """No item of that id in the conversation."""


class ItemIdTaken(ConversationError):
    """An item's id is another item's of the conversation (or of the same add)."""

    def __init__(self, index: int, item_id: str) -> None:
        super().__init__(f"the item id {item_id!r} is taken in this conversation")
        self.index, self.item_id = index, item_id


class ConversationLocked(ConversationError):
    """A response runs on the conversation (its run not joined yet): one at a time, as OpenAI's."""

    def __init__(self, task_id: str) -> None:
        super().__init__(task_id)
        self.task_id = task_id


class ConversationFull(ConversationError):
    """The add would take the conversation past conversations.MAX_ITEMS."""


@dataclass(frozen=True)
class Conversation:
    id: str
    owner: str | None
    metadata: dict[str, str]
    created_at: float
    last_seq: int
    """The seq of the last item added (0: none yet); items are numbered from 1 in the order added."""
    cuts: int
    """Items deleted so far."""
    head_task: str | None
    head_seq: int
    head_tokens: int
    """The head task's history length when it became the head: a head whose history moved since
    (a continue through /v1/tasks) no longer matches the items."""


@dataclass(frozen=True)
class StoredItem:
    seq: int
    id: str
    body: dict[str, Any]


@dataclass(frozen=True)
class Run:
    """A response made in the conversation, its items not joined yet."""

    task_id: str
    base_seq: int
    base_cuts: int
    task_version: int
    """The response task's version when it started (Task.version: +1 at each later run)."""
    instance: str | None = None
    """The server instance that made it (whose background join reads its output as it ended)."""

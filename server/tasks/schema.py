"""Table definitions for queries (schema head). The schema itself is created and upgraded only
by the versioned migrations in `migrations/`; keep both in step (a test compares them).

Portable to PostgreSQL: only String/Text/Integer/BigInteger/Float/Boolean/LargeBinary columns,
no SQLite-only SQL. Token id lists are int32 little-endian blobs; params/metadata are JSON text.
The string columns are `_str`/`_text`: the plain types, NUL-safe on PostgreSQL (_PgNulSafe).
"""

from __future__ import annotations

from typing import Any, TypeAlias

import sqlalchemy as sa
from typing_extensions import Unpack

metadata = sa.MetaData()
DbRow: TypeAlias = "sa.Row[Unpack[tuple[Any, ...]]]"
"""A row of a query on these tables (any number of columns, read by column name)."""

_MARK = "\uffff"  # a Unicode noncharacter: never in real text, valid UTF-8 for PostgreSQL


class _PgNulSafe(sa.TypeDecorator[str]):
    """PostgreSQL text cannot hold NUL ("\\x00": 'invalid byte sequence'), which SQLite stores as
    is and which prompts and output do contain (token 1 is the byte 0). Used on PostgreSQL only
    (a variant; SQLite gets the plain type): a value holding a NUL or starting with _MARK is
    stored as _MARK + the value with _MARK written _MARK "1" and NUL _MARK "0"; any other value
    (all ids, nearly all text) is stored unchanged. Comparisons are escaped the same way."""

    impl = sa.String
    cache_ok = True

    def process_bind_param(self, value: Any, dialect: Any) -> Any:
        if isinstance(value, str) and ("\x00" in value or value.startswith(_MARK)):
            return _MARK + value.replace(_MARK, _MARK + "1").replace("\x00", _MARK + "0")
        return value

    def process_result_value(self, value: Any, dialect: Any) -> Any:
        if isinstance(value, str) and value.startswith(_MARK):
            return value[1:].replace(_MARK + "0", "\x00").replace(_MARK + "1", _MARK)
        return value


class _PgNulSafeText(_PgNulSafe):
    impl = sa.Text


def _str(length: int) -> sa.types.TypeEngine[str]:
    return sa.String(length).with_variant(_PgNulSafe(length), "postgresql")


def _text() -> sa.types.TypeEngine[str]:
    return sa.Text().with_variant(_PgNulSafeText(), "postgresql")


ID_LEN = 160
"""Task and state ids (v3: a private named template's id carries its owner, `_name@<hash>`)."""
TAG_LEN = 240
"""tasks.tag: "lightning session " + a session id of up to 200 characters + ":<node>"."""

tasks = sa.Table(
    "tasks",
    metadata,
    sa.Column("id", _str(ID_LEN), primary_key=True),
    sa.Column("kind", _str(16), nullable=False),  # task | template
    sa.Column("status", sa.Integer, nullable=False),  # 0 PREFILL, 1 READY, 2 RUNNING, 3 FINISHED
    sa.Column("finish_reason", _str(16)),
    sa.Column("owner", _str(64)),  # hash of the API key that made it (None: no keys)
    sa.Column("parent_id", _str(ID_LEN)),  # fork lineage
    sa.Column("params", _text(), nullable=False),  # JSON: generation parameters
    sa.Column("prompt", _text(), nullable=False),  # text of the last prompt ("" when ids)
    sa.Column("prompt_len", sa.Integer, nullable=False),  # tokens of the last prompt
    sa.Column("tokens", sa.LargeBinary, nullable=False),  # full token history, int32 LE
    sa.Column("out_start", sa.Integer, nullable=False),  # index in tokens where the output starts
    sa.Column("text", _text(), nullable=False),  # output text since the last prompt
    sa.Column("offsets", sa.LargeBinary, nullable=False),  # char end after each output token
    sa.Column("state_id", _str(ID_LEN)),  # states.id of the last STORED state (v3: written behind)
    sa.Column("state_pos", sa.Integer, nullable=False),  # tokens[:state_pos] are in that state
    sa.Column("prompt_tokens", sa.Integer, nullable=False),
    sa.Column("completion_tokens", sa.Integer, nullable=False),
    sa.Column("prefill_time", sa.Float, nullable=False),
    sa.Column("gen_time", sa.Float, nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("updated_at", sa.Float, nullable=False),
    sa.Column("public", sa.Boolean, nullable=False),  # v3: a template every key may read and fork
    sa.Column("instance", _str(80)),  # v3: the server instance running it (NULL: not running)
    sa.Column("version", sa.Integer, nullable=False),  # v3: +1 at each claim of a run (replicas)
    sa.Column("base_id", _str(ID_LEN)),  # v4: the state-file template its history starts from (lineage.py)
    sa.Column("tag", _str(TAG_LEN)),  # v6: what it is to the route that made it (records.Task.tag)
    sa.Column("digest", _str(64)),  # v8: hex SHA-256 of tokens (token_digest) once a run ended; NULL while running
    sa.Index("ix_tasks_status", "status"),
    sa.Index("ix_tasks_owner_created", "owner", "created_at"),  # v2
    sa.Index("ix_tasks_owner_tag", "owner", "tag"),  # v6
)

sa.Index(
    "ux_tasks_named",  # v6: a tag other than "response" names one task of an owner
    sa.func.coalesce(tasks.c.owner, sa.literal_column("''")),
    tasks.c.tag,
    unique=True,
    sqlite_where=tasks.c.tag != "response",
    postgresql_where=tasks.c.tag != "response",
)

states = sa.Table(
    "states",
    metadata,
    sa.Column("id", _str(ID_LEN), primary_key=True),
    sa.Column("task_id", _str(ID_LEN), nullable=False),  # the task that produced it
    sa.Column("is_template", sa.Boolean, nullable=False),
    sa.Column("signature", _str(128), nullable=False),  # model shape signature
    sa.Column("meta", _text(), nullable=False),  # JSON: layout, dtypes, shapes, offsets
    sa.Column("nbytes", sa.BigInteger, nullable=False),
    sa.Column("checksum", _str(64), nullable=False),  # SHA-256 of data
    sa.Column("data", sa.LargeBinary, nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("last_used", sa.Float, nullable=False),  # v2: eviction order
    sa.Index("ix_states_task", "task_id"),
    sa.Index("ix_states_evict", "is_template", "last_used"),  # v2
)
INSERT_STATE = states.insert()
"""The insert of a states row, its values passed as parameters (`conn.execute(INSERT_STATE, row)`),
never written into the statement (`.values(**row)`): SQLAlchemy's compiled cache keeps the first
statement of each shape it compiles, values included, so the blob of the first state written
(21 MB on a 2.9B model) stayed in memory for the life of the process, outside every budget."""

instances = sa.Table(  # v3: one row per running server on this database (replicas)
    "instances",
    metadata,
    sa.Column("id", _str(80), primary_key=True),
    sa.Column("name", _str(80), nullable=False),  # the server's name; a new start of it: a new id
    sa.Column("url", _text()),  # the URL it advertises (Settings.public_url), or NULL
    sa.Column("started_at", sa.Float, nullable=False),
    sa.Column("heartbeat_at", sa.Float, nullable=False),  # database clock, epoch seconds
    sa.Column("lease_timeout", sa.Float),  # v5: its own --lease-timeout (NULL: an older server's row)
)

CONV_ID_LEN = 80
"""conversations.id: `conv_` + 48 hex digits (docs/agents.md, "Conversations")."""
ITEM_ID_LEN = 200
"""An item's id: one the server made, or a client's (the Responses input items' bound)."""

conversations = sa.Table(  # v7: OpenAI's conversation objects (server/tasks/conversations.py)
    "conversations",
    metadata,
    sa.Column("id", _str(CONV_ID_LEN), primary_key=True),
    sa.Column("owner", _str(64)),  # as tasks.owner
    sa.Column("metadata", _text(), nullable=False),  # JSON object: the client's pairs
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("last_seq", sa.Integer, nullable=False),  # the seq of the last item ever added (0: none)
    sa.Column("cuts", sa.Integer, nullable=False),  # +1 at each item deleted (a run's state may hold it)
    sa.Column("head_task", _str(ID_LEN)),  # the response task whose state holds the items up to head_seq
    sa.Column("head_seq", sa.Integer, nullable=False),
    sa.Column("head_tokens", sa.Integer, nullable=False),  # the head task's history length then (a continue moves it)
    sa.Index("ix_conversations_owner_created", "owner", "created_at"),
)

conversation_items = sa.Table(  # v7: a conversation's items in order
    "conversation_items",
    metadata,
    sa.Column("conversation_id", _str(CONV_ID_LEN), primary_key=True),
    sa.Column("seq", sa.Integer, primary_key=True),  # 1, 2, ... in the order added (a deleted one leaves a gap)
    sa.Column("item_id", _str(ITEM_ID_LEN), nullable=False),
    sa.Column("body", _text(), nullable=False),  # JSON: the item as listed
    sa.Index("ux_conversation_items_id", "conversation_id", "item_id", unique=True),
)

conversation_runs = sa.Table(  # v7: responses of a conversation whose items have not joined it yet
    "conversation_runs",
    metadata,
    sa.Column("conversation_id", _str(CONV_ID_LEN), primary_key=True),
    sa.Column("task_id", _str(ID_LEN), primary_key=True),
    sa.Column("base_seq", sa.Integer, nullable=False),  # the conversation's last_seq when it started
    sa.Column("base_cuts", sa.Integer, nullable=False),  # and its cuts
    sa.Column("task_version", sa.Integer, nullable=False),  # the task's version then (a continue moves it)
    sa.Column("instance", _str(80)),  # the server instance that made it (its join: joins.py)
    sa.Column("created_at", sa.Float, nullable=False),
)

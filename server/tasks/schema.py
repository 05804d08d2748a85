"""Table definitions for queries (schema head). The schema itself is created and upgraded only
by the versioned migrations in `migrations/`; keep both in step (a test compares them).

Portable to PostgreSQL: only String/Text/Integer/BigInteger/Float/Boolean/LargeBinary columns,
no SQLite-only SQL. Token id lists are int32 little-endian blobs; params/metadata are JSON text.
"""

from __future__ import annotations

import sqlalchemy as sa

metadata = sa.MetaData()

tasks = sa.Table(
    "tasks", metadata,
    sa.Column("id", sa.String(80), primary_key=True),
    sa.Column("kind", sa.String(16), nullable=False),  # task | template
    sa.Column("status", sa.Integer, nullable=False),  # 0 PREFILL, 1 READY, 2 RUNNING, 3 FINISHED
    sa.Column("finish_reason", sa.String(16)),
    sa.Column("owner", sa.String(64)),  # hash of the API key that made it (None: no keys)
    sa.Column("parent_id", sa.String(80)),  # fork lineage
    sa.Column("params", sa.Text, nullable=False),  # JSON: generation parameters
    sa.Column("prompt", sa.Text, nullable=False),  # text of the last prompt ("" when ids)
    sa.Column("prompt_len", sa.Integer, nullable=False),  # tokens of the last prompt
    sa.Column("tokens", sa.LargeBinary, nullable=False),  # full token history, int32 LE
    sa.Column("out_start", sa.Integer, nullable=False),  # index in tokens where the output starts
    sa.Column("text", sa.Text, nullable=False),  # output text since the last prompt
    sa.Column("offsets", sa.LargeBinary, nullable=False),  # char end after each output token
    sa.Column("state_id", sa.String(80)),  # states.id of the last settled state
    sa.Column("state_pos", sa.Integer, nullable=False),  # tokens[:state_pos] are in that state
    sa.Column("prompt_tokens", sa.Integer, nullable=False),
    sa.Column("completion_tokens", sa.Integer, nullable=False),
    sa.Column("prefill_time", sa.Float, nullable=False),
    sa.Column("gen_time", sa.Float, nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("updated_at", sa.Float, nullable=False),
    sa.Index("ix_tasks_status", "status"),
    sa.Index("ix_tasks_owner_created", "owner", "created_at"),  # v2
)

states = sa.Table(
    "states", metadata,
    sa.Column("id", sa.String(80), primary_key=True),
    sa.Column("task_id", sa.String(80), nullable=False),  # the task that produced it
    sa.Column("is_template", sa.Boolean, nullable=False),
    sa.Column("signature", sa.String(128), nullable=False),  # model shape signature
    sa.Column("meta", sa.Text, nullable=False),  # JSON: layout, dtypes, shapes, offsets
    sa.Column("nbytes", sa.BigInteger, nullable=False),
    sa.Column("checksum", sa.String(64), nullable=False),  # SHA-256 of data
    sa.Column("data", sa.LargeBinary, nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("last_used", sa.Float, nullable=False),  # v2: eviction order
    sa.Index("ix_states_task", "task_id"),
    sa.Index("ix_states_evict", "is_template", "last_used"),  # v2
)

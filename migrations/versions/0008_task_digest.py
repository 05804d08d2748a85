"""Schema v8: tasks.digest, the SHA-256 of a task's whole token history once a run has ended.

The hex SHA-256 of the tokens column's ids as int32 (server/tasks/token_digest.py), written with
every row of a task that is not running and NULL while it runs. The Responses reuse index
(server/api/responses/reuse.py) keys earlier responses by it: after a restart it reads a key's
newest responses' (id, length, digest) through the (owner, tag) index, without their tokens, so
a history sent whole forks any of them, not only the newest few. The upgrade fills it in for the
responses that have ended (tag 'response', status FINISHED); other tasks get theirs at their
next write.

Revision ID: 0008
Revises: 0007
"""

import hashlib
import sys
from array import array

import sqlalchemy as sa
from alembic import context, op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

BATCH = 256


def _digest(blob: bytes) -> str:
    """The stored ids (int32 little-endian) as the in-memory digest reads them (native order)."""
    ids = array("i", blob)
    if sys.byteorder != "little":
        ids.byteswap()
    return hashlib.sha256(ids.tobytes()).hexdigest()


def upgrade() -> None:
    op.add_column("tasks", sa.Column("digest", sa.String(64)))
    if context.is_offline_mode():  # rendering the DDL (migrate.render_sql): no rows to read
        return
    conn = op.get_bind()
    ids = [r[0] for r in conn.execute(sa.text("SELECT id FROM tasks WHERE tag = 'response' AND status = 3"))]
    for i in range(0, len(ids), BATCH):  # (a batch of token histories in memory at a time)
        q = sa.text("SELECT id, tokens FROM tasks WHERE id IN :ids").bindparams(sa.bindparam("ids", expanding=True))
        rows = conn.execute(q, {"ids": ids[i : i + BATCH]}).fetchall()
        conn.execute(
            sa.text("UPDATE tasks SET digest = :d WHERE id = :id"),
            [{"id": task_id, "d": _digest(bytes(blob))} for task_id, blob in rows],
        )


def downgrade() -> None:
    with op.batch_alter_table("tasks") as batch:
        batch.drop_column("digest")

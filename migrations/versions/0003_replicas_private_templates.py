"""Schema v3: replicas on one database and private templates.

- tasks.instance: the server instance running the task (NULL when it is not running); only
  the running tasks of an instance whose lease expired are marked interrupted.
- tasks.version: +1 at each claim of a run, so two replicas cannot start the same task, and one
  holding an old copy of a task cannot write over a newer one.
- tasks.public: a template every API key may read and fork; templates made without API keys
  (owner NULL) are public, the others private to their key.
- instances: one row per running server start (its lease: heartbeat_at on the database's
  clock); `name` is the server's stable name, shared by its successive starts.
- ids widen to 160 characters (a private named template is `_<name>@<owner hash>`; its state
  ids add `:<hex>`). SQLite does not enforce lengths, so only PostgreSQL alters them.

Revision ID: 0003
Revises: 0002
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

_IDS = (("tasks", "id", False), ("tasks", "parent_id", True), ("tasks", "state_id", True),
        ("states", "id", False), ("states", "task_id", False))


def upgrade() -> None:
    op.add_column("tasks", sa.Column("public", sa.Boolean, nullable=False, server_default=sa.false()))
    op.add_column("tasks", sa.Column("instance", sa.String(80)))
    op.add_column("tasks", sa.Column("version", sa.Integer, nullable=False, server_default="0"))
    op.execute("UPDATE tasks SET public = TRUE WHERE kind = 'template' AND owner IS NULL")
    op.create_table(
        "instances",
        sa.Column("id", sa.String(80), primary_key=True),
        sa.Column("name", sa.String(80), nullable=False),
        sa.Column("url", sa.Text),
        sa.Column("started_at", sa.Float, nullable=False),
        sa.Column("heartbeat_at", sa.Float, nullable=False),
    )
    if op.get_context().dialect.name == "postgresql":
        for table, column, nullable in _IDS:
            op.alter_column(table, column, type_=sa.String(160), existing_type=sa.String(80),
                            existing_nullable=nullable)


def downgrade() -> None:
    if op.get_context().dialect.name == "postgresql":
        for table, column, nullable in _IDS:
            op.alter_column(table, column, type_=sa.String(80), existing_type=sa.String(160),
                            existing_nullable=nullable)
    op.drop_table("instances")
    with op.batch_alter_table("tasks") as batch:
        batch.drop_column("version")
        batch.drop_column("instance")
        batch.drop_column("public")

"""Schema v4: tasks.base_id, the template a task's history starts from.

tasks.base_id, the template made from a state file (a tuned state, an export) whose
state a task's token history starts from; NULL: the zero state (or a row written before v4, whose
base is found through parent_id while its ancestors exist). A lost state of such a task is
rebuilt from the base template's state, never from the zero state (server/tasks/lineage.py).

Revision ID: 0004
Revises: 0003
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("tasks", sa.Column("base_id", sa.String(160)))


def downgrade() -> None:
    with op.batch_alter_table("tasks") as batch:
        batch.drop_column("base_id")

"""Schema v2: states.last_used and the eviction and listing indexes.

states.last_used (database budget evicts least recently used states first),
an eviction index, and an index for listing a key's tasks.

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("states", sa.Column("last_used", sa.Float, nullable=False, server_default="0"))
    op.execute("UPDATE states SET last_used = created_at")
    op.create_index("ix_states_evict", "states", ["is_template", "last_used"])
    op.create_index("ix_tasks_owner_created", "tasks", ["owner", "created_at"])


def downgrade() -> None:
    op.drop_index("ix_tasks_owner_created", table_name="tasks")
    op.drop_index("ix_states_evict", table_name="states")
    with op.batch_alter_table("states") as batch:
        batch.drop_column("last_used")

"""Schema v5: instances.lease_timeout, each server's own lease timeout.

instances.lease_timeout, the lease timeout of the server that holds the row. The
others take it for dead after ITS timeout without a heartbeat, not after their own, so servers
with different --lease-timeout values no longer reap each other's live tasks. NULL (a row of an
older server): judged by the reader's own timeout, as before.

Revision ID: 0005
Revises: 0004
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("instances", sa.Column("lease_timeout", sa.Float))


def downgrade() -> None:
    with op.batch_alter_table("instances") as batch:
        batch.drop_column("lease_timeout")

"""Schema v1: tasks and states.

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "tasks",
        sa.Column("id", sa.String(80), primary_key=True),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("status", sa.Integer, nullable=False),
        sa.Column("finish_reason", sa.String(16)),
        sa.Column("owner", sa.String(64)),
        sa.Column("parent_id", sa.String(80)),
        sa.Column("params", sa.Text, nullable=False),
        sa.Column("prompt", sa.Text, nullable=False),
        sa.Column("prompt_len", sa.Integer, nullable=False),
        sa.Column("tokens", sa.LargeBinary, nullable=False),
        sa.Column("out_start", sa.Integer, nullable=False),
        sa.Column("text", sa.Text, nullable=False),
        sa.Column("offsets", sa.LargeBinary, nullable=False),
        sa.Column("state_id", sa.String(80)),
        sa.Column("state_pos", sa.Integer, nullable=False),
        sa.Column("prompt_tokens", sa.Integer, nullable=False),
        sa.Column("completion_tokens", sa.Integer, nullable=False),
        sa.Column("prefill_time", sa.Float, nullable=False),
        sa.Column("gen_time", sa.Float, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("updated_at", sa.Float, nullable=False),
    )
    op.create_index("ix_tasks_status", "tasks", ["status"])
    op.create_table(
        "states",
        sa.Column("id", sa.String(80), primary_key=True),
        sa.Column("task_id", sa.String(80), nullable=False),
        sa.Column("is_template", sa.Boolean, nullable=False),
        sa.Column("signature", sa.String(128), nullable=False),
        sa.Column("meta", sa.Text, nullable=False),
        sa.Column("nbytes", sa.BigInteger, nullable=False),
        sa.Column("checksum", sa.String(64), nullable=False),
        sa.Column("data", sa.LargeBinary, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
    )
    op.create_index("ix_states_task", "states", ["task_id"])


def downgrade() -> None:
    op.drop_table("states")
    op.drop_table("tasks")

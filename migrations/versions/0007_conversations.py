"""Schema v7: conversations (OpenAI's Conversations API), their items, and their runs.

conversations: one row per conversation (its owner, metadata, the seq of its last item, a count
of items deleted, and the response task whose state holds its items up to head_seq: a response
in the conversation forks it instead of prefilling the whole history). conversation_items: the
items in order (seq), each with its id and its JSON. conversation_runs: the responses made in a
conversation whose input and output have not joined it yet; they join once the response is read
ended (server/tasks/conversations.py).

Revision ID: 0007
Revises: 0006
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "conversations",
        sa.Column("id", sa.String(80), primary_key=True),
        sa.Column("owner", sa.String(64)),
        sa.Column("metadata", sa.Text, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("last_seq", sa.Integer, nullable=False),
        sa.Column("cuts", sa.Integer, nullable=False),
        sa.Column("head_task", sa.String(160)),
        sa.Column("head_seq", sa.Integer, nullable=False),
        sa.Column("head_tokens", sa.Integer, nullable=False),
    )
    op.create_index("ix_conversations_owner_created", "conversations", ["owner", "created_at"])
    op.create_table(
        "conversation_items",
        sa.Column("conversation_id", sa.String(80), primary_key=True),
        sa.Column("seq", sa.Integer, primary_key=True),
        sa.Column("item_id", sa.String(200), nullable=False),
        sa.Column("body", sa.Text, nullable=False),
    )
    op.create_index("ux_conversation_items_id", "conversation_items", ["conversation_id", "item_id"], unique=True)
    op.create_table(
        "conversation_runs",
        sa.Column("conversation_id", sa.String(80), primary_key=True),
        sa.Column("task_id", sa.String(160), primary_key=True),
        sa.Column("base_seq", sa.Integer, nullable=False),
        sa.Column("base_cuts", sa.Integer, nullable=False),
        sa.Column("task_version", sa.Integer, nullable=False),
        sa.Column("instance", sa.String(80)),
        sa.Column("created_at", sa.Float, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("conversation_runs")
    op.drop_index("ux_conversation_items_id", table_name="conversation_items")
    op.drop_table("conversation_items")
    op.drop_index("ix_conversations_owner_created", table_name="conversations")
    op.drop_table("conversations")

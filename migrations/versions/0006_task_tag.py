"""Schema v6: tasks.tag, what a task is to the route that made it.

tasks.tag, what a task is to the route that made it: "response" (/v1/responses),
"lightning session <name>" (a rwkv_lightning state session or node), NULL (anything else), with
the index (owner, tag) that finds a key's session by name in one read on every replica, and a
unique index: a tag other than "response" names at most one task of an owner (NULL owner: ''),
so two replicas cannot make one session or node twice.

Before v6 these marks were extra stop strings in the task's parameters, each starting with U+FFFF
(a noncharacter that never matches): the upgrade moves such a mark into the column and out of the
stop strings, so the parameters keep only what the client asked for. (params is JSON text from
orjson: it starts with "{" and never holds a NUL, so PostgreSQL stores it unescaped.) A task-API
fork of a session task had inherited its source's mark: the upgrade leaves it untagged (a
session never forks a task of its own name). A task-API fork of a response cannot be told from
the next response of a chain (both carry the mark): it stays a response.

Revision ID: 0006
Revises: 0005
"""

import json

import sqlalchemy as sa
from alembic import context, op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

RESPONSE_MARK = "\uffffrwkv openai response"
SESSION_MARK = "\uffffrwkv_lightning session "


def _tag(stop: list) -> tuple[str | None, list]:
    """(the tag a pre-v6 mark says, the stop strings without the marks)."""
    tag, kept = None, []
    for s in stop:
        if s == RESPONSE_MARK:
            tag = "response"
        elif isinstance(s, str) and s.startswith(SESSION_MARK):
            tag = "lightning session " + s[len(SESSION_MARK) :]
        else:
            kept.append(s)
    return tag, kept


def upgrade() -> None:
    op.add_column("tasks", sa.Column("tag", sa.String(240)))
    op.create_index("ix_tasks_owner_tag", "tasks", ["owner", "tag"])
    if context.is_offline_mode():  # rendering the DDL (migrate.render_sql): no rows to read
        return _named_index()
    conn = op.get_bind()
    q = "SELECT id, parent_id, params FROM tasks WHERE params LIKE :m"
    marked = {}
    for task_id, parent_id, text in conn.execute(sa.text(q), {"m": "%\uffff%"}).fetchall():
        params = json.loads(text)
        if isinstance(params.get("stop"), list):
            tag, params["stop"] = _tag(params["stop"])
            marked[task_id] = (tag, parent_id, params)
    for task_id, (tag, parent_id, params) in marked.items():
        if tag is None:
            continue
        parent = marked.get(parent_id)
        if tag.startswith("lightning session ") and parent is not None and parent[0] == tag:
            tag = None  # a task-API fork inherited its source's mark: no session makes a child of its own name
        conn.execute(
            sa.text("UPDATE tasks SET tag = :tag, params = :params WHERE id = :id"),
            {"tag": tag, "params": json.dumps(params, ensure_ascii=False, separators=(",", ":")), "id": task_id},
        )
    _one_task_per_name(conn)
    _named_index()


def _named_index() -> None:
    op.create_index(
        "ux_tasks_named",
        "tasks",
        [sa.text("coalesce(owner, '')"), "tag"],
        unique=True,
        sqlite_where=sa.text("tag <> 'response'"),
        postgresql_where=sa.text("tag <> 'response'"),
    )


def _one_task_per_name(conn) -> None:
    """Where older servers made two tasks of one session name (replicas racing), the newest was
    the session: the others lose the tag (they stay as plain tasks)."""
    q = "SELECT id, owner, tag FROM tasks WHERE tag IS NOT NULL AND tag <> 'response' ORDER BY created_at DESC, id DESC"
    seen = set()
    for task_id, owner, tag in conn.execute(sa.text(q)).fetchall():
        if (owner or "", tag) in seen:
            conn.execute(sa.text("UPDATE tasks SET tag = NULL WHERE id = :id"), {"id": task_id})
        seen.add((owner or "", tag))


def downgrade() -> None:
    op.drop_index("ux_tasks_named", table_name="tasks")
    op.drop_index("ix_tasks_owner_tag", table_name="tasks")
    with op.batch_alter_table("tasks") as batch:
        batch.drop_column("tag")

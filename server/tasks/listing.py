"""Listing the task database: the page of stored rows behind the task list (Inventory.list), in
SQLAlchemy Core that SQLite and PostgreSQL both run.

What a key lists (`listable`): its own rows and the public templates, less those a private template
of its own of the same name shadows (`shadowed_by`: the name reaches that one, access.Access.lookup),
and never the claim of a template being made (claims.unmade). The prompt search is a substring of
the prompt, ASCII letters of either case alike (`ascii_lower`: the same in memory, on SQLite and on
PostgreSQL), bound as a plain parameter, never a LIKE pattern. A page's rows hold LIST_COLUMNS and
the start of each prompt (`prompt_head`, the summary's preview), never the whole prompt. The two
dialects differ in the search (`_prompt_search`: PostgreSQL's escaped prompts, schema._PgNulSafe)
and in the prompt's start (`_prompt_head`: SQLite's substr() of text stops at a NUL).
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from server.tasks.claims import unmade
from server.tasks.database import Database
from server.tasks.records import OWNER_TAG
from server.tasks.schema import DbRow, tasks

_CHUNK = 500  # ids per IN (...) list

LIST_COLUMNS = (
    tasks.c.id,
    tasks.c.kind,
    tasks.c.status,
    tasks.c.finish_reason,
    tasks.c.created_at,
    tasks.c.updated_at,
    tasks.c.parent_id,
    tasks.c.completion_tokens,
    tasks.c.state_id,
    tasks.c.instance,
    tasks.c.public,
    tasks.c.state_pos,
    tasks.c.owner,
)
"""The columns of Listing.list_tasks' rows (beside `prompt_head`): a list's fields, never the prompt."""

LOWER = "abcdefghijklmnopqrstuvwxyz"
UPPER = LOWER.upper()
_FOLD = str.maketrans(UPPER, LOWER)


def ascii_lower(text: str) -> str:
    """`text` with A-Z as a-z and nothing else changed: how a prompt search folds case, the same
    in memory (Inventory), on SQLite (its lower() knows ASCII letters only) and on PostgreSQL
    (translate(), as its lower() follows the locale)."""
    return text.translate(_FOLD)


class Listing:
    """The list queries of the task database (`db`: its read transactions)."""

    def __init__(self, db: Database) -> None:
        self.db = db

    async def list_tasks(
        self,
        owner: str | None,
        all_owners: bool,
        kind: str | None,
        limit: int,
        offset: int,
        prompt_contains: str | None = None,
        head: int = 81,
    ) -> tuple[list[DbRow], int]:
        """A page of the rows `owner` may list (its own and the public templates it does not
        shadow: listable), newest first. `prompt_contains`: only the rows whose prompt (the
        text of the last one) contains it, ASCII letters of either case alike; it is bound as a
        plain parameter, never a LIKE pattern, and holds no NUL nor U+FFFF (the list route
        refuses them). Each row's `prompt_head` is the start of its prompt, its whole text when
        shorter: at least its first `head` characters (PostgreSQL), or its first 4 * `head` bytes
        of UTF-8 (SQLite, whose substr() of text stops at a NUL; the last character may be cut)."""
        cond = [~unmade()] + ([] if all_owners else [listable(owner)])  # a claim is no template yet
        if kind:
            cond.append(tasks.c.kind == kind)
        async with self.db.read() as conn:
            pg = conn.dialect.name == "postgresql"
            if prompt_contains is not None:
                cond.append(_prompt_search(prompt_contains, pg))
            total = (await conn.execute(sa.select(sa.func.count()).select_from(tasks).where(*cond))).scalar_one()
            q = (
                sa.select(*LIST_COLUMNS, _prompt_head(head, pg).label("prompt_head"))
                .where(*cond)
                .order_by(tasks.c.created_at.desc(), tasks.c.id)
                .limit(limit)
                .offset(offset)
            )
            return list((await conn.execute(q)).all()), int(total)

    async def shadowed(self, owner: str, ids: list[str]) -> set[str]:
        """Those of `ids` (template ids) that a private template of `owner`'s shadows (shadowed_by)."""
        found = set[str]()
        async with self.db.read() as conn:
            for i in range(0, len(ids), _CHUNK):
                q = sa.select(tasks.c.id).where(tasks.c.id.in_(ids[i : i + _CHUNK]), shadowed_by(owner))
                found.update((await conn.execute(q)).scalars().all())
        return found


def listable(owner: str | None) -> sa.ColumnElement[bool]:
    """The rows `owner` may list: its own and the public templates, less those it shadows."""
    own = tasks.c.owner == owner if owner is not None else tasks.c.owner.is_(None)
    public = sa.and_(tasks.c.kind == "template", tasks.c.public == sa.true())
    if owner is None:
        return sa.or_(own, public)
    return sa.and_(sa.or_(own, public), ~shadowed_by(owner))


def shadowed_by(owner: str) -> sa.ColumnElement[bool]:
    """A public template that a private template of `owner`'s of the same name shadows: that
    one (`_<name>@<owner prefix>`, records.qualified) is what the name reaches for `owner`
    (access.Access.lookup). A public template's id has no `@`. A correlated EXISTS on the
    primary key: plain SQL on SQLite and PostgreSQL alike."""
    mine = tasks.alias("mine")
    private = sa.exists().where(mine.c.id == tasks.c.id + f"@{owner[:OWNER_TAG]}", mine.c.owner == owner)
    return sa.and_(tasks.c.kind == "template", tasks.c.public == sa.true(), private)


def _prompt_head(head: int, pg: bool) -> sa.ColumnElement[Any]:
    """list_tasks' `prompt_head` column: the start of each row's prompt (see list_tasks)."""
    prompt = tasks.c.prompt
    if pg:  # an escaped prompt (schema._PgNulSafe) takes up to 2 characters for 1; its type decodes them
        return sa.func.substr(prompt, 1, 2 * head + 1, type_=prompt.type)
    # the bytes of a blob, as SQLite's substr() of text stops at a NUL
    return sa.func.substr(sa.cast(prompt, sa.LargeBinary), 1, 4 * head, type_=sa.LargeBinary)


def _prompt_search(contains: str, pg: bool) -> sa.ColumnElement[bool]:
    """list_tasks' condition: the prompt contains `contains`, ASCII letters of either case alike
    (ascii_lower), `contains` bound as a plain parameter (never a LIKE pattern)."""
    prompt = tasks.c.prompt
    needle = _text(ascii_lower(contains))
    if not pg:  # lower(): ASCII letters only
        return sa.func.instr(sa.func.lower(prompt), needle) > 0
    # a prompt holding a NUL, or starting with U+FFFF, is stored escaped: U+FFFF, then U+FFFF "0"
    # for each NUL and U+FFFF "1" for each U+FFFF; such a prompt is searched with each escape read
    # as one U+FFFF, which a needle never holds.
    # translate(): ASCII letters only, as SQLite's lower() (PostgreSQL's follows the locale)
    mark = _text("\uffff")
    collapsed = sa.func.regexp_replace(sa.func.substr(prompt, 2), _text("\uffff[01]"), mark, "g")
    searched = sa.case((sa.func.substr(prompt, 1, 1) == mark, collapsed), else_=prompt)
    return sa.func.strpos(sa.func.translate(searched, UPPER, LOWER), needle) > 0


def _text(value: str) -> sa.BindParameter[str]:
    """`value` as a plain bound parameter of type Text."""
    return sa.literal(value, sa.Text())

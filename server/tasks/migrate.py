"""Apply the versioned migrations in `migrations/` (Alembic, programmatic; no alembic.ini).

Called from the store at start inside `AsyncConnection.run_sync`, so it runs on the server's own
connection. A database whose revision this server does not know (a newer server wrote it) is
refused with `SchemaTooNewError` and left untouched.
"""

from __future__ import annotations

import io
import logging
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.util.exc import CommandError
from sqlalchemy.engine import Connection

log = logging.getLogger("server.tasks.store")

MIGRATIONS_DIR = Path(__file__).resolve().parents[2] / "migrations"


class SchemaTooNewError(RuntimeError):
    """The database was written by a newer server (unknown schema revision)."""


class MigrationsMissing(RuntimeError):
    """The server runs from an install without its source tree (the migrations live there)."""


def alembic_config(connection: Connection | None = None) -> Config:
    if not (MIGRATIONS_DIR / "versions").is_dir():
        raise MigrationsMissing(
            f"the schema migrations are not at {MIGRATIONS_DIR}: run the server from its source tree "
            "(pip install -e . there, as the README does; a built wheel does not carry them)"
        )
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg


def head_revision() -> str:
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None, f"no migrations found in {MIGRATIONS_DIR}"
    return head


def current_revision(connection: Connection) -> str | None:
    return MigrationContext.configure(connection).get_current_revision()


MIGRATION_LOCK = 0x52574B56  # PostgreSQL advisory lock class of the migrations ("RWKV"); the key: the schema's hash
MIGRATION_WAIT_S = 600  # how long a start waits for another server's migration of its schema


def upgrade(connection: Connection, target: str = "head") -> tuple[str | None, str]:
    """Upgrade the database on `connection` to `target`; returns (revision before, after).
    On PostgreSQL it first takes a transaction-scoped advisory lock of its schema (servers in
    other schemas of the database, `options=-c search_path=...`, do not wait for it), so a
    second server migrating the same schema waits for the first (up to MIGRATION_WAIT_S, not
    the busy timeout: a migration may rewrite a table of states) and then finds nothing to do."""
    if connection.dialect.name == "postgresql":
        _lock_schema(connection)
    cfg = alembic_config(connection)
    script = ScriptDirectory.from_config(cfg)
    before = current_revision(connection)
    if before is not None:
        try:
            known = script.get_revision(before)
        except CommandError:
            known = None
        if known is None:
            raise SchemaTooNewError(
                f"the task database has schema revision {before!r}, which this server does not "
                f"know (newest known: {script.get_current_head()!r}); it was written by a newer "
                f"server. Run that server version, or point --db at another database."
            )
    command.upgrade(cfg, target)
    return before, current_revision(connection) or ""


def render_sql(dialect: str = "postgresql", target: str = "head") -> str:
    """The DDL the migrations would run on `dialect` (offline mode; nothing is executed)."""
    buf = io.StringIO()
    cfg = alembic_config()
    cfg.attributes.update(dialect_name=dialect, output_buffer=buf)
    command.upgrade(cfg, target, sql=True)
    return buf.getvalue()


def _lock_schema(connection: Connection) -> None:
    """Take the migration lock of the connection's schema, saying so when another server holds it."""
    key = f"{MIGRATION_LOCK}, hashtext(coalesce(current_schema(), ''))"
    if connection.exec_driver_sql(f"SELECT pg_try_advisory_xact_lock({key})").scalar():
        return
    schema = connection.exec_driver_sql("SELECT current_schema()").scalar()
    log.warning("another server is migrating schema %r of the task database; waiting for it (up to %d s)",
                schema, MIGRATION_WAIT_S)  # fmt: skip
    connection.exec_driver_sql(f"SET LOCAL lock_timeout = '{MIGRATION_WAIT_S}s'")
    connection.exec_driver_sql(f"SELECT pg_advisory_xact_lock({key})")

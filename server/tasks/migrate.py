"""Apply the versioned migrations in `migrations/` (Alembic, programmatic; no alembic.ini).

Called from the store at start inside `AsyncConnection.run_sync`, so it runs on the server's own
connection. A database whose revision this server does not know (a newer server wrote it) is
refused with `SchemaTooNewError` and left untouched.
"""

from __future__ import annotations

import io
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.util.exc import CommandError
from sqlalchemy.engine import Connection

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


MIGRATION_LOCK = 0x52574B56_07  # PostgreSQL advisory lock key of the migrations ("RWKV", 7)


def upgrade(connection: Connection, target: str = "head") -> tuple[str | None, str]:
    """Upgrade the database on `connection` to `target`; returns (revision before, after).
    On PostgreSQL it first takes a transaction-scoped advisory lock, so a second server
    migrating the same database waits for the first and then finds nothing to do."""
    if connection.dialect.name == "postgresql":
        connection.exec_driver_sql(f"SELECT pg_advisory_xact_lock({MIGRATION_LOCK})")
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

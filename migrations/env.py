"""Alembic environment. Online: migrations run only through server.tasks.migrate.upgrade(), on
the connection it passes in (`config.attributes["connection"]`). Offline (`sql=True`): render
the DDL for a dialect (`config.attributes["dialect_name"]`, e.g. postgresql), used by
server.tasks.migrate.render_sql() to review what a PostgreSQL database would run."""

from alembic import context

config = context.config

if context.is_offline_mode():
    context.configure(dialect_name=config.attributes.get("dialect_name", "postgresql"),
                      output_buffer=config.attributes.get("output_buffer"), literal_binds=True,
                      transaction_per_migration=True)
    with context.begin_transaction():
        context.run_migrations()
else:
    connection = config.attributes.get("connection")
    if connection is None:
        raise RuntimeError("run migrations through server.tasks.migrate.upgrade(connection)")
    context.configure(connection=connection, target_metadata=None, transaction_per_migration=True)
    with context.begin_transaction():
        context.run_migrations()

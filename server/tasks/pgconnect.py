"""PostgreSQL connection options of the task store (split from server/tasks/database.py for size):
the libpq query options of a URL translated for asyncpg, and the time bounds of every wait on
the database, all from one setting, db_busy_timeout (B, 30 s by default).

Which bound applies where:
  - connecting (asyncpg `timeout`; a listener that accepts and never answers): B, or the URL's
    libpq `connect_timeout`;
  - a pooled connection, when all are in use (SQLAlchemy `pool_timeout`): B;
  - a statement waiting for another transaction's lock (PostgreSQL's `lock_timeout`, server
    side: a `LOCK TABLE`, a row another server writes): B, as SQLite's busy timeout. It fails
    with SQLSTATE 55P03 and leaves the connection usable;
  - a statement the server does not answer at all (asyncpg `command_timeout`, client side: a
    frozen or cut-off server): B + a slack (B, at most STATEMENT_SLACK_S), so that a lock wait
    ends by the server's own lock_timeout first. This bound counts a statement's whole time,
    not its waits only, so a statement that moves much data is given more (Database.allow): a
    state blob written (B + slack + its bytes at WRITE_BYTES_PER_S: 21 MB, +5 s), the states
    the byte budget drops (their bytes at DROP_BYTES_PER_S), a schema migration at start
    (MIGRATION_STATEMENT_S). (PostgreSQL's statement_timeout is not set: it would cut those.)
A timed-out statement or connection is TaskUnavailable (503 with Retry-After), as SQLite's busy
timeout is. A request thus waits about B + slack for one statement (a pooled connection is
pinged first, and one found dead replaced: up to about twice that), or behind a write ahead of
it in the writer's queue.

libpq's TCP options, which asyncpg has no arguments for, are set on each new connection's socket
(tcp_setup): keepalives on by default, as libpq has them, with the system's timings (Linux: the
first probe after 2 hours idle) unless the URL sets them: behind a NAT or firewall that drops
idle flows, set keepalives_idle below its idle timeout. (The pool pings a connection before
lending it either way: a dead one is replaced, not used.)
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

from sqlalchemy.engine import URL, make_url
from sqlalchemy.ext.asyncio import AsyncConnection

STATEMENT_SLACK_S = 5.0
WRITE_BYTES_PER_S = 4 * 2**20  # the slowest link a state blob is expected to cross
DROP_BYTES_PER_S = 256 * 2**20  # a deleted state's TOAST chunks, marked dead by the server
MIGRATION_STATEMENT_S = 600.0  # a migration may rewrite a table of states
SSL_MODES = ("disable", "allow", "prefer", "require", "verify-ca", "verify-full")

_KWARGS = {"host", "port", "user", "password", "passfile", "database", "target_session_attrs", "krbsrvname", "gsslib",
           "prepared_statement_cache_size"}  # fmt: skip
"""Query options SQLAlchemy hands asyncpg.connect as they are (its own keyword arguments)."""
_DSN = {"sslrootcert", "sslcert", "sslkey", "sslcrl", "sslpassword", "ssl_min_protocol_version",
        "ssl_max_protocol_version"}  # fmt: skip
"""libpq's TLS file options, which asyncpg reads from a DSN's query (only there)."""
_FILES = {"sslrootcert", "sslcert", "sslkey", "sslcrl"}
_TCP = {"keepalives": "keepalives", "keepalives_idle": "idle", "keepalives_interval": "interval",
        "keepalives_count": "count", "tcp_user_timeout": "user_timeout"}  # fmt: skip
"""libpq's TCP options (-> TcpOptions' fields), which asyncpg lacks: set on the socket (tcp_setup)."""
_TCP_MAX = {"keepalives_idle": 32767, "keepalives_interval": 32767, "keepalives_count": 127,
            "tcp_user_timeout": 2**31 - 1}  # fmt: skip
"""The largest values Linux takes (a larger one fails every connection with EINVAL)."""
SUPPORTED = sorted(
    _KWARGS | _DSN | set(_TCP) | {"sslmode", "ssl", "dbname", "application_name", "connect_timeout", "options"}
)
log = logging.getLogger("server.tasks.store")
_OURS = {
    "lock_timeout": "--db-busy-timeout bounds every lock wait",
    "statement_timeout": "it would cut a large state's write or a migration; the server bounds each statement itself",
}
"""Server settings a URL's `options` may not change: the store's bounds rest on them."""


def query_problem(url: str) -> str | None:
    """Why a PostgreSQL URL's query cannot be used (one line, naming the option), or None."""
    try:
        connect_args(url, 1.0)
    except ValueError as exc:
        return str(exc)
    return None


def connect_args(url: str, busy_timeout: float) -> tuple[URL, dict[str, Any]]:
    """(the URL without the options moved, asyncpg's connect arguments): the time bounds (the
    module's doc) and the URL's libpq options: `sslmode` (or asyncpg's `ssl`, same values) as
    asyncpg's `ssl`, `dbname` as `database`, `application_name` and `options`' settings
    (server_options) as server settings, `connect_timeout` (seconds) as the connect timeout, the
    TLS file options through a DSN; the TCP options are tcp_options'.
    ValueError (one line) for any other option, or a value out of range."""
    tcp_options(url)  # (checked here too: the start-up check calls this alone)
    u = make_url(url)
    connect_s = busy_timeout
    settings = {"lock_timeout": str(max(1, round(busy_timeout * 1000)))}  # (ms)
    args: dict[str, Any] = {}
    dsn: dict[str, str] = {}
    moved = []
    for name, raw in u.query.items():
        value = raw[-1] if isinstance(raw, tuple) else raw
        if name in _KWARGS:
            continue
        moved.append(name)
        if name in _TCP:
            continue
        if name in ("sslmode", "ssl"):
            if value not in SSL_MODES:
                raise ValueError(f"?{name}={value}: use one of {', '.join(SSL_MODES)}")
            args["ssl"] = value
        elif name in _DSN:
            if name in _FILES and not os.path.exists(value):  # (asyncpg's error would not name it)
                raise ValueError(f"?{name}={value}: no such file")
            dsn[name] = value
        elif name == "dbname":
            u = u.set(database=value)
        elif name == "application_name":
            settings["application_name"] = value
        elif name == "options":
            settings.update(server_options(value))
        elif name == "connect_timeout":
            try:
                connect_s = float(value)
            except ValueError:
                connect_s = 0.0
            if not 0 < connect_s < float("inf"):
                raise ValueError(f"?connect_timeout={value}: must be a number of seconds above 0")
        else:
            raise ValueError(f"unsupported option {name!r} in the URL's query (supported: {', '.join(SUPPORTED)})")
    if dsn:
        args["dsn"] = "postgresql://?" + urlencode(dsn)
    args.update(timeout=connect_s, command_timeout=statement_bound(busy_timeout), server_settings=settings)
    return u.difference_update_query(moved), args


@dataclass(frozen=True)
class TcpOptions:
    """libpq's TCP options of a URL, with libpq's defaults (0: the system's value)."""

    keepalives: bool = True
    idle: int = 0
    """Seconds of silence before the first keepalive probe (TCP_KEEPIDLE)."""
    interval: int = 0
    """Seconds between unanswered probes (TCP_KEEPINTVL)."""
    count: int = 0
    """Probes unanswered before the connection is dead (TCP_KEEPCNT)."""
    user_timeout: int = 0
    """Milliseconds sent data may stay unacknowledged before the connection is dead (TCP_USER_TIMEOUT)."""


def tcp_options(url: str) -> TcpOptions:
    """The URL's `keepalives` (0 or 1), `keepalives_idle`, `keepalives_interval`,
    `keepalives_count` and `tcp_user_timeout` (whole numbers, 0 or more) as TcpOptions.
    ValueError (one line) for a value out of range."""
    given: dict[str, Any] = {}
    for name, raw in make_url(url).query.items():
        if name not in _TCP:
            continue
        value = raw[-1] if isinstance(raw, tuple) else raw
        if name == "keepalives":
            if value not in ("0", "1"):
                raise ValueError(f"?keepalives={value}: use 1 (on, the default) or 0 (off)")
            given["keepalives"] = value == "1"
        elif value.isascii() and value.isdecimal() and int(value) <= _TCP_MAX[name]:
            given[_TCP[name]] = int(value)
        else:
            unit = "milliseconds" if name == "tcp_user_timeout" else "probes" if name.endswith("count") else "seconds"
            raise ValueError(
                f"?{name}={value}: must be a whole number of {unit} from 0 (the system's) to {_TCP_MAX[name]}"
            )
    return TcpOptions(**given)


_unreachable_said = False


def tcp_setup(dbapi_conn: Any, opts: TcpOptions) -> None:
    """Set `opts` on a new connection's socket (SQLAlchemy's pool "connect" event: `dbapi_conn`
    is its adapter of the asyncpg connection). A Unix socket has none to set (libpq's rule);
    where this asyncpg hides its socket, the system's defaults stay (logged)."""
    global _unreachable_said
    transport = getattr(getattr(dbapi_conn, "driver_connection", None), "_transport", None)
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is None:
        if not _unreachable_said:
            _unreachable_said = True
            log.warning("PostgreSQL connections: their sockets are out of reach; the URL's TCP options are not set")
        return
    if sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    timings = (("TCP_KEEPIDLE", opts.idle), ("TCP_KEEPINTVL", opts.interval), ("TCP_KEEPCNT", opts.count))
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, int(opts.keepalives))
        for name, value in (*(timings if opts.keepalives else ()), ("TCP_USER_TIMEOUT", opts.user_timeout)):
            if value and hasattr(socket, name):  # (Linux names; a system without one keeps its default)
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
    except OSError as exc:  # (values the checks let through that this system refuses: the connection works on)
        log.warning("PostgreSQL connection: a TCP option of the URL was refused by the system (%s): %s", opts, exc)


def server_options(options: str) -> dict[str, str]:
    """libpq's `options` (command-line options sent at connection start) as server settings:
    `-c name=value`, `-cname=value` or `--name=value`, separated by spaces (a backslash keeps
    the next character, a space included), e.g. `-c search_path=tenant_a` for a schema of its own.
    (In a URL a `+` reads as a space, as in any query string: write a plus sign as %2B.)
    ValueError (one line) for any other option, or a setting the store's bounds rest on."""
    words, word, escaped, started = [], "", False, False
    for ch in options:
        if escaped:
            word, escaped, started = word + ch, False, True
        elif ch == "\\":
            escaped = True
        elif ch.isspace():
            if started:
                words.append(word)
            word, started = "", False
        else:
            word, started = word + ch, True
    if started or escaped:
        words.append(word + ("\\" if escaped else ""))
    out: dict[str, str] = {}
    it = iter(words)
    for w in it:
        shown = f"-c {next(it, '')}" if w == "-c" else w
        pair = shown[2:].lstrip() if shown.startswith(("--", "-c")) else ""
        key, eq, value = pair.partition("=")
        if not key or not eq:
            raise ValueError(f"?options: {shown!r} is not a server setting (use -c name=value)")
        key = key.replace("-", "_").lower()  # (PostgreSQL's names ignore case)
        if key in _OURS:
            raise ValueError(f"?options: {key} may not be set here: {_OURS[key]}")
        out[key] = value
    return out


def statement_bound(busy_timeout: float, *, written: int = 0, dropped: int = 0) -> float:
    """Seconds a statement may take before it is abandoned (the module's doc)."""
    slack = min(STATEMENT_SLACK_S, busy_timeout)
    return busy_timeout + slack + written / WRITE_BYTES_PER_S + dropped / DROP_BYTES_PER_S


async def set_bound(conn: AsyncConnection, seconds: float) -> Any:
    """Set the time bound of the statements of `conn` (its asyncpg connection's default: SQLAlchemy
    passes asyncpg no per-statement timeout); returns that connection, or None where this asyncpg
    keeps its defaults elsewhere (the usual bound then stays)."""
    raw = (await conn.get_raw_connection()).driver_connection
    return raw if reset_bound(raw, seconds) else None


def reset_bound(raw: Any, seconds: float) -> bool:
    cfg = getattr(raw, "_config", None)  # asyncpg's ConnectionConfiguration, a named tuple
    if cfg is None or not hasattr(cfg, "_replace") or not hasattr(cfg, "command_timeout"):
        return False
    raw._config = cfg._replace(command_timeout=seconds)
    return True


def connect_timed_out(url: str, busy_timeout: float) -> TimeoutError:
    """The error of a connection attempt that timed out (asyncpg's says nothing): where to, and
    after how long."""
    u, args = connect_args(url, busy_timeout)
    return TimeoutError(
        f"connecting to {u.host or 'localhost'}:{u.port or 5432} timed out after {args['timeout']:g} s (the "
        "server accepts no connection or does not answer; --db-busy-timeout bounds the wait)"
    )

"""libpq's TCP options in a PostgreSQL URL (`keepalives`, `keepalives_idle`, `keepalives_interval`,
`keepalives_count`, `tcp_user_timeout`), which asyncpg has no arguments for, are set on each
pooled connection's socket (server/tasks/pgconnect.py, tcp_setup), keepalives on by default as
libpq has them; a bad value refuses the start in one line (its cases beside the other options':
test_pg_timeouts.py). They were refused as unsupported options: a URL copied from a libpq client
stopped the server. Real PostgreSQL (test/pg_util.py; skipped without it), read back with
getsockopt."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from pg_util import pg_cluster, pg_url  # noqa: F401 - fixtures
from server.tasks.store import Store

ROOT = Path(__file__).resolve().parents[1]
LINUX = pytest.mark.skipif(not hasattr(socket, "TCP_KEEPIDLE"), reason="TCP_KEEPIDLE & co. are Linux's names")


async def socket_options(url: str) -> dict[str, int]:
    """The TCP options of the socket of a connection of a store opened on url."""
    store = Store(url, busy_timeout=5.0)
    await store.open()
    try:
        async with store.read() as conn:
            raw = (await conn.get_raw_connection()).driver_connection
            sock = raw._transport.get_extra_info("socket")
            opt = sock.getsockopt
            return {
                "keepalive": opt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
                "idle": opt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
                "interval": opt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL),
                "count": opt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT),
                "user_timeout": opt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT),
            }
    finally:
        await store.close()


@LINUX
async def test_the_urls_tcp_options_are_on_the_connections_socket(pg_url):
    got = await socket_options(f"{pg_url}?keepalives_idle=7&keepalives_interval=3&keepalives_count=4"
                               "&tcp_user_timeout=9000&application_name=ka")
    assert got == {"keepalive": 1, "idle": 7, "interval": 3, "count": 4, "user_timeout": 9000}


@LINUX
async def test_keepalives_are_on_by_default_and_off_when_asked(pg_url):
    plain = socket.socket()  # the system's defaults, which options left at 0 keep
    defaults = {"idle": plain.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
                "interval": plain.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL)}
    plain.close()
    on = await socket_options(pg_url)  # libpq's default: on, with the system's timings
    assert on["keepalive"] == 1 and (on["idle"], on["interval"]) == (defaults["idle"], defaults["interval"])
    off = await socket_options(f"{pg_url}?keepalives=0&keepalives_idle=7")  # (timings of nothing: not set)
    assert off["keepalive"] == 0 and off["idle"] == defaults["idle"]


def test_a_bad_value_refuses_the_start_with_status_2():
    pytest.importorskip("asyncpg")
    r = subprocess.run([sys.executable, "-m", "server.cli", "serve", "--port", "0", "--model", "synthetic:tiny",
                        "--db", "postgresql://u:pw@127.0.0.1:1/rwkv?keepalives_idle=soon"],
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "?keepalives_idle=soon: must be a whole number of seconds" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr

"""A state read over a slow link to PostgreSQL gets the time its bytes need, as its write does
(server.tasks.pgconnect: a statement's bound counts its whole run; a blob of megabytes is given
its bytes at WRITE_BYTES_PER_S). Without that, a state written within its bound could never be
read back: every fork, continue and download of its task was a 503 that never cleared. The link
is a throttling TCP proxy in front of the test cluster (test/pg_util.py; skipped without it)."""

from __future__ import annotations

import asyncio
import contextlib
import time

from pg_util import pg_cluster, pg_url  # noqa: F401 - fixtures
from sqlalchemy.engine import make_url
from test_store import open_store
from test_store_pg import MID, big_state, task

from server.tasks.codec import encode_state
from server.tasks.records import to_row
from server.tasks.statestore import state_row
from server.tasks.store import Store

RATE = 8 * 2**20  # bytes a second from the server to the client


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, rate: float | None) -> None:
    with contextlib.suppress(ConnectionError, asyncio.CancelledError):
        while data := await reader.read(64 * 1024):
            writer.write(data)
            await writer.drain()
            if rate:
                await asyncio.sleep(len(data) / rate)
    writer.close()


@contextlib.asynccontextmanager
async def slow_proxy(port: int, rate: float):
    """A local port whose traffic from the server at `port` flows at `rate` bytes a second."""

    async def serve(cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        sr, sw = await asyncio.open_connection("127.0.0.1", port)
        await asyncio.gather(_pipe(cr, sw, None), _pipe(sr, cw, rate))

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()


async def test_a_state_written_within_its_bound_reads_back_over_a_slow_link(pg_url):
    enc = encode_state(big_state(MID, 3), MID.signature())  # ~3.4 MB: ~0.4 s over the link
    direct = await open_store(pg_url)
    await direct.save(to_row(task(1, state_id="S1", state_pos=5)), state_row("S1", "TASK_1", enc, False))
    await direct.close()
    u = make_url(pg_url)
    async with slow_proxy(int(u.port), RATE) as port:
        slow = Store(u.set(port=port).render_as_string(hide_password=False), busy_timeout=0.1)
        await slow.open()  # (a bound of 0.1 + 0.1 s per statement, without the blob's allowance)
        try:
            t0 = time.monotonic()
            row = await slow.states.get_state("S1")
            took = time.monotonic() - t0
        finally:
            await slow.close()
    assert row is not None and bytes(row.data) == bytes(enc.data)
    assert took > 0.25, f"the link was not slow ({took:.2f} s): the test proves nothing"

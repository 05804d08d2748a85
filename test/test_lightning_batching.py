"""Separate lightning requests share the engine's batches (rwkv_lightning's own server runs a
loop per request): 64 concurrent one-prompt requests take about the time of a few, not 64.
Prints the ratio; the bound is loose (it holds on a busy CPU) but fails for requests that run
one after another."""

from __future__ import annotations

import asyncio
import statistics
import time

import httpx
from util_lightning import GREEDY, idle
from util_server import server_fixture

server = server_fixture(env={"RWKV_MAX_BATCH": "64"})
N = 64
BODY = {"contents": ["User: Tell me a long story.\n\nAssistant:"], "max_tokens": 48, **GREEDY}


async def wave(url: str, n: int) -> float:
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=httpx.Limits(max_connections=n)) as c:
        t0 = time.perf_counter()
        answers = await asyncio.gather(*(c.post("/v1/chat/completions", json=BODY) for _ in range(n)))
        took = time.perf_counter() - t0
    for r in answers:
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] == "length"
    return took


def test_concurrent_requests_share_batches(server):
    asyncio.run(wave(server.url, N))  # warm-up: connections, the batch sizes
    one = statistics.median(asyncio.run(wave(server.url, 1)) for _ in range(3))
    many = asyncio.run(wave(server.url, N))
    ratio = many / one
    print(f"\n{N} concurrent lightning requests: {many:.2f} s; one request: {one:.3f} s; ratio {ratio:.1f}x "
          f"(one after another would be {N}x)")
    with httpx.Client(base_url=server.url) as c:
        idle(c)
    assert ratio < 16, f"{N} concurrent requests took {ratio:.1f}x the time of one"

"""Separate lightning requests share the engine's batches (rwkv_lightning's own server runs a
loop per request): 64 concurrent one-prompt requests of 48 tokens take a few dozen engine steps,
not the 64 x 48 of requests run one after another. Counted in engine steps (/metrics), which no
CPU load changes; the wall-time ratio is printed."""

from __future__ import annotations

import asyncio
import statistics
import time

import httpx
from util_lightning import GREEDY, idle
from util_server import server_fixture

from server.api.metrics import parse_metrics

server = server_fixture(env={"RWKV_MAX_BATCH": "64"})
N = 64
TOKENS = 48
BODY = {"contents": ["User: Tell me a long story.\n\nAssistant:"], "max_tokens": TOKENS, **GREEDY}


async def wave(url: str, n: int) -> float:
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=httpx.Limits(max_connections=n)) as c:
        t0 = time.perf_counter()
        answers = await asyncio.gather(*(c.post("/v1/chat/completions", json=BODY) for _ in range(n)))
        took = time.perf_counter() - t0
    for r in answers:
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] == "length"
    return took


def steps(url: str) -> float:
    return parse_metrics(httpx.get(url + "/metrics").text)["rwkv_engine_steps_total"]


def test_concurrent_requests_share_batches(server):
    asyncio.run(wave(server.url, N))  # warm-up: connections, the batch sizes
    one = statistics.median(asyncio.run(wave(server.url, 1)) for _ in range(3))
    s0 = steps(server.url)
    many = asyncio.run(wave(server.url, N))
    ran = steps(server.url) - s0
    print(f"\n{N} concurrent lightning requests: {many:.2f} s in {ran:.0f} engine steps; one request: {one:.3f} s; "
          f"ratio {many / one:.1f}x (one after another would be {N}x, {N * TOKENS} steps)")
    with httpx.Client(base_url=server.url) as c:
        idle(c)
    assert ran < N * TOKENS / 8, f"{N} concurrent requests of {TOKENS} tokens took {ran:.0f} engine steps"

"""The HTTP stats line: written for an interval in which something happened, never for an idle
server (monitoring probes of /health and /metrics are no activity)."""

from __future__ import annotations

import asyncio
import logging

from server.api.app import http_stats_loop
from server.api.metrics import Metrics


async def _lines(caplog, metrics: Metrics, during) -> list[str]:
    caplog.set_level(logging.INFO, logger="server.app")
    caplog.clear()
    task = asyncio.create_task(http_stats_loop(metrics, 0.02))
    try:
        await during()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("http:")]


async def test_an_idle_server_writes_no_stats_line(caplog):
    m = Metrics()

    async def probes():
        for _ in range(10):
            m.count_request("GET", "/health", 200)
            m.count_request("GET", "/metrics", 200)
            await asyncio.sleep(0.01)

    assert await _lines(caplog, m, probes) == []


async def test_activity_writes_one_line_per_interval_with_activity(caplog):
    m = Metrics()

    async def one_burst():
        await asyncio.sleep(0.03)
        m.count_request("POST", "/v1/completions", 200)
        m.count_request("POST", "/v1/completions", 503)
        await asyncio.sleep(0.15)  # then idle again

    lines = await _lines(caplog, m, one_burst)
    assert len(lines) == 1 and "2 requests, 1 5xx, 0 streams open" in lines[0]

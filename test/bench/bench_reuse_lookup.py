"""The Responses reuse lookup (server/api/responses/reuse.py) on a key with many conversations:
its responses share a long system prompt, and each create's history sent whole must find its
own conversation's previous response among them. Prints the indexing time (once) and the
lookup time per create. CPU only: the task layer runs on the scripted engine of the tests.

    PYTHONPATH=.:test python test/bench/bench_reuse_lookup.py [--responses 1024] [--system-tokens 12000]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time

from task_fakes import FakeEngine, FakeShape
from test_responses_reuse import ByteTokenizer

from server.api.responses.reuse import Recent
from server.tasks import TaskConfig, TaskManager


async def run(n: int, system_tokens: int, db: str) -> None:
    tm = TaskManager(FakeEngine(), ByteTokenizer(), TaskConfig(db=db), FakeShape())
    await tm.start()
    try:
        system = "System: " + "x" * system_tokens  # (one token a byte)
        recent, ids = Recent(), []
        for i in range(n):
            made = await tm.create(f"{system}\n\nUser: conversation {i}\n\nAssistant:", {"max_tokens": 0},
                                   persistent=False, owner="app", tag="response")  # fmt: skip
            ids.append((await tm.wait(made.id, timeout=30)).id)
            recent.add("app", made.id)
        t0 = time.perf_counter()
        await recent.find(tm, tm.inputs.tokenizer, "app", None, "(indexes them)")
        print(f"indexing {n} ended responses: {(time.perf_counter() - t0) * 1e3:.1f} ms")
        for i in (0, n // 2, n - 1):
            text = f"{system}\n\nUser: conversation {i}\n\nAssistant: yes\n\nUser: more\n\nAssistant:"
            t0 = time.perf_counter()
            for _ in range(20):
                found = await recent.find(tm, tm.inputs.tokenizer, "app", None, text)
            ms = (time.perf_counter() - t0) / 20 * 1e3
            assert found is not None and found.task.id == ids[i]
            print(f"lookup among {n} ({len(text):,}-token prompt, conversation {i}): {ms:.2f} ms")
    finally:
        await tm.close()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--responses", type=int, default=1024)
    p.add_argument("--system-tokens", type=int, default=12000)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        asyncio.run(run(a.responses, a.system_tokens, f"{d}/reuse.db"))


if __name__ == "__main__":
    main()

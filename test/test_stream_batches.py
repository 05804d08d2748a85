"""server.tasks.streaming.batches, the loop path of a task's stream (task, lightning and slow
clients' streams): a change that happens while its reader holds a batch (a slow client under flow
control) is not lost; the next wait would otherwise wait for a notify that already passed."""

from __future__ import annotations

import asyncio

import pytest

from server.tasks.output import Output
from server.tasks.records import Task
from server.tasks.streaming import KEEPALIVE, batches


@pytest.mark.parametrize("ping", [None, 30.0])
def test_an_end_while_the_reader_holds_a_batch_is_not_missed(ping):
    async def main():
        out = Output(finished=False)
        t = Task(id="TASK_x", kind="task", out=out)
        it = batches(t, ping=ping)
        out.append("a", 1)
        out.notify()
        assert [e["data"] for e in await it.__anext__()] == ["a"]
        # the reader holds batch 1 (its write is slow): more text and the end come, notified now
        out.append("b", 1)
        out.finished, out.finish_reason = True, "stop"
        out.notify()
        last = await asyncio.wait_for(it.__anext__(), 5)  # waited for a passed notify: 30 s or for ever
        assert last[0]["data"] == "b" and last[-1] is not KEEPALIVE
        with pytest.raises(StopAsyncIteration):
            await it.__anext__()

    asyncio.run(main())

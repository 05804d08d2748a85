"""The public `rwkv-api` SDK (0.1.2) against a real server (uvicorn subprocess, tiny model):
its whole surface, sync and async, including its typed exceptions for 404 and 422. (The same
routes over raw HTTP, the bytes the SDK never shows: test_task_api_raw_http.)

SDK note: `AsyncClient.create(stream=True)` / `fim(stream=True)` raise TypeError inside the SDK
itself (it awaits an async generator); its `create_stream` / `fim_stream` are the working forms.
"""

from __future__ import annotations

import pytest
import rwkv_api
from rwkv_api import AsyncClient, Client, RWKVError, RWKVValidationError, Status, TaskNotFoundError
from util_server import server_fixture

server = server_fixture(env={"RWKV_DEFAULT_MAX_TOKENS": "8", "RWKV_MAX_BATCH": "16"})
G = {"temperature": 0, "presence_penalty": 0, "repetition_penalty": 0}
POLL = 0.05


@pytest.fixture
def client(server):
    with Client(server.url, timeout=30) as c:
        yield c


@pytest.fixture
async def aclient(server):
    async with AsyncClient(server.url, timeout=30) as c:
        yield c


# --- sync ----------------------------------------------------------------------------------------
def test_sync_create_wait_result_status(client):
    t = client.create("Hello", max_tokens=5, **G)
    assert isinstance(t, rwkv_api.Task) and t.task_id.startswith("TMP_") and not t.finished
    t.wait(poll_interval=POLL, timeout=30)
    assert t.finished and t.result and t.gen_time >= 0 and t.prefill_time >= 0
    assert t.status == Status.FINISHED
    info = client.get_task_status(t.task_id)
    assert info.generated_buf == 5 and info.status == Status.FINISHED
    assert client.get_task_result(t.task_id).result == t.result
    p = client.create_persistent("Hello", max_tokens=5, **G).wait(poll_interval=POLL)
    q = client.create_tmp("Hello", max_tokens=5, **G).wait(poll_interval=POLL)
    assert p.task_id.startswith("TASK_") and p.result == q.result == t.result
    t2 = client.create("default length").wait(poll_interval=POLL)  # server default max_tokens
    assert client.get_task_status(t2.task_id).generated_buf == 8


def test_sync_streams_match_polled_results(client):
    ref = client.create("Stream", max_tokens=6, **G).wait(poll_interval=POLL).result
    assert "".join(client.create("Stream", max_tokens=6, stream=True, **G)) == ref
    assert "".join(client.create_stream("Stream", max_tokens=6, persistent=True, **G)) == ref
    fim = client.fim("def f(x):\n", "\n    return y\n", max_tokens=6, **G).wait(poll_interval=POLL).result
    assert fim and "".join(client.fim_stream("def f(x):\n", "\n    return y\n", max_tokens=6, **G)) == fim
    assert "".join(client.fim("def f(x):\n", "\n    return y\n", max_tokens=6, stream=True, **G)) == fim


def test_sync_template_fork_continue_stream_delete(client):
    base = client.create("A shared prefix.", max_tokens=0, persistent=True).wait(poll_interval=POLL)
    assert base.result == ""
    tpl = base.as_template()
    assert tpl.task_id.startswith("_TMPL_")
    f = tpl.fork(prompt=" Then", max_tokens=6, **G).wait(poll_interval=POLL)
    assert f.task_id.startswith("TASK_") and f.result
    assert client.get_task_status(f.task_id).generated_buf == 6
    chunks = list(client.stream_task(f.task_id))
    assert "".join(chunks) == f.result == "".join(f.stream())
    tail = "".join(client.stream_task(f.task_id, pos=3))
    assert f.result.endswith(tail) and len(tail) < len(f.result)
    c = f.continue_(prompt=" More.", max_tokens=4).wait(poll_interval=POLL)
    assert c.task_id == f.task_id and client.get_task_status(f.task_id).generated_buf == 4
    c2 = client.continue_task(f.task_id, max_tokens=3).wait(poll_interval=POLL)  # no prompt: grows
    assert c2.result.startswith(c.result) and client.get_task_status(f.task_id).generated_buf == 7
    with pytest.raises(RWKVError) as err:
        tpl.delete()
    assert err.value.status_code == 403
    tpl.delete(force=True)
    with pytest.raises(TaskNotFoundError):
        client.get_task_result(tpl.task_id)
    f.delete()
    with pytest.raises(TaskNotFoundError):
        f.wait(poll_interval=POLL)


def test_sync_stop_list_and_errors(client):
    t = client.create("Run long", max_tokens=100000, persistent=True)
    t.stop()
    assert client.get_task_status(t.task_id).status == Status.FINISHED
    assert 0 <= client.get_task_status(t.task_id).generated_buf < 100000
    listing = client.list_tasks()
    assert t.task_id in listing["db_tasks"] + listing["cpu_tasks"] and listing["total_count"] >= 1
    assert set(listing) >= {"cpu_cache_count", "database_count", "total_count", "cpu_tasks", "db_tasks"}
    with pytest.raises(TaskNotFoundError):
        client.get_task_result("TASK_" + "0" * 32)
    with pytest.raises(TaskNotFoundError):
        client.fork_task("TMP_missing")
    with pytest.raises(RWKVValidationError):
        client.create("x", temperature=9)
    with pytest.raises(RWKVValidationError):
        client.create("x", max_tokens=-1)
    with pytest.raises(RWKVValidationError):
        list(client.create_stream("x", top_p=2))
    with pytest.raises(RWKVError) as err:
        client.create("", max_tokens=1)
    assert err.value.status_code == 422


# --- async ---------------------------------------------------------------------------------------
async def test_async_create_wait_and_streams(aclient):
    t = await aclient.create("Hello", max_tokens=5, **G)
    assert isinstance(t, rwkv_api.AsyncTask)
    await t.wait(poll_interval=POLL, timeout=30)
    assert t.finished and (await t.async_status()).generated_buf == 5
    assert (await t.async_get_result()).result == t.result
    assert "".join([c async for c in aclient.create_stream("Hello", max_tokens=5, **G)]) == t.result
    p = await (await aclient.create_persistent("Hello", max_tokens=5, **G)).wait(poll_interval=POLL)
    assert p.result == t.result and (await aclient.create_tmp("Hi", max_tokens=1)).task_id.startswith("TMP_")
    fim = await (await aclient.fim("a = [", "]", max_tokens=5, **G)).wait(poll_interval=POLL)
    assert "".join([c async for c in aclient.fim_stream("a = [", "]", max_tokens=5, **G)]) == fim.result
    assert (await aclient.get_task_status(t.task_id)).status == Status.FINISHED
    assert (await aclient.get_task_result(t.task_id)).finished


async def test_async_template_fork_continue_stop_delete(aclient):
    base = await (await aclient.create("Async prefix.", max_tokens=0, persistent=True)).wait(poll_interval=POLL)
    tpl = await base.as_template()
    f = await (await tpl.fork(prompt=" go", max_tokens=5, **G)).wait(poll_interval=POLL)
    assert "".join([c async for c in f.stream()]) == f.result
    tail = "".join([c async for c in aclient.stream_task(f.task_id, pos=2)])
    assert f.result.endswith(tail) and len(tail) < len(f.result)
    f2 = await (await aclient.fork_task(tpl.task_id, prompt=" go", max_tokens=5, **G)).wait(poll_interval=POLL)
    assert f2.result == f.result and f2.task_id != f.task_id  # same state + greedy: same text
    c = await (await f.continue_(max_tokens=2)).wait(poll_interval=POLL)
    assert c.result.startswith(f.result) and (await aclient.get_task_status(f.task_id)).generated_buf == 7
    await (await aclient.continue_task(f.task_id, prompt=" again", max_tokens=2)).wait(poll_interval=POLL)
    long = await aclient.create("run", max_tokens=100000)
    await long.stop()
    assert (await aclient.get_task_status(long.task_id)).status == Status.FINISHED
    assert long.task_id in (await aclient.list_tasks())["cpu_tasks"]
    with pytest.raises(RWKVError):
        await tpl.delete()
    await tpl.delete(force=True)
    await aclient.delete_task(f.task_id)
    with pytest.raises(TaskNotFoundError):
        await aclient.get_task_status(f.task_id)
    with pytest.raises(TaskNotFoundError):
        await aclient.as_template("TASK_nope")
    with pytest.raises(RWKVValidationError):
        await aclient.create("x", top_k=-5)
    with pytest.raises(TaskNotFoundError):
        [c async for c in aclient.stream_task("TASK_nope")]

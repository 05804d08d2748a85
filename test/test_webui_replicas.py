"""The task page on a replica (two servers on one SQLite file, as test_replicas.py), in a real
browser (as test_webui.py): a task running on the other server is shown with its last committed
text and the server running it, its stream is not asked for, the actions that would answer 409 are
disabled; once it has finished there, the page shows its whole text and enables them again."""

from __future__ import annotations

import time

from util_browser import api_get as get
from util_browser import api_post as post
from util_browser import browser_fixture, console_errors, open_page, require_browser, wait_finished, wait_for
from util_server import ServerProcess

require_browser()

browser = browser_fixture()
ACTIONS = ("#task-stop", "#continue-form button", "#fork-form button", "#template-form button", "#task-delete")


def replica(tmp_path, name: str, db: str) -> ServerProcess:
    srv = ServerProcess(tmp_path / name, db=db)
    srv.env.update(RWKV_INSTANCE_NAME=f"replica-{name}", RWKV_PUBLIC_URL=srv.url)
    return srv


def text_of(drv, css: str) -> str:
    return drv.find_element("css selector", css).get_attribute("textContent")


def enabled(drv) -> list[bool]:
    return [drv.find_element("css selector", css).is_enabled() for css in ACTIONS]


def stream_calls(drv) -> int:
    """The page's requests to a task stream so far (fetches are in the resource timings)."""
    return drv.execute_script(
        "return performance.getEntriesByType('resource').filter((e) => e.name.includes('/stream')).length")


def test_task_running_on_another_replica(tmp_path, browser):
    db = str(tmp_path / "shared.db")
    a, b = replica(tmp_path, "a", db).start(), None
    try:
        body = {"prompt": "A long story", "max_tokens": 100_000, "ignore_eos": True}
        tid = post(a, "/v1/tasks/create", body)["task_id"]
        b = replica(tmp_path, "b", db).start()
        wait_for(b, lambda _: get(b, f"/v1/tasks/{tid}/get_result")["result"], 15)  # a progress row landed

        open_page(browser, b, f"#/tasks/{tid}", "#task-elsewhere")
        note = text_of(browser, "#task-elsewhere")
        assert "replica-a" in note and a.url in note, note
        wait_for(browser, lambda d: text_of(d, "#task-output"), 10)  # the last committed text
        assert get(a, f"/v1/tasks/{tid}/get_result")["result"].startswith(text_of(browser, "#task-output"))
        wait_for(browser, lambda d: not any(enabled(d)), 5)
        time.sleep(3)  # the page polls the status meanwhile, not the stream
        assert stream_calls(browser) == 0  # the detail said where it runs: no stream asked for, no 409
        assert get(a, f"/v1/tasks/{tid}/status")["status"] != 3  # it still ran all along
        assert console_errors(browser) == []

        post(a, f"/v1/tasks/{tid}/stop")
        wait_finished(a, tid)
        result = get(b, f"/v1/tasks/{tid}/get_result")
        assert result["finish_reason"] == "stopped"
        wait_for(browser, lambda d: d.find_elements("css selector", "#task-output[data-done]")
                 and text_of(d, "#task-output") == result["result"], 15)
        assert not browser.find_elements("css selector", "#task-elsewhere")
        wait_for(browser, lambda d: all(enabled(d)[1:]) and not enabled(d)[0], 5)  # Stop: it has finished
        assert console_errors(browser) == []
    finally:
        a.stop()
        if b is not None:
            b.stop()

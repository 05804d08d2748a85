"""The task page across a crash of the server, in a real browser (as test_webui.py): a page
streaming a task while the server is killed (SIGKILL) and started again shows the text the server
kept (what its last progress write stored: the tokens after it are lost, the task is
`interrupted`), not the longer text it had streamed; after a continue, which makes the lost tokens
again (greedy), it shows the server's text once, not the lost part twice; and the "network error"
message shown while the server was down goes once it answers again, as does the "shutting down"
one of a stream a graceful stop ended. The header's model name, the Server page and the Tasks
list follow a server that is loading, then gone, then back; a task's or template's page opened
meanwhile loads once it answers."""

from __future__ import annotations

import time

import httpx
from util_browser import api_get as get
from util_browser import api_post as post
from util_browser import browser_fixture, console_errors, open_page, require_browser, shot, wait_finished, wait_for
from util_server import ServerProcess, committed_row, running_server

require_browser()

browser = browser_fixture()
GREEDY = {"temperature": 0, "presence_penalty": 0, "repetition_penalty": 0}
# what Chromium logs for the page's calls while the server is down (its stream cut, polls refused)
# or starting (a poll answered before the task manager runs: 503 tasks_unavailable)
NETWORK_ERRORS = (
    "net::ERR_CONNECTION_REFUSED",
    "net::ERR_CONNECTION_RESET",
    "net::ERR_EMPTY_RESPONSE",
    "net::ERR_INCOMPLETE_CHUNKED_ENCODING",
    "?brief=true - Failed to load resource: the server responded with a status of 503",
    "/health - Failed to load resource: the server responded with a status of 503",  # the header's, while loading
)


def text_of(drv, css: str) -> str:
    # textContent, not .text: WebDriver's rendered text folds whitespace
    return drv.find_element("css selector", css).get_attribute("textContent")


def errors_shown(drv) -> list[str]:
    return [e.text for e in drv.find_elements("css selector", "#task-message .error")]


def shows(drv, text: str) -> bool:
    return bool(drv.find_elements("css selector", "#task-output[data-done]")) and text_of(drv, "#task-output") == text


def shown_pos(drv) -> int:
    """The tokens the task page holds (its output's data-pos)."""
    return int(drv.find_element("css selector", "#task-output").get_attribute("data-pos") or 0)


def kill_past_the_stored(drv, srv: ServerProcess, tid: str, timeout: float = 30) -> None:
    """SIGKILL the server at a moment the page holds tokens its last progress row lacks. A kill
    right after a progress write (a loaded machine stalls the stream a second) loses nothing the
    page shows, which the test cannot tell from a page that kept them (CI saw it): so the server
    is frozen while the page and its committed row are read, and killed frozen (no write lands
    between the two), or let go on until the page is ahead again."""
    end = time.monotonic() + timeout
    while True:
        srv.pause()
        row = committed_row(srv.db, tid)
        if row is not None and 0 < row["completion_tokens"] < shown_pos(drv):
            srv.kill()
            return
        srv.resume()
        if time.monotonic() > end:
            raise AssertionError(f"the page never got ahead of the stored progress: {row}")
        time.sleep(0.2)


def test_task_page_across_a_crash_and_a_continue(tmp_path, browser):
    with running_server(tmp_path) as srv:
        body = {"prompt": "A long story", "max_tokens": 100000, "ignore_eos": True, **GREEDY}
        tid = post(srv, "/v1/tasks/create", body)["task_id"]
        open_page(browser, srv, f"#/tasks/{tid}", "#task-output")
        # streaming, with a progress write stored (some text kept) and a while after it
        wait_for(
            browser,
            lambda d: len(text_of(d, "#task-output")) > 1500 and get(srv, f"/v1/tasks/{tid}/status")["status"] == 2,
            60,
        )
        assert console_errors(browser) == []

        kill_past_the_stored(browser, srv, tid)
        wait_for(browser, lambda d: errors_shown(d), 10)  # the stream's connection broke
        before = text_of(browser, "#task-output")  # all it streamed: more than the server stored
        shown = shown_pos(browser)
        srv.start()

        kept = get(srv, f"/v1/tasks/{tid}/get_result")
        st = get(srv, f"/v1/tasks/{tid}/status")
        assert kept["finished"] and kept["finish_reason"] == "interrupted", kept
        lost = shown - st["generated_buf"]
        assert lost > 0 and len(kept["result"]) < len(before), (lost, len(kept["result"]), len(before))
        # the page drops the tokens the server lost, and the message of the outage
        wait_for(browser, lambda d: shows(d, kept["result"]), 15)
        wait_for(browser, lambda d: "interrupted" in text_of(d, "#task-status"), 5)
        wait_for(browser, lambda d: not errors_shown(d), 5)

        # another client continues it: greedy decoding makes the lost tokens again, once
        post(srv, f"/v1/tasks/{tid}/continue", {"max_tokens": lost + 100})
        wait_finished(srv, tid, 60)
        result = get(srv, f"/v1/tasks/{tid}/get_result")["result"]
        assert result.startswith(before) and len(result) > len(before)  # the same text as before the crash
        wait_for(browser, lambda d: shows(d, result), 15)
        assert not errors_shown(browser)
        shot(browser, "task-after-crash")
        assert console_errors(browser, allow=NETWORK_ERRORS) == []


def test_shutting_down_message_goes_once_the_server_is_back(tmp_path, browser):
    """A graceful stop ends the task's stream with a "the server is shutting down" error event: the
    page shows it, and drops it once the server answers again (it stayed, red, for good)."""
    with running_server(tmp_path) as srv:
        tid = post(srv, "/v1/tasks/create", {"prompt": "A long story", "max_tokens": 100000})["task_id"]
        open_page(browser, srv, f"#/tasks/{tid}", "#task-output")
        wait_for(browser, lambda d: len(text_of(d, "#task-output")) > 200, 60)
        srv.stop()  # SIGTERM: the server drains
        wait_for(browser, lambda d: any("shutting down" in e or "unreachable" in e for e in errors_shown(d)), 15)
        srv.start()
        wait_for(browser, lambda d: "interrupted" in text_of(d, "#task-status"), 15)
        wait_for(browser, lambda d: not errors_shown(d), 5)
        assert console_errors(browser, allow=NETWORK_ERRORS) == []


def view_text(drv) -> str:
    return drv.find_element("css selector", "#view").text


def model_shown(drv) -> str:
    return drv.find_element("css selector", "#model").text


def test_pages_while_the_server_loads_is_gone_and_is_back(tmp_path, browser):
    """Opened while the model loads, the header says "(loading)" then the model's name (it kept
    "(loading)" for good). With the server gone, the Tasks list and the Server page say the
    server is unreachable (not a raw "Failed to fetch"), the Server page's figures are marked
    stale and the moment's blanked; all of it goes once the server answers again."""
    srv = ServerProcess(tmp_path, env={"RWKV_DEBUG_LOAD_DELAY": "4"})
    try:
        srv.start(wait=False)
        wait_for(browser, lambda _: _answers(srv.url + "/ui"), 60)
        open_page(browser, srv, "#/server", "#view h1")
        wait_for(browser, lambda d: model_shown(d) == "(loading)", 10)
        srv.wait_ready()
        wait_for(browser, lambda d: model_shown(d) == "synthetic:tiny", 10)
        wait_for(browser, lambda d: d.find_elements("css selector", "#server-cards .stat"), 10)
        post(srv, "/v1/tasks/create", {"prompt": "a listed task", "max_tokens": 2})
        browser.execute_script("location.hash = '#/tasks'")  # the same page: the Server page's history stays
        wait_for(browser, lambda d: d.find_elements("css selector", "#task-rows tr"), 10)

        srv.kill()
        wait_for(browser, lambda d: "server unreachable" in view_text(d), 10)
        wait_for(browser, lambda d: model_shown(d) == "(unreachable)", 15)
        shot(browser, "tasks-unreachable")
        browser.execute_script("location.hash = '#/server'")
        wait_for(browser, lambda d: "server unreachable" in view_text(d), 10)
        wait_for(browser, lambda d: d.find_elements("css selector", "#server-cards.stale .stat"), 5)
        assert browser.find_elements("css selector", ".charts.stale")
        assert "figures below are from" in view_text(browser)
        cards = browser.find_element("css selector", "#server-cards").text
        assert "running / waiting\n– / –" in cards and "status\nunreachable" in cards, cards
        shot(browser, "server-unreachable")
        assert "Failed to fetch" not in browser.page_source

        srv.env.pop("RWKV_DEBUG_LOAD_DELAY")
        srv.start()
        wait_for(browser, lambda d: not d.find_elements("css selector", "#server-cards.stale, #view .error"), 15)
        wait_for(browser, lambda d: model_shown(d) == "synthetic:tiny", 15)
        browser.execute_script("location.hash = '#/tasks'")
        wait_for(browser, lambda d: d.find_elements("css selector", "#task-rows tr"), 10)
        assert "unreachable" not in view_text(browser)
        assert console_errors(browser, allow=NETWORK_ERRORS) == []
    finally:
        srv.cleanup()


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def test_task_and_template_pages_opened_while_the_server_is_down(tmp_path, browser):
    """A task's page opened while the server does not answer (killed; then loading) shows the
    "unreachable" / "loading" message and loads itself once the server answers (it showed the
    message and stayed empty for good); a template's page the same. An unknown id is not
    retried: its 404 stays."""
    srv = ServerProcess(tmp_path)
    try:
        srv.start()
        tid = post(srv, "/v1/tasks/create", {"prompt": "opened while down", "max_tokens": 8})["task_id"]
        wait_finished(srv, tid)
        src = post(srv, "/v1/tasks/create", {"prompt": "a template opened while loading", "max_tokens": 0})["task_id"]
        wait_finished(srv, src)
        tpl = post(srv, f"/v1/tasks/{src}/as_template", name="while_down")["task_id"]
        result = get(srv, f"/v1/tasks/{tid}/get_result")["result"]
        open_page(browser, srv, "#/tasks", "#task-rows tr")  # the page's files are loaded: then the server goes
        browser.execute_script("performance.setResourceTimingBufferSize(100000)")

        srv.kill()
        browser.execute_script(f"location.hash = '#/tasks/{tid}'")
        wait_for(browser, lambda d: any("unreachable" in e for e in errors_shown(d)), 10)
        message = browser.find_element("css selector", "#task-message")
        assert message.get_attribute("data-offline") == "1"
        assert not browser.find_elements("css selector", "#task-output")
        shot(browser, "task-opened-while-down")
        time.sleep(3)  # more than one retry while it is down: still the message, no other error
        assert [e for e in errors_shown(browser) if "unreachable" not in e] == []
        srv.start()
        wait_for(browser, lambda d: shows(d, result), 15)
        assert not errors_shown(browser) and message.get_attribute("data-offline") == ""

        srv.stop()
        srv.env["RWKV_DEBUG_LOAD_DELAY"] = "4"
        srv.start(wait=False)
        wait_for(browser, lambda _: _answers(srv.url + "/ui"), 60)
        browser.execute_script(f"location.hash = '#/tasks/{tpl}'")
        wait_for(browser, lambda d: any("loading" in e for e in errors_shown(d)), 10)  # a 503 loading
        srv.wait_ready()
        wait_for(browser, lambda d: d.find_elements("css selector", "#fork-form"), 15)
        assert text_of(browser, "#task-prompt") == "a template opened while loading" and not errors_shown(browser)

        browser.execute_script("location.hash = '#/tasks/TASK_" + "0" * 32 + "'")
        wait_for(browser, lambda d: any("not found" in e or "no task" in e for e in errors_shown(d)), 10)
        polls = "return performance.getEntriesByType('resource').filter((e) => e.name.includes('/v1/ui/')).length"
        calls = browser.execute_script(polls)
        time.sleep(2.5)
        assert browser.execute_script(polls) == calls  # a 404 is an answer: not asked again
        # a 503 while a server loads (the task page's retries may meet the first start's loading too)
        loading = " - Failed to load resource: the server responded with a status of 503"
        allow = (*NETWORK_ERRORS, "status of 404", f"/v1/ui/tasks/{tpl}{loading}", f"/v1/ui/tasks/{tid}{loading}")
        assert console_errors(browser, allow=allow) == []
    finally:
        srv.cleanup()

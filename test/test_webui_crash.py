"""The task page across a crash of the server, in a real browser (as test_webui.py): a page
streaming a task while the server is killed (SIGKILL) and started again shows the text the server
kept (what its last progress write stored: the tokens after it are lost, the task is
`interrupted`), not the longer text it had streamed; after a continue, which makes the lost tokens
again (greedy), it shows the server's text once, not the lost part twice; and the "network error"
message shown while the server was down goes once it answers again."""

from __future__ import annotations

from util_browser import api_get as get
from util_browser import api_post as post
from util_browser import browser_fixture, console_errors, open_page, require_browser, shot, wait_finished, wait_for
from util_server import running_server

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
)


def text_of(drv, css: str) -> str:
    # textContent, not .text: WebDriver's rendered text folds whitespace
    return drv.find_element("css selector", css).get_attribute("textContent")


def errors_shown(drv) -> list[str]:
    return [e.text for e in drv.find_elements("css selector", "#task-message .error")]


def shows(drv, text: str) -> bool:
    return bool(drv.find_elements("css selector", "#task-output[data-done]")) and text_of(drv, "#task-output") == text


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

        srv.kill()
        wait_for(browser, lambda d: errors_shown(d), 10)  # the stream's connection broke
        before = text_of(browser, "#task-output")  # all it streamed: more than the server stored
        shown_pos = int(browser.find_element("css selector", "#task-output").get_attribute("data-pos"))
        srv.start()

        kept = get(srv, f"/v1/tasks/{tid}/get_result")
        st = get(srv, f"/v1/tasks/{tid}/status")
        assert kept["finished"] and kept["finish_reason"] == "interrupted", kept
        lost = shown_pos - st["generated_buf"]
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

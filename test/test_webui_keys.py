"""The dashboard with API keys on (RWKV_API_KEYS=k1,k2), in a real browser: the page asks for a key,
keeps it in localStorage, and never shows another key's tasks or templates."""

from __future__ import annotations

import time

import httpx
import pytest

from util_browser import browser_fixture, console_errors, open_page, require_browser, select, shot, wait_for
from util_server import server_fixture

require_browser()

server = server_fixture(env={"RWKV_API_KEYS": "k1,k2"})
browser = browser_fixture()
K1, K2 = ({"Authorization": f"Bearer {k}"} for k in ("k1", "k2"))


def post(srv, path: str, headers: dict, body: dict, **params) -> dict:
    r = httpx.post(srv.url + path, headers=headers, json=body, params=params, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def k1_things(server) -> dict[str, str]:
    """Key k1's running task and its template (named k1_private)."""
    running = post(server, "/v1/tasks/create", K1, {"prompt": "secret of key one", "max_tokens": 100_000})
    base = post(server, "/v1/tasks/create", K1, {"prompt": "k1 template", "max_tokens": 0})["task_id"]
    for _ in range(200):
        if httpx.get(f"{server.url}/v1/tasks/{base}/status", headers=K1).json()["status"] == 3:
            break
        time.sleep(0.05)
    template = post(server, f"/v1/tasks/{base}/as_template", K1, {}, name="k1_private")
    return {"task": running["task_id"], "template": template["task_id"]}


def keep_key(drv, srv, key: str | None) -> None:
    """Set (or clear) the key the page keeps, from a page that makes no /v1 call (Batch)."""
    drv.get(f"{srv.url}/ui#/batch")
    drv.execute_script("arguments[0] ? localStorage.setItem('rwkv.apiKey', arguments[0])"
                       " : localStorage.removeItem('rwkv.apiKey')", key)


def record_view_text(drv) -> None:
    """From now on, the page keeps every text its view shows (window.__shown)."""
    drv.execute_script("""window.__shown = ''; new MutationObserver(() => {
        window.__shown += document.getElementById('view').textContent; })
        .observe(document.getElementById('view'), {childList: true, subtree: true, characterData: true});""")


def test_the_page_asks_for_a_key_and_shows_only_its_tasks(server, browser, k1_things):
    keep_key(browser, server, None)
    browser.get(f"{server.url}/ui#/tasks")
    wait_for(browser, lambda d: d.find_elements("css selector", "#key-dialog[open]"), 15)
    shot(browser, "api-key")
    record_view_text(browser)
    browser.find_element("css selector", "#key-input").send_keys("k2")
    browser.find_element("css selector", "#key-save").click()
    k2 = post(server, "/v1/tasks/create", K2, {"prompt": "of key two", "max_tokens": 4})["task_id"]
    wait_for(browser, lambda d: d.find_elements("css selector", f'#task-rows tr[data-id="{k2}"]'), 15)
    select(browser, "#filter-kind", "template")
    time.sleep(1.5)  # a refresh or two of the template list
    shown = browser.execute_script("return window.__shown + document.body.textContent")
    assert k2 in shown and k1_things["task"] not in shown and k1_things["template"] not in shown
    assert browser.execute_script("return localStorage.getItem('rwkv.apiKey')") == "k2"
    assert console_errors(browser, allow=("status of 401",)) == []


def test_another_keys_task_and_template_stay_hidden(server, browser, k1_things):
    keep_key(browser, server, "k2")
    open_page(browser, server, f"#/tasks/{k1_things['task']}", "#task-message .error")
    assert "not found" in browser.find_element("css selector", "#task-message").text
    assert "secret of key one" not in browser.page_source
    open_page(browser, server, "#/playground", "#chat-template[data-loaded]")
    options = [o.get_attribute("value") for o in browser.find_elements("css selector", "#chat-template option")]
    assert k1_things["template"] not in options and not browser.find_elements("css selector", "#key-dialog[open]")
    assert console_errors(browser, allow=("status of 404",)) == []  # the page asked for k1's task


def test_a_key_an_http_header_cannot_carry(server, browser, k1_things):
    """A key with a character an HTTP header cannot carry (a pasted curly quote, another script)
    made every fetch throw a TypeError, shown as "server unreachable" everywhere, and the key
    dialog never came back. A kept one opens the dialog, saying why; the dialog refuses one
    typed, saying what is wrong, and keeps the key as it was."""
    keep_key(browser, server, "k2\u2019")  # k2’: a curly quote pasted with it
    browser.get(f"{server.url}/ui#/tasks")
    wait_for(browser, lambda d: d.find_elements("css selector", "#key-dialog[open]"), 15)
    reason = browser.find_element("css selector", "#key-reason").text
    assert "cannot be sent" in reason and "U+2019" in reason, reason
    key = browser.find_element("css selector", "#key-input")
    key.clear()
    key.send_keys("ключ-A")
    browser.find_element("css selector", "#key-save").click()
    problem = browser.find_element("css selector", "#key-error")
    wait_for(browser, lambda d: problem.is_displayed(), 5)
    assert "U+043A" in problem.text and "ASCII" in problem.text, problem.text
    assert browser.find_elements("css selector", "#key-dialog[open]")  # it stays open
    assert browser.execute_script("return localStorage.getItem('rwkv.apiKey')") == "k2\u2019"
    shot(browser, "api-key-refused")
    key.clear()
    key.send_keys("k2")
    browser.find_element("css selector", "#key-save").click()
    k2 = post(server, "/v1/tasks/create", K2, {"prompt": "after a bad key", "max_tokens": 2})["task_id"]
    wait_for(browser, lambda d: d.find_elements("css selector", f'#task-rows tr[data-id="{k2}"]'), 15)
    assert browser.execute_script("return localStorage.getItem('rwkv.apiKey')") == "k2"
    assert "unreachable" not in browser.find_element("css selector", "body").text
    assert console_errors(browser, allow=("status of 401",)) == []

"""The dashboard's task list and task page against a real server, in a real browser (as
test_webui.py): every task reachable however many there are, the prompts' previews and the
prompt search, a task page that follows runs another client starts, and the "prefill only, make
template" form leaving nothing behind when it fails."""

from __future__ import annotations

import contextlib
import time
import uuid

import httpx
import pytest
from util_browser import api_get as get
from util_browser import api_post as post
from util_browser import (
    browser_fixture,
    console_errors,
    open_page,
    require_browser,
    select,
    shot,
    wait_finished,
    wait_for,
)
from util_server import server_fixture

require_browser()

server = server_fixture(env={"RWKV_MAX_BATCH": "16"})
browser = browser_fixture()
MANY = 620  # more than the 500 the list once stopped at



def total(srv, kind: str | None = None) -> int:
    return get(srv, "/v1/tasks/list", limit=1, **({"kind": kind} if kind else {}))["total_count"]


def text_of(drv, css: str) -> str:
    # textContent, not .text: WebDriver's rendered text folds whitespace
    return drv.find_element("css selector", css).get_attribute("textContent")


def row_ids(drv) -> list[str]:
    """The listed ids, read at once (a refresh may re-render the rows between two reads)."""
    return drv.execute_script("return [...document.querySelectorAll('#task-rows tr')].map((r) => r.dataset.id)")


@pytest.fixture(scope="module")
def many_tasks(server) -> list[str]:
    """MANY prefill-only TMP_ tasks, oldest first."""
    ids = []
    with httpx.Client(base_url=server.url, timeout=30) as c:
        for i in range(MANY):
            for _ in range(100):
                r = c.post("/v1/tasks/tmp", json={"prompt": f"task number {i}", "max_tokens": 0})
                if r.status_code != 429:
                    break
                time.sleep(0.05)
            assert r.status_code == 200, r.text
            ids.append(r.json()["task_id"])
        deadline = time.monotonic() + 120  # all of them finished (a slow machine is still prefilling)
        while (h := c.get("/health").json())["running"] or h["waiting"]:
            assert time.monotonic() < deadline, h
            time.sleep(0.1)
    return ids


def test_every_task_is_reachable_and_the_total_is_true(server, browser, many_tasks):
    n = total(server)
    assert n >= MANY
    open_page(browser, server, "#/tasks", "#task-rows tr")
    count = browser.find_element("css selector", "#task-count")
    wait_for(browser, lambda d: f"of {n}" in count.text, 10)  # the true total, not the rows read
    assert count.get_attribute("data-total") == str(n)
    first_page = row_ids(browser)
    assert 0 < len(first_page) < n and many_tasks[-1] in first_page and many_tasks[0] not in first_page
    older = browser.find_element("css selector", "#page-older")
    seen = set(first_page)
    while older.is_enabled():  # page by page to the oldest
        before = count.text
        older.click()
        wait_for(browser, lambda d: count.text != before, 10)
        seen.update(row_ids(browser))
    assert set(many_tasks) <= seen and many_tasks[0] in row_ids(browser)
    shot(browser, "tasks-last-page")
    browser.find_element("css selector", "#page-newer").click()
    wait_for(browser, lambda d: many_tasks[0] not in row_ids(d), 10)

    # the search looks through every task, not just a page: the oldest one is found
    browser.find_element("css selector", "#filter-search").send_keys(many_tasks[0][-12:])
    wait_for(browser, lambda d: row_ids(d) == [many_tasks[0]], 15)
    wait_for(browser, lambda d: count.text.startswith(f"1 of {n} match"), 5)
    # a status filter also runs over every task, a page at a time
    search = browser.find_element("css selector", "#filter-search")
    search.clear()
    select(browser, "#filter-status", "finished")
    wait_for(browser, lambda d: " match, 1–100 shown" in count.text, 15)
    wait_for(browser, lambda d: int(count.text.split(" of ")[0]) >= MANY, 15)
    assert older.is_enabled()
    select(browser, "#filter-status", "")
    # and a task created meanwhile is found by the search
    late = post(server, "/v1/tasks/tmp", {"prompt": "a late one", "max_tokens": 0})["task_id"]
    search.send_keys(late[-12:])
    wait_for(browser, lambda d: row_ids(d) == [late], 10)
    assert console_errors(browser) == []


GOTHIC = "\U00010348"  # 4 bytes of UTF-8, each a token of its own (no token holds two of them)
# a JSON string of GOTHICs: '"' and 7 bytes (8 tokens) are one GOTHIC and the first 3 bytes of
# the next, which the output shows as U+FFFD (its last flush); {"type": "text"} lifts it again
CUT = {"max_tokens": 8, "response_format": {"type": "json_schema", "json_schema": {
    "name": "gothic", "schema": {"type": "string", "pattern": f"^({GOTHIC}){{1000}}$"}}}}
FREE = {"type": "text"}


def test_task_page_follows_runs_started_elsewhere(server, browser):
    """The page follows the runs another client starts: a new prompt's output from its first
    token, a continue without a prompt from where the text stopped, a long run live and its end
    once stopped. The output is random text; CUT forces the two ends that, when the random text
    came to them, left the page showing other text than the task's for ever: a continue without
    a prompt takes back the U+FFFD of a cut character (the page kept it, before the new text),
    and the last flush of a stopped run (text with no token: a cut character's U+FFFD, the text
    held back for a stop string) never reached a stream that had read the last token."""
    body = {"prompt": "the first prompt", "max_tokens": 8, "ignore_eos": True}  # continues inherit ignore_eos
    tid = post(server, "/v1/tasks/create", body)["task_id"]
    wait_finished(server, tid)
    open_page(browser, server, f"#/tasks/{tid}", "#task-output[data-done]")
    first = text_of(browser, "#task-output")
    assert first == get(server, f"/v1/tasks/{tid}/get_result")["result"]

    def shows_result(d, prompt: str) -> bool:
        result = get(server, f"/v1/tasks/{tid}/get_result")
        return (prompt in text_of(d, "#task-prompt") and result["finished"]
                and d.find_elements("css selector", "#task-output[data-done]")
                and text_of(d, "#task-output") == result["result"])

    # another client continues with a new prompt: a new output, from its first token (its end a
    # cut character)
    post(server, f"/v1/tasks/{tid}/continue", {"prompt": " the second prompt", **CUT})
    wait_finished(server, tid)
    wait_for(browser, lambda d: shows_result(d, "the second prompt"), 10)
    second = text_of(browser, "#task-output")
    assert second.endswith("\ufffd"), second

    # ... then without a prompt: the same output goes on where it stopped (nothing repeated); the
    # U+FFFD of the cut character is taken back (the continue's first bytes complete it)
    post(server, f"/v1/tasks/{tid}/continue", {"max_tokens": 5})
    wait_finished(server, tid)
    wait_for(browser, lambda d: shows_result(d, "the second prompt")
             and len(text_of(d, "#task-output")) > len(second), 10)
    assert text_of(browser, "#task-output").startswith(second[:-1])

    # ... and a long run with a prompt: streamed live while it runs
    post(server, f"/v1/tasks/{tid}/continue",
         {"prompt": " the third prompt", "max_tokens": 100_000, "response_format": FREE})
    wait_for(browser, lambda d: "the third prompt" in text_of(d, "#task-prompt")
             and len(text_of(d, "#task-output")) > 20, 15)
    assert get(server, f"/v1/tasks/{tid}/status")["status"] != 3
    assert browser.find_element("css selector", "#task-stop").is_enabled()
    post(server, f"/v1/tasks/{tid}/stop")
    wait_finished(server, tid)
    wait_for(browser, lambda d: shows_result(d, "the third prompt"), 10)
    wait_for(browser, lambda d: "stopped" in d.find_element("css selector", "#task-status").text, 5)

    # ... and a stopped run whose last flush is all its text: a continue of a cut character,
    # stopped while it waits for a slot, shows the U+FFFD again (the page streams it anew)
    post(server, f"/v1/tasks/{tid}/continue", {"prompt": " the fourth prompt", **CUT})
    wait_finished(server, tid)
    wait_for(browser, lambda d: shows_result(d, "the fourth prompt"), 10)
    cut = text_of(browser, "#task-output")
    with engine_full(server):
        post(server, f"/v1/tasks/{tid}/continue", {"max_tokens": 5})
        assert get(server, f"/v1/tasks/{tid}/status")["status"] == 1  # READY: waits for a slot, no token yet
        wait_for(browser, lambda d: not d.find_elements("css selector", "#task-output[data-done]")
                 and text_of(d, "#task-output") == cut[:-1], 10)  # its stream is open, the U+FFFD taken back
        post(server, f"/v1/tasks/{tid}/stop")
    wait_finished(server, tid)
    wait_for(browser, lambda d: shows_result(d, "the fourth prompt"), 10)
    assert text_of(browser, "#task-output") == cut
    wait_for(browser, lambda d: "stopped" in d.find_element("css selector", "#task-status").text, 5)
    assert console_errors(browser) == []


@contextlib.contextmanager
def engine_full(srv):
    """Every slot of the engine taken by a long TMP_ run (a run started meanwhile waits), all
    stopped on leaving."""
    body = {"prompt": "a long one", "max_tokens": 100_000, "ignore_eos": True}
    fillers = [post(srv, "/v1/tasks/tmp", body)["task_id"] for _ in range(get(srv, "/health")["slots"])]
    try:
        yield
    finally:
        for f in fillers:
            post(srv, f"/v1/tasks/{f}/stop")


def _submit_template(browser, name: str) -> None:
    form = browser.find_element("css selector", "#new-task")
    if not form.is_displayed():
        browser.find_element("css selector", "details > summary").click()
    prompt = form.find_element("css selector", "[name=prompt]")
    prompt.clear()
    prompt.send_keys("System: a prompt for a template\n\n")
    box = form.find_element("css selector", "[name=template]")
    if not box.is_selected():
        box.click()
    field = form.find_element("css selector", "[name=template_name]")
    field.clear()
    field.send_keys(name)
    form.find_element("css selector", "button[type=submit]").click()


def test_template_form_leaves_no_stray_task(server, browser):
    before = total(server, "task")
    open_page(browser, server, "#/tasks", "#new-task")
    _submit_template(browser, "bad name!")
    wait_for(browser, lambda d: d.find_elements("css selector", "#new-task .error"), 10)
    assert "template name" in browser.find_element("css selector", "#new-task .error").text
    time.sleep(0.5)  # a task made anyway would be listed by now
    assert total(server, "task") == before

    # a name the server refuses after the task was made (taken): that task is deleted again
    base = post(server, "/v1/tasks/create", {"prompt": "for a taken name", "max_tokens": 0})["task_id"]
    wait_finished(server, base)
    post(server, f"/v1/tasks/{base}/as_template", name="taken")
    before = total(server, "task")
    _submit_template(browser, "taken")
    wait_for(browser, lambda d: "already exists" in d.find_element("css selector", "#new-task .error").text, 15)
    assert total(server, "task") == before
    shot(browser, "tasks-template-error")

    _submit_template(browser, "made.in-the_ui")  # a good name still makes the template
    wait_for(browser, lambda d: d.current_url.endswith("#/tasks/_made.in-the_ui"), 15)
    wait_for(browser, lambda d: text_of(d, "#task-kind") == "template", 10)
    assert console_errors(browser, allow=("status of 409",)) == []


def test_long_stream_is_one_text_node(server, browser):
    """A streamed output is flushed once a frame into one text node: a node per SSE event made
    every event lay out the whole <pre> (a long task froze the page)."""
    body = {"prompt": "A long story", "max_tokens": 600, "ignore_eos": True}
    tid = post(server, "/v1/tasks/create", body)["task_id"]
    open_page(browser, server, f"#/tasks/{tid}", "#task-output")
    wait_for(browser, lambda d: d.find_elements("css selector", "#task-output[data-done]"), 60)
    result = get(server, f"/v1/tasks/{tid}/get_result")
    assert result["finished"] and result["completion_tokens"] == 600
    assert text_of(browser, "#task-output") == result["result"]
    assert text_nodes(browser, "#task-output") <= 1 + len(result["result"]) // 4096
    # a continue without a prompt goes on in the same node
    post(server, f"/v1/tasks/{tid}/continue", {"max_tokens": 50})
    wait_finished(server, tid)
    wait_for(browser, lambda d: text_of(d, "#task-output") == get(server, f"/v1/tasks/{tid}/get_result")["result"], 15)
    assert text_nodes(browser, "#task-output") <= 1 + len(text_of(browser, "#task-output")) // 4096
    assert console_errors(browser) == []


def text_nodes(drv, css: str) -> int:
    return drv.execute_script("const w = document.createTreeWalker(document.querySelector(arguments[0]), "
                              "NodeFilter.SHOW_TEXT); let n = 0; while (w.nextNode()) n++; return n", css)


def test_long_output_is_written_in_blocks(server, browser):
    """task.js appendText, given a long text in small pieces: the <pre> holds the text exactly, in
    blocks of one text node each, cut at line ends (they render and copy as the text does), so a
    write lays out the last block only; a text with no line end stays in one block."""
    open_page(browser, server, "#/tasks", "#task-count")
    blocks = browser.execute_async_script("""
        const done = arguments[arguments.length - 1];
        import("/ui/static/js/task.js").then(({ appendText }) => {
          const run = (text, step) => {
            const pre = document.createElement("pre");
            for (let i = 0; i < text.length; i += step) appendText(pre, text.slice(i, i + step));
            return { text: pre.textContent === text, nodes: [...pre.children].map((b) => b.childNodes.length),
                     sizes: [...pre.children].map((b) => b.textContent.length),
                     ends: [...pre.children].map((b) => b.textContent.endsWith("\\n")) };
          };
          const lines = Array.from({ length: 3000 }, (_, i) => `line ${i} ` + "x".repeat(i % 50)).join("\\n");
          done({ lines: run(lines, 7), big: run(lines, 100000), flat: run("y".repeat(30000), 5) });
        }).catch((err) => done({ error: String(err) }));""")
    assert "error" not in blocks, blocks
    for name in ("lines", "big"):
        b = blocks[name]
        assert b["text"] and set(b["nodes"]) == {1} and len(b["sizes"]) >= 10, (name, b)
        assert all(b["ends"][:-1]) and all(8192 <= n < 8192 + 100 for n in b["sizes"][:-1]), (name, b)
    assert blocks["flat"] == {"text": True, "nodes": [1], "sizes": [30000], "ends": [False]}
    assert console_errors(browser) == []


def test_tasks_without_a_prompt(server, browser):
    """A template imported from a state file: its parent (`state:upload`) is plain text, not a link
    to a task page, and it has no prompt ("(state file)"); a fork without a prompt shows
    "(none)"; a prompt of token ids still shows as such."""
    src = post(server, "/v1/tasks/create", {"prompt": "a state to export", "max_tokens": 2})["task_id"]
    wait_finished(server, src)
    state = httpx.get(f"{server.url}/v1/tasks/{src}/state", params={"format": "full"}, timeout=30)
    assert state.status_code == 200, state.text
    r = httpx.post(server.url + "/v1/states/imp1", content=state.content,
                   headers={"content-type": "application/octet-stream"}, timeout=30)
    assert r.status_code == 201, r.text
    tpl = r.json()["template_id"]
    assert get(server, f"/v1/ui/tasks/{tpl}")["parent_id"] == "state:upload"

    open_page(browser, server, f"#/tasks/{tpl}", "#fork-form")
    wait_for(browser, lambda d: text_of(d, "#task-kind") == "template", 10)
    assert text_of(browser, "#task-prompt") == "(state file)"
    assert "state:upload" in text_of(browser, "dl.info")
    assert not browser.find_elements("css selector", "dl.info a")  # no link to a task "state:upload"

    fork = post(server, f"/v1/tasks/{tpl}/fork", {"max_tokens": 2})["task_id"]
    ids = post(server, "/v1/tasks/create", {"prompt": [510, 4411, 33], "max_tokens": 2})["task_id"]
    for tid, shown in ((fork, "(none)"), (ids, "(token ids)")):
        wait_finished(server, tid)
        open_page(browser, server, f"#/tasks/{tid}", "#task-output[data-done]")
        assert text_of(browser, "#task-prompt") == shown, tid

    # the Tasks list: the template's parent is text, its fork's parent a link to it
    open_page(browser, server, "#/tasks", "#task-rows tr")
    browser.find_element("css selector", "#filter-search").send_keys("imp1")
    wait_for(browser, lambda d: set(row_ids(d)) == {tpl, fork}, 15)
    row = browser.find_element("css selector", f'#task-rows tr[data-id="{tpl}"] td:last-child')
    assert row.text == "state:upload" and not row.find_elements("css selector", "a")
    link = browser.find_element("css selector", f'#task-rows tr[data-id="{fork}"] td:last-child a')
    assert link.get_attribute("href").endswith(f"#/tasks/{tpl}")
    assert console_errors(browser) == []


def prompt_searches(drv) -> list[str]:
    """The prompt_contains of every list call the page made since the page was loaded, in order."""
    return drv.execute_script(
        "return performance.getEntriesByType('resource').map((e) => new URL(e.name))"
        ".filter((u) => u.pathname === '/v1/tasks/list' && u.searchParams.has('prompt_contains'))"
        ".map((u) => u.searchParams.get('prompt_contains'))")


def test_task_list_shows_prompts_and_searches_them(server, browser):
    """Each row shows its prompt's start (`prompt_preview`); the "search prompts" box lists the
    tasks whose prompt contains the text (the server's prompt_contains, ASCII case ignored, a
    `%` as a character), asked once typing pauses (not at each key), with the status filter
    and the id search on top of it."""
    mark = uuid.uuid4().hex[:12]
    long = f"{mark} A long prompt. " + "abc " * 40
    made = [post(server, "/v1/tasks/create", {"prompt": p, "max_tokens": 0})["task_id"]
            for p in (long, f"{mark}: 100% sure", f"{mark}: 1000 sure")]
    for tid in made:
        wait_finished(server, tid)
    other = post(server, "/v1/tasks/tmp", {"prompt": "a prompt without the mark", "max_tokens": 0})["task_id"]
    open_page(browser, server, "#/tasks", f'#task-rows tr[data-id="{made[0]}"]')
    browser.execute_script("performance.setResourceTimingBufferSize(100000)")
    cell = f'#task-rows tr[data-id="{made[0]}"] td.prompt-cell'
    assert text_of(browser, cell) == long[:80] + "…"
    assert browser.find_element("css selector", cell).get_attribute("title") == long[:80] + "…"

    search = browser.find_element("css selector", "#filter-prompt")
    count = browser.find_element("css selector", "#task-count")
    search.send_keys(mark.upper())
    wait_for(browser, lambda d: row_ids(d) == made[::-1], 10)
    wait_for(browser, lambda d: count.text == "3 match the prompt search, 1–3 shown", 5)
    assert set(prompt_searches(browser)) == {mark.upper()}  # typed at once: one search, no prefixes of it
    assert other not in row_ids(browser)
    shot(browser, "tasks-prompt-search")

    search.send_keys(": 100%")
    wait_for(browser, lambda d: row_ids(d) == [made[1]], 10)
    assert text_of(browser, f'#task-rows tr[data-id="{made[1]}"] td.prompt-cell') == f"{mark}: 100% sure"
    select(browser, "#filter-status", "running")  # the status filter on top of the search
    wait_for(browser, lambda d: row_ids(d) == [], 10)
    select(browser, "#filter-status", "finished")
    wait_for(browser, lambda d: row_ids(d) == [made[1]], 10)
    wait_for(browser, lambda d: count.text == "1 of 1 match, 1–1 shown", 5)
    select(browser, "#filter-status", "")
    search.clear()
    search.send_keys(mark)
    browser.find_element("css selector", "#filter-search").send_keys(made[2][-10:])  # and the id search
    wait_for(browser, lambda d: row_ids(d) == [made[2]], 10)
    browser.find_element("css selector", "#filter-search").clear()
    search.clear()
    search.send_keys(" ")  # (clear() sends no input event) spaces only: no search
    wait_for(browser, lambda d: other in row_ids(d) and " of " in count.text and "match" not in count.text, 10)
    assert all(len(s) <= 256 for s in prompt_searches(browser))
    assert console_errors(browser) == []

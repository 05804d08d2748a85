"""The web dashboard (server/webui) in a real browser: headless Chromium from the system's packages,
driven by Selenium through the system's chromedriver, against a real server on the tiny model.

Screenshots of every page go to test/screenshots/ (git-ignored). Skips, saying why, without
Chromium, chromedriver or the selenium package (`.ci/run` installs them on Debian). API keys:
test_webui_keys.py.
"""

from __future__ import annotations

import json
import re
import time

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
LONG = 100_000  # max_tokens of a task that must still be running while the test looks at it



@pytest.fixture(scope="module")
def finished_task(server) -> str:
    t = post(server, "/v1/tasks/create", {"prompt": "The dashboard's first task", "max_tokens": 8})
    wait_finished(server, t["task_id"])
    return t["task_id"]


@pytest.fixture(scope="module")
def template(server) -> str:
    t = post(server, "/v1/tasks/create", {"prompt": "System: a prompt kept as a template\n\n", "max_tokens": 0})
    wait_finished(server, t["task_id"])
    return post(server, f"/v1/tasks/{t['task_id']}/as_template", name="ui_tpl")["task_id"]


def test_served_files_and_redirect(server, finished_task):
    r = httpx.get(server.url + "/", headers={"Accept": "text/html"})
    assert r.status_code == 307 and r.headers["location"] == "/ui"
    page = httpx.get(server.url + "/ui")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "/ui/static/js/app.js" in page.text
    js = httpx.get(server.url + "/ui/static/js/app.js")
    assert js.status_code == 200 and "javascript" in js.headers["content-type"]
    for bad in ("/ui/static/../routes.py", "/ui/static/index.html", "/ui/static/nope.js"):
        r = httpx.get(server.url + bad)
        assert r.status_code == 404, bad
        assert "error" in r.json()
    detail = get(server, f"/v1/ui/tasks/{finished_task}")
    assert detail["prompt"] == "The dashboard's first task"
    assert detail["params"]["max_tokens"] == 8 and detail["kind"] == "task" and detail["tag"] is None
    r = httpx.post(server.url + "/v1/responses", json={"input": "hi", "max_output_tokens": 1})
    assert r.status_code == 200, r.text
    made = get(server, "/v1/ui/tasks/TASK_" + r.json()["id"].split("_", 1)[1])
    assert made["tag"] == "response"  # what the route made it as, shown as "made as"
    missing = httpx.get(server.url + "/v1/ui/tasks/TASK_" + "0" * 32)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "task_not_found"


def test_static_files_answer_304_and_head(server):
    """The page and its files are served no-cache with an ETag, so the browser asks again each
    time: If-None-Match with that ETag is a 304 without a body (it was a whole 200 each time).
    HEAD answers as GET does, without a body (it was a 405)."""
    for path in ("/ui", "/ui/static/js/app.js", "/ui/static/style.css"):
        full = httpx.get(server.url + path)
        etag = full.headers["etag"]
        assert full.status_code == 200 and full.headers["cache-control"] == "no-cache" and full.content, path
        for tags in (etag, f"W/{etag}", f'"other", {etag}', "*"):
            r = httpx.get(server.url + path, headers={"If-None-Match": tags})
            assert r.status_code == 304 and r.content == b"", (path, tags, r.status_code)
            assert r.headers["etag"] == etag and r.headers["cache-control"] == "no-cache"
        r = httpx.get(server.url + path, headers={"If-None-Match": '"not-this-one"'})
        assert r.status_code == 200 and r.content == full.content, path
        head = httpx.head(server.url + path)
        assert head.status_code == 200 and head.content == b"", (path, head.status_code)
        assert head.headers["content-type"] == full.headers["content-type"] and head.headers["etag"] == etag
        assert int(head.headers["content-length"]) == len(full.content)
    r = httpx.head(server.url + "/")
    assert r.status_code == 307 and r.headers["location"] == "/ui"
    assert httpx.head(server.url + "/ui/static/nope.js").status_code == 404


def test_pages_load_without_console_errors(server, browser, finished_task, template):
    pages = {"tasks": ("#/tasks", "#task-rows tr"), "playground": ("#/playground", "#chat-template[data-loaded]"),
             "batch": ("#/batch", "#batch-form"), "server": ("#/server", "#server-cards .stat"),
             "task": (f"#/tasks/{finished_task}", "#task-output[data-done]"),
             "template": (f"#/tasks/{template}", "#fork-form")}
    console_errors(browser)  # drop anything logged before
    for name, (hash_, ready) in pages.items():
        open_page(browser, server, hash_, ready)
        shot(browser, name)
        assert console_errors(browser) == [], name
    open_page(browser, server, f"#/tasks/{template}", "#task-prompt")
    assert "a prompt kept as a template" in browser.find_element("css selector", "#task-prompt").text
    browser.execute_script("setTimeout(() => { throw new Error('probe of the error check'); })")
    wait_for(browser, lambda d: any("probe of the error check" in m for m in console_errors(d)), 5)


def test_task_created_through_the_api_appears_without_reload(server, browser):
    open_page(browser, server, "#/tasks", "#task-count")
    browser.execute_script("window.__sameDocument = 42")
    tid = post(server, "/v1/tasks/create", {"prompt": "appears live", "max_tokens": 4})["task_id"]
    wait_for(browser, lambda d: d.find_elements("css selector", f'#task-rows tr[data-id="{tid}"]'), 10)
    assert browser.execute_script("return window.__sameDocument") == 42  # no reload happened
    browser.find_element("css selector", "#filter-search").send_keys(tid[-8:])
    wait_for(browser, lambda d: len(d.find_elements("css selector", "#task-rows tr")) == 1, 5)
    assert browser.find_element("css selector", "#task-rows tr").get_attribute("data-id") == tid
    select(browser, "#filter-kind", "template")
    wait_for(browser, lambda d: not d.find_elements("css selector", "#task-rows tr"), 5)


def test_running_task_streams_and_stop_in_the_ui_stops_it(server, browser):
    tid = post(server, "/v1/tasks/create", {"prompt": "A long story", "max_tokens": LONG})["task_id"]
    open_page(browser, server, f"#/tasks/{tid}", "#task-output")
    out = browser.find_element("css selector", "#task-output")
    wait_for(browser, lambda d: len(out.text) > 0, 15)
    first = len(out.text)
    wait_for(browser, lambda d: len(out.text) > first + 20, 15)
    assert get(server, f"/v1/tasks/{tid}/status")["status"] != 3  # the text grew while it ran
    shot(browser, "task-running")
    browser.find_element("css selector", "#task-stop").click()
    st = wait_finished(server, tid, 15)
    assert st["finish_reason"] == "stopped"
    wait_for(browser, lambda d: "stopped" in d.find_element("css selector", "#task-status").text, 10)
    wait_for(browser, lambda d: out.get_attribute("data-done") == "1", 10)
    # textContent, not .text: WebDriver's rendered text folds whitespace, and random-weight output has odd runs of it
    assert out.get_attribute("textContent") == get(server, f"/v1/tasks/{tid}/get_result")["result"]
    assert console_errors(browser) == []


def test_task_page_actions(server, browser, finished_task):
    """make template (named) -> fork it with a prompt -> continue with a prompt -> delete."""
    open_page(browser, server, f"#/tasks/{finished_task}", "#template-form")
    _set(browser, "#template-form", "name", "from_ui")
    browser.find_element("css selector", "#template-form button").click()
    wait_for(browser, lambda d: d.current_url.endswith("#/tasks/_from_ui"), 10)
    wait_for(browser, lambda d: d.find_elements("css selector", "#fork-form"), 10)
    assert browser.find_element("css selector", "#task-kind").text == "template"
    _set(browser, "#fork-form", "prompt", " and a fork")
    _set(browser, "#fork-form", "max_tokens", 12)
    browser.find_element("css selector", "#fork-form button[type=submit]").click()
    wait_for(browser, lambda d: "#/tasks/TASK_" in d.current_url, 10)
    fork = browser.current_url.rsplit("/", 1)[1]
    wait_for(browser, lambda d: d.find_elements("css selector", "#task-output[data-done]"), 20)
    detail = get(server, f"/v1/ui/tasks/{fork}")
    assert detail["parent_id"] == "_from_ui" and detail["prompt"] == " and a fork"
    assert get(server, f"/v1/tasks/{fork}/status")["generated_buf"] == 12
    _set(browser, "#continue-form", "prompt", " then more")
    _set(browser, "#continue-form", "max_tokens", 5)
    browser.find_element("css selector", "#continue-form button[type=submit]").click()
    wait_for(browser, lambda d: "then more" in d.find_element("css selector", "#task-prompt").text, 10)
    wait_for(browser, lambda d: d.find_elements("css selector", "#task-output[data-done]"), 20)
    result = get(server, f"/v1/tasks/{fork}/get_result")
    assert result["completion_tokens"] == 5
    assert browser.find_element("css selector", "#task-output").get_attribute("textContent") == result["result"]
    delete = browser.find_element("css selector", "#task-delete")
    delete.click()
    assert httpx.get(f"{server.url}/v1/tasks/{fork}/status").status_code == 200  # the first click only arms it
    delete.click()
    wait_for(browser, lambda d: d.current_url.endswith("#/tasks"), 10)
    assert httpx.get(f"{server.url}/v1/tasks/{fork}/status").status_code == 404
    assert console_errors(browser) == []


def _record_growth(browser) -> None:
    """Record, in the page, every length the newest assistant message's text takes."""
    browser.execute_script("""
        window.__lengths = [];
        new MutationObserver(() => {
          const msgs = document.querySelectorAll('#chat-log .msg.assistant .text');
          if (msgs.length) window.__lengths.push(msgs[msgs.length - 1].textContent.length);
        }).observe(document.getElementById('chat-log'), {childList: true, subtree: true, characterData: true});
    """)


def _chat(browser, text: str) -> str:
    """Send one message; returns the finished reply's facts line."""
    n = len(browser.find_elements("css selector", "#chat-log .msg.assistant .meta"))
    browser.find_element("css selector", "#chat-input").send_keys(text)
    browser.find_element("css selector", "#chat-send").click()
    metas = lambda d: d.find_elements("css selector", "#chat-log .msg.assistant .meta")  # noqa: E731
    wait_for(browser, lambda d: len(metas(d)) > n and metas(d)[-1].text.strip(), 30)
    return metas(browser)[-1].text


def _set(browser, form: str, name: str, value) -> None:
    el = browser.find_element("css selector", f"{form} [name={name}]")
    el.clear()
    el.send_keys(str(value))


def test_playground_streams_a_chat(server, browser):
    open_page(browser, server, "#/playground", "#chat-template[data-loaded]")
    _set(browser, "#chat-settings", "max_tokens", 100)
    _set(browser, "#chat-settings", "seed", 7)
    _record_growth(browser)
    facts = _chat(browser, "Tell me a long story")
    lengths = browser.execute_script("return window.__lengths")
    grew = sorted(set(v for v in lengths if v > 0))
    assert len(grew) >= 3, f"the reply arrived in {len(grew)} steps: {lengths[:20]}"
    assert "tok/s" in facts and "prompt tokens" in facts, facts
    state_field = browser.find_element("css selector", "#chat-state-field")
    assert state_field.get_attribute("hidden") is not None  # the server has no state files
    assert not state_field.is_displayed()  # (.field's display: flex once beat the attribute)
    shot(browser, "playground")
    second = _chat(browser, "And then?")  # the history goes with the second turn
    assert "prompt tokens" in second
    assert console_errors(browser) == []


def test_playground_shows_token_probabilities(server, browser):
    """"token probabilities": the reply's tokens under it, one per generated token, each with its
    probability and the alternatives' in its tooltip, as the chat's logprobs give them."""
    open_page(browser, server, "#/playground", "#chat-template[data-loaded]")
    browser.execute_script("""window.__bodies = []; const fetch0 = window.fetch;
        window.fetch = (input, init) => {
          if (String(input).includes('/v1/chat/completions')) window.__bodies.push(JSON.parse(init.body));
          return fetch0(input, init); };""")
    _set(browser, "#chat-settings", "max_tokens", 12)
    _set(browser, "#chat-settings", "temperature", 0)
    browser.find_element("css selector", "#chat-logprobs").click()
    facts = _chat(browser, "Tell me a story")
    body = browser.execute_script("return window.__bodies")[-1]
    assert (body["logprobs"], body["top_logprobs"]) == (True, 5), body
    toks = browser.find_elements("css selector", "#chat-log .msg.assistant:last-child .tokens .tok")
    assert f"{len(toks)} tokens" in facts, facts  # one per generated token (the facts count them)
    again = {k: v for k, v in body.items() if k != "stream_options"}
    want = httpx.post(server.url + "/v1/chat/completions", json={**again, "stream": False}, timeout=60).json()
    entries = want["choices"][0]["logprobs"]["content"]  # (greedy: the same tokens again)
    assert [t.get_attribute("textContent") for t in toks] == [e["token"].replace("\n", "↵") for e in entries]
    tip = toks[0].get_attribute("title").split("\n")
    assert len(tip) == 1 + 5 and tip[0].startswith(json.dumps(entries[0]["token"], ensure_ascii=False)) and tip[0].endswith("%"), tip
    shot(browser, "playground-tokens")
    browser.find_element("css selector", "#chat-logprobs").click()  # off: the next reply has no strip
    _chat(browser, "And then?")
    assert not browser.find_elements("css selector", "#chat-log .msg.assistant:last-child .tokens")
    assert "logprobs" not in browser.execute_script("return window.__bodies")[-1]
    assert console_errors(browser) == []


def test_playground_from_a_template_forks_it(server, browser, template):
    open_page(browser, server, "#/playground", f'#chat-template option[value="{template}"]')
    browser.find_element("css selector", f'#chat-template option[value="{template}"]').click()
    _set(browser, "#chat-settings", "max_tokens", 40)
    _set(browser, "#chat-settings", "seed", 7)  # one draw: an end-of-text first token left an empty reply (a CI run)
    _chat(browser, "Hello from a template")
    forks = [t for t in get(server, "/v1/tasks/list", kind="tmp", limit=1000)["tasks"]
             if t["parent_id"] == template]
    assert len(forks) == 1, forks
    # textContent, not .text: WebDriver's rendered text turns a no-break space into a space
    reply = browser.find_elements("css selector", "#chat-log .msg.assistant .text")[-1].get_attribute("textContent")
    assert reply and reply in get(server, f"/v1/tasks/{forks[0]['task_id']}/get_result")["result"]
    _chat(browser, "Second turn")  # continues the same task: no new fork
    forks2 = [t for t in get(server, "/v1/tasks/list", kind="tmp", limit=1000)["tasks"]
              if t["parent_id"] == template]
    assert [t["task_id"] for t in forks2] == [forks[0]["task_id"]]


def test_batch_of_four_prompts_and_its_jsonl(server, browser, tmp_path):
    open_page(browser, server, "#/batch", "#batch-form")
    prompts = ["first prompt", "second prompt", "third prompt", "fourth prompt"]
    upload = tmp_path / "prompts.jsonl"  # JSON lines with a "prompt", and plain lines
    upload.write_text(json.dumps({"prompt": prompts[0]}) + "\n" + json.dumps({"prompt": prompts[1]}) + "\n\n"
                      + "\n".join(prompts[2:]) + "\n")
    browser.find_element("css selector", "#batch-file").send_keys(str(upload))
    source = browser.find_element("css selector", "#batch-source")
    wait_for(browser, lambda d: source.get_attribute("data-source") == "file", 5)
    assert source.get_attribute("data-count") == "4" and "prompts.jsonl" in source.text
    _set(browser, "#batch-form", "max_tokens", 40)
    browser.find_element("css selector", "#batch-run").click()
    wait_for(browser, lambda d: d.find_element("css selector", "#batch-summary").text == "4 of 4 done", 60)
    rows = browser.find_elements("css selector", "#batch-rows tr[data-done]")
    assert len(rows) == 4
    shot(browser, "batch")
    browser.find_element("css selector", "#batch-download").click()
    path = browser.downloads / "batch-results.jsonl"
    wait_for(browser, lambda d: path.exists() and path.read_text().count("\n") == 4, 10)
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [x["prompt"] for x in lines] == prompts
    for x in lines:
        api = get(server, f"/v1/tasks/{x['task_id']}/get_result")
        assert x["text"] == api["result"] and x["finish_reason"] == api["finish_reason"]
        assert x["completion_tokens"] == api["completion_tokens"] > 0
    assert console_errors(browser) == []


def test_server_page_charts_update(server, browser):
    open_page(browser, server, "#/server", "#chart-throughput[data-points]")
    chart = browser.find_element("css selector", "#chart-throughput")
    wait_for(browser, lambda d: int(chart.get_attribute("data-points")) >= 1, 10)
    before = int(chart.get_attribute("data-points"))
    tid = post(server, "/v1/tasks/create", {"prompt": "load for the charts", "max_tokens": 150})["task_id"]
    wait_finished(server, tid, 60)
    wait_for(browser, lambda d: int(chart.get_attribute("data-points")) >= before + 3, 15)
    assert float(chart.get_attribute("data-max")) > 0  # the generation showed as throughput
    running = browser.find_element("css selector", "#chart-requests")
    assert int(running.get_attribute("data-points")) == int(chart.get_attribute("data-points"))
    legend = browser.execute_script("return document.getElementById('chart-cacheMiB').parentNode.textContent")
    assert "conversation:" in legend and "tasks_lru:" in legend, legend  # the chat states beside the tiers
    shot(browser, "server")
    assert console_errors(browser) == []


def test_server_page_says_whether_the_database_answers(server, browser):
    """The database card: /health's `database` (ok here); an unavailable one with since when, and
    the error as the card's tooltip (server.js's databaseCard, fed /health's unavailable shape)."""
    open_page(browser, server, "#/server", "#server-cards .stat")
    cards = lambda d: {c.find_element("css selector", ".muted").text: c.find_element("css selector", ".value").text  # noqa: E731
                       for c in d.find_elements("css selector", "#server-cards .stat")}
    wait_for(browser, lambda d: cards(d).get("database") == "ok", 10)
    out = browser.execute_async_script("""
        const done = arguments[arguments.length - 1];
        import("/ui/static/js/server.js").then(({ databaseCard }) => done([
          databaseCard({ status: "ok", database: "unavailable", database_error: "the task database is unreachable",
                         database_unavailable_since: 1796582200 }),
          databaseCard({ status: "loading" })]));
    """)
    assert out[0][0].startswith("unavailable since ") and out[0][1] == "the task database is unreachable", out
    assert out[1] == ["–", None], out
    assert console_errors(browser) == []


def test_cache_chart_counts_the_conversation_cache(server, browser):
    """metrics.js: the conversation cache (rwkv_conversation_cache_*, unlabelled) is a tier of the
    cache chart and of the hit rates, beside the state cache's tiers."""
    names = httpx.get(server.url + "/metrics").text
    assert "rwkv_conversation_cache_bytes " in names and "rwkv_conversation_cache_hits_total " in names
    open_page(browser, server, "#/server", "#server-cards .stat")
    out = browser.execute_async_script("""
        const done = arguments[arguments.length - 1];
        import("/ui/static/js/metrics.js").then(({ parseMetrics, figures, totals }) => {
          const text = (bytes, hits, misses) => [
            'rwkv_state_cache_bytes{tier="tasks_lru"} 0', `rwkv_conversation_cache_bytes ${bytes}`,
            'rwkv_state_cache_hits_total{tier="tasks_lru"} 0', 'rwkv_state_cache_misses_total{tier="tasks_lru"} 0',
            `rwkv_conversation_cache_hits_total ${hits}`, `rwkv_conversation_cache_misses_total ${misses}`].join("\\n");
          const before = parseMetrics(text(0, 1, 1)), now = parseMetrics(text(3 * 2 ** 20, 4, 2));
          const f = figures(now, before, 1);
          done({ mib: f.cacheMiB, rate: f.hitRate, total: totals(now).hitRates });
        }).catch((err) => done({ error: String(err) }));""")
    assert out == {"mib": {"tasks_lru": 0, "conversation": 3}, "rate": {"tasks_lru": None, "conversation": 75},
                   "total": {"tasks_lru": None, "conversation": 400 / 6}}, out
    assert console_errors(browser) == []


def test_the_request_rate_leaves_out_the_probes(server, browser):
    """metrics.js: "HTTP requests/s" counts served requests, not /metrics and /health (the page's
    own polls, a load balancer's probes): an idle server showed 2 requests/s."""
    open_page(browser, server, "#/server", "#server-cards .stat")
    out = browser.execute_async_script("""
        const done = arguments[arguments.length - 1];
        import("/ui/static/js/metrics.js").then(({ parseMetrics, figures }) => {
          const text = (probes, chat) => [
            `rwkv_http_requests_total{method="GET",route="/metrics",code="200"} ${probes}`,
            `rwkv_http_requests_total{method="GET",route="/health",code="200"} ${probes}`,
            `rwkv_http_requests_total{method="POST",route="/v1/chat/completions",code="200"} ${chat}`].join("\\n");
          const f = figures(parseMetrics(text(50, 7)), parseMetrics(text(10, 1)), 2);
          done(f.requests["HTTP requests/s"]);
        }).catch((err) => done({ error: String(err) }));""")
    assert out == 3, out  # (7 - 1) served requests over 2 s


def test_a_value_between_gaps_is_drawn_as_a_dot(server, browser):
    """chart.js: a series value with gaps on both sides (a time to first token seen in one
    interval only) shows as a dot; it drew nothing, though the legend named its value."""
    open_page(browser, server, "#/server", "#server-cards .stat")
    counts = browser.execute_async_script("""
        const done = arguments[arguments.length - 1];
        import("/ui/static/js/chart.js").then(({ LineChart }) => {
          const painted = (values) => {
            const chart = new LineChart("dot-test", "dots");
            document.body.append(chart.el);
            const now = Date.now() / 1000;
            chart.draw([now - 20, now - 10, now], { a: values });
            const c = chart.canvas, px = c.getContext("2d").getImageData(0, 0, c.width, c.height).data;
            let n = 0;  // pixels of the first series' colour (#2f7ed8)
            for (let i = 0; i < px.length; i += 4) if (px[i] === 47 && px[i + 1] === 126 && px[i + 2] === 216) n++;
            chart.el.remove();
            return n;
          };
          done([painted([null, 5, null]), painted([null, null, null])]);
        }).catch((err) => done({ error: String(err) }));""")
    assert counts[0] > 0 and counts[1] == 0, counts


def test_task_deleted_by_another_client(server, browser):
    """A task deleted elsewhere while its page is open (running, then finished): the page says so,
    disables its actions and stops polling (a 404 a second, logged by the server, before)."""
    for running in (True, False):
        body = {"prompt": "to be deleted", "max_tokens": LONG if running else 4}
        tid = post(server, "/v1/tasks/create", body)["task_id"]
        if running:
            open_page(browser, server, f"#/tasks/{tid}", "#task-output")
            wait_for(browser, lambda d: d.find_element("css selector", "#task-output").text, 15)
        else:
            wait_finished(server, tid)
            open_page(browser, server, f"#/tasks/{tid}", "#task-output[data-done]")
        browser.execute_script("performance.setResourceTimingBufferSize(100000)")
        post(server, f"/v1/tasks/{tid}/delete")
        message = browser.find_element("css selector", "#task-message")
        wait_for(browser, lambda d: "deleted" in message.text, 10)
        assert browser.find_element("css selector", "#task-status").text == "deleted"
        controls = browser.find_elements("css selector", "#view button, #view input, #view textarea")
        assert controls and not any(c.is_enabled() for c in controls)
        shot(browser, f"task-deleted-{'running' if running else 'finished'}")
        polls = "return performance.getEntriesByType('resource').filter((e) => e.name.includes('/v1/')).length"
        calls = browser.execute_script(polls)
        time.sleep(2.5)  # two polls and more, were it still polling
        assert browser.execute_script(polls) == calls
        assert "deleted" in message.text
    assert console_errors(browser, allow=("status of 404",)) == []


def test_template_deleted_by_another_client(server, browser):
    """A template's page polls it as a task's page does: one deleted elsewhere while its page is
    open says so by itself (it showed only at the page's next action), disables the actions and
    stops polling."""
    src = post(server, "/v1/tasks/create", {"prompt": "a template to delete", "max_tokens": 0})["task_id"]
    wait_finished(server, src)
    tpl = post(server, f"/v1/tasks/{src}/as_template", name="doomed")["task_id"]
    open_page(browser, server, f"#/tasks/{tpl}", "#fork-form")
    browser.execute_script("performance.setResourceTimingBufferSize(100000)")
    post(server, f"/v1/tasks/{tpl}/delete", force="true")
    message = browser.find_element("css selector", "#task-message")
    wait_for(browser, lambda d: "deleted" in message.text, 5)
    assert browser.find_element("css selector", "#task-status").text == "deleted"
    controls = browser.find_elements("css selector", "#view button, #view input, #view textarea")
    assert controls and not any(c.is_enabled() for c in controls)
    polls = "return performance.getEntriesByType('resource').filter((e) => e.name.includes('/v1/')).length"
    calls = browser.execute_script(polls)
    time.sleep(2.5)  # two polls and more, were it still polling
    assert browser.execute_script(polls) == calls
    assert console_errors(browser, allow=("status of 404",)) == []


def test_template_name_message_stays(server, browser, finished_task):
    """The make-template form's "bad template name" stays through the status polls (the next one
    wiped it) until the name changes."""
    open_page(browser, server, f"#/tasks/{finished_task}", "#template-form")
    _set(browser, "#template-form", "name", "bad name!")
    browser.find_element("css selector", "#template-form button").click()
    view_text = lambda d: d.find_element("css selector", "#view").text  # noqa: E731
    wait_for(browser, lambda d: "template name" in view_text(d), 5)
    time.sleep(2.5)  # the status poll runs every second
    assert "template name" in view_text(browser)
    browser.find_element("css selector", "#template-form [name=name]").send_keys("x")
    wait_for(browser, lambda d: "template name" not in view_text(d), 5)
    assert console_errors(browser) == []


PHONE = {"width": 390, "height": 844, "deviceScaleFactor": 1, "mobile": True}


def test_phone_width_needs_no_sideways_scrolling(server, browser, finished_task, template):
    """At 390 px (a phone), no page is wider than the screen: the header wraps (its key button
    on screen), the charts fit, a wide table scrolls in its own box."""
    post(server, "/v1/tasks/create", {"prompt": "a row with every column", "max_tokens": 4})
    src = post(server, "/v1/tasks/create", {"prompt": "a template the server names", "max_tokens": 0})["task_id"]
    wait_finished(server, src)
    named = post(server, f"/v1/tasks/{src}/as_template")["task_id"]  # _TMPL_<32 hex>: a wide option
    assert named.startswith("_TMPL_") and len(named) > 30, named
    pages = {"tasks": ("#/tasks", "#task-rows tr"), "task": (f"#/tasks/{finished_task}", "#task-output[data-done]"),
             "template": (f"#/tasks/{template}", "#fork-form"),
             "playground": ("#/playground", f'#chat-template option[value="{named}"]'),
             "batch": ("#/batch", "#batch-form"), "server": ("#/server", "#server-cards .stat")}
    browser.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", PHONE)
    try:
        for name, (hash_, ready) in pages.items():
            open_page(browser, server, hash_, ready)
            time.sleep(0.3)  # a refresh or two
            shot(browser, f"phone-{name}")
            width, inner, key = browser.execute_script(
                "return [document.documentElement.scrollWidth, window.innerWidth,"
                " document.getElementById('key-button').getBoundingClientRect().right]")
            assert inner == PHONE["width"], (name, inner)
            assert width <= PHONE["width"] and key <= PHONE["width"], (name, width, key)
        open_page(browser, server, "#/tasks", "#task-rows tr")
        box = browser.execute_script("const w = document.querySelector('#task-rows').closest('.table-wrap');"
                                     " return w && [w.scrollWidth, w.clientWidth]")
        assert box and box[0] > box[1], box  # the table is wider than the screen: it scrolls in its box
        open_page(browser, server, "#/server", "#server-cards .stat")
        right = browser.execute_script("return Math.max(...[...document.querySelectorAll('.chart-card')]"
                                       ".map((c) => c.getBoundingClientRect().right))")
        assert right <= PHONE["width"], right
    finally:
        browser.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})
    assert console_errors(browser) == []


def _rows(browser) -> list[dict]:
    """The batch table's rows, read at once: task id, done / error, status and text."""
    return browser.execute_script("""return [...document.querySelectorAll('#batch-rows tr')].map((tr) => ({
        id: tr.dataset.taskId || null, done: tr.dataset.done === '1', error: tr.dataset.error === '1',
        status: tr.children[2].textContent, text: tr.children[4].textContent}))""")


def _summary(browser) -> str:
    return browser.find_element("css selector", "#batch-summary").text


def test_batch_file_prompts_are_sent_as_written(server, browser, tmp_path):
    """A .jsonl prompt with line ends is one task, and a file's prompts keep their spaces (the
    file was put in the text box, one line a prompt, each trimmed); the page says which source
    Run uses. The text box: one prompt a line as typed, blank lines skipped."""
    open_page(browser, server, "#/batch", "#batch-form")
    written = ["User: hi\n\nAssistant:", "  spaces on both sides  ", "\ta plain line, tab first"]
    upload = tmp_path / "multiline.jsonl"
    upload.write_text(json.dumps({"prompt": written[0]}) + "\n" + json.dumps({"text": written[1]}) + "\n\n"
                      + written[2] + "\n")
    browser.find_element("css selector", "#batch-file").send_keys(str(upload))
    box = browser.find_element("css selector", "#batch-prompts")
    loaded = "return document.querySelector('#batch-source')?.dataset.source === 'file' || !!arguments[0].value"
    wait_for(browser, lambda d: d.execute_script(loaded, box), 5)  # (the page put a file in the box before)
    _set(browser, "#batch-form", "max_tokens", 2)
    browser.find_element("css selector", "#batch-run").click()
    wait_for(browser, lambda d: re.fullmatch(r"(\d+) of \1 done", _summary(d)), 30)
    sent = [get(server, f"/v1/ui/tasks/{r['id']}")["prompt"] for r in _rows(browser)]
    assert sent == written
    source = browser.find_element("css selector", "#batch-source")
    assert source.get_attribute("data-count") == "3" and "multiline.jsonl" in source.text
    assert source.get_attribute("data-source") == "file" and not box.is_enabled()  # the file runs, not the box

    browser.find_element("css selector", "#batch-use-text").click()
    wait_for(browser, lambda d: source.get_attribute("data-source") == "text", 5)
    box.send_keys("  lead space\n\n   \ntrail space  ")
    wait_for(browser, lambda d: source.get_attribute("data-count") == "2", 5)
    browser.find_element("css selector", "#batch-run").click()
    wait_for(browser, lambda d: _summary(d) == "2 of 2 done", 30)
    sent = [get(server, f"/v1/ui/tasks/{r['id']}")["prompt"] for r in _rows(browser)]
    assert sent == ["  lead space", "trail space  "]

    bad = tmp_path / "bad.jsonl"  # a line that starts as JSON but is none: said so, not sent as a prompt
    bad.write_text(json.dumps({"prompt": "fine"}) + '\n{"prompt": "no end\n{"other": 1}\n')
    browser.find_element("css selector", "#batch-file").send_keys(str(bad))
    said = lambda d: d.find_element("css selector", "#batch-message").text  # noqa: E731
    wait_for(browser, lambda d: "lines 2, 3 are no JSON object" in said(d), 5)
    assert source.get_attribute("data-source") == "text"  # nothing was loaded
    assert console_errors(browser) == []


def test_batch_goes_on_past_a_failed_row(server, browser):
    """A row whose task is deleted meanwhile ends as an error and the others go on (one 404 froze
    the batch: every row "running", no download, Run doing nothing); a call that got no answer
    (a network error) is tried again; the batch ends and runs again."""
    open_page(browser, server, "#/batch", "#batch-form")
    browser.execute_script("""window.__failed = 0; const fetch0 = window.fetch;
        window.fetch = (input, init) => String(input).includes('/get_result') && window.__failed < 2
          ? (window.__failed++, Promise.reject(new TypeError('Failed to fetch'))) : fetch0(input, init);""")
    browser.find_element("css selector", "#batch-prompts").send_keys("row one\nrow two\nrow three")
    _set(browser, "#batch-form", "max_tokens", LONG)
    browser.find_element("css selector", "#batch-run").click()
    wait_for(browser, lambda d: all(r["id"] for r in _rows(d)) and len(_rows(d)) == 3, 15)
    ids = [r["id"] for r in _rows(browser)]
    post(server, f"/v1/tasks/{ids[0]}/delete")
    wait_for(browser, lambda d: _rows(d)[0]["error"], 10)
    assert "gone" in _rows(browser)[0]["status"], _rows(browser)[0]
    assert not browser.find_element("css selector", "#batch-run").is_enabled()  # while it runs
    assert get(server, f"/v1/tasks/{ids[1]}/status")["status"] != 3  # the others still run
    for tid in ids[1:]:
        post(server, f"/v1/tasks/{tid}/stop")
    wait_for(browser, lambda d: _summary(d) == "3 of 3 done (1 failed)", 15)
    rows = _rows(browser)
    assert browser.execute_script("return window.__failed") == 2  # both failed reads were tried again
    for r in rows[1:]:
        assert r["done"] and r["text"] == get(server, f"/v1/tasks/{r['id']}/get_result")["result"], r
    assert browser.find_element("css selector", "#batch-download").is_enabled()
    assert not browser.find_element("css selector", "#batch-stop").is_enabled()
    shot(browser, "batch-failed-row")

    box = browser.find_element("css selector", "#batch-prompts")  # and it runs again
    box.clear()
    box.send_keys("one more")
    _set(browser, "#batch-form", "max_tokens", 4)
    browser.find_element("css selector", "#batch-run").click()
    wait_for(browser, lambda d: _summary(d) == "1 of 1 done", 30)
    assert console_errors(browser, allow=("status of 404",)) == []


def test_a_server_that_does_not_answer(server, browser):
    """A server that takes connections but does not answer (SIGSTOP) showed as healthy for good:
    no call had a time limit. A poll without an answer in time says "server not answering",
    the page keeps asking, and it follows the task again once the server answers."""
    tid = post(server, "/v1/tasks/create", {"prompt": "while the server is stopped", "max_tokens": LONG})["task_id"]
    open_page(browser, server, f"#/tasks/{tid}", "#task-output")
    wait_for(browser, lambda d: d.find_element("css selector", "#task-output").text, 15)
    browser.execute_async_script("""const done = arguments[arguments.length - 1];
        import("/ui/static/js/api.js").then((m) => {  // 1.5 s for a poll (10 s), 3 s for a stream (45 s)
          Object.assign(m.timeouts || {}, { get: 1500, stall: 3000 });
          done(); });""")
    message = browser.find_element("css selector", "#task-message")
    server.pause()
    try:
        wait_for(browser, lambda d: "server not answering" in message.text, 10)
        assert message.get_attribute("data-offline") == "1"
        shot(browser, "task-not-answering")
    finally:
        server.resume()
    wait_for(browser, lambda d: not message.text, 10)
    post(server, f"/v1/tasks/{tid}/stop")
    wait_finished(server, tid)
    result = get(server, f"/v1/tasks/{tid}/get_result")["result"]
    wait_for(browser, lambda d: d.find_elements("css selector", "#task-output[data-done]")
             and d.find_element("css selector", "#task-output").get_attribute("textContent") == result, 15)
    assert console_errors(browser) == []


def test_playground_leaves_a_refused_turn_out(server, browser):
    """A turn the server refused (a 400) stayed in the chat's history, sent again with every later
    turn; it is left out now (its bubbles say so). A turn cut by Stop keeps what came."""
    open_page(browser, server, "#/playground", "#chat-template[data-loaded]")
    browser.execute_script("""window.__chats = []; const fetch0 = window.fetch;
        window.fetch = (input, init) => {
          if (String(input).includes('/v1/chat/completions')) window.__chats.push(JSON.parse(init.body).messages);
          return fetch0(input, init); };""")
    _set(browser, "#chat-settings", "max_tokens", 40)
    _set(browser, "#chat-settings", "temperature", 9)  # above the server's bound: a 400
    facts = _chat(browser, "a refused turn")
    assert "temperature" in browser.find_element("css selector", "#view p.error").text
    _set(browser, "#chat-settings", "temperature", 1)
    _chat(browser, "the first turn")
    chats = browser.execute_script("return window.__chats")
    assert chats[-1] == [{"role": "user", "content": "the first turn"}], chats
    assert "failed" in facts and len(browser.find_elements("css selector", "#chat-log .msg.failed")) == 2

    _set(browser, "#chat-settings", "max_tokens", 2000)
    top = "return document.querySelector('#chat-stop').getBoundingClientRect().top"
    before = browser.execute_script(top)
    browser.find_element("css selector", "#chat-input").send_keys("a turn to stop")
    browser.find_element("css selector", "#chat-send").click()
    last = "#chat-log .msg.assistant:last-child .text"
    wait_for(browser, lambda d: len(d.find_element("css selector", last).get_attribute("textContent")) > 40, 15)
    # Stop stays where it was while the reply streams (it moved down with a growing log: a click
    # aimed at it could land on the form)
    assert browser.execute_script(top) == before
    browser.find_element("css selector", "#chat-stop").click()
    wait_for(browser, lambda d: d.find_element("css selector", "#chat-send").is_enabled(), 10)
    stopped = browser.find_element("css selector", last).get_attribute("textContent")
    _set(browser, "#chat-settings", "max_tokens", 4)
    _chat(browser, "after the stop")
    sent = browser.execute_script("return window.__chats")[-1]
    assert [m["content"] for m in sent[-3:]] == ["a turn to stop", stopped, "after the stop"], sent
    assert console_errors(browser, allow=("status of 400",)) == []


def test_seeds_beyond_2_53_are_sent_and_shown_exactly(server, browser):
    """A seed above 2^53 changed on its way (Number(): 9007199254740993 sent as ...992) and on the
    task page (JSON.parse): the form sends the digits typed, the page shows those stored."""
    open_page(browser, server, "#/tasks", "#new-task")
    form = browser.find_element("css selector", "#new-task")
    browser.find_element("css selector", "details > summary").click()
    form.find_element("css selector", "[name=prompt]").send_keys("a big seed")
    _set(browser, "#new-task", "max_tokens", 2)
    _set(browser, "#new-task", "seed", 9007199254740993)
    form.find_element("css selector", "button[type=submit]").click()
    wait_for(browser, lambda d: "#/tasks/TASK_" in d.current_url, 10)
    tid = browser.current_url.rsplit("/", 1)[1]
    assert get(server, f"/v1/ui/tasks/{tid}")["params"]["seed"] == 9007199254740993
    params = browser.find_element("css selector", "#task-params")
    wait_for(browser, lambda d: '"seed":9007199254740993' in params.text, 10)

    top = post(server, "/v1/tasks/create", {"prompt": "the largest seed", "max_tokens": 2, "seed": 2**63 - 1})
    open_page(browser, server, f"#/tasks/{top['task_id']}", "#task-params")
    assert '"seed":9223372036854775807' in browser.find_element("css selector", "#task-params").text
    assert console_errors(browser) == []


def test_a_malformed_task_address(server, browser):
    """#/tasks/%ZZ threw an uncaught URIError: the view stayed blank or on the page before. It
    says the task id is malformed, on the Tasks page."""
    open_page(browser, server, "#/server", "#server-cards .stat")
    browser.execute_script("location.hash = '#/tasks/%ZZ'")
    wait_for(browser, lambda d: d.find_elements("css selector", "#bad-address"), 5)
    view = browser.find_element("css selector", "#view")
    assert view.get_attribute("data-page") == "tasks" and "Bad task id" in view.text and "%ZZ" in view.text
    assert [a.text for a in browser.find_elements("css selector", "nav a.active")] == ["Tasks"]
    assert console_errors(browser) == []
    browser.execute_script("location.hash = '#/tasks'")
    wait_for(browser, lambda d: d.find_elements("css selector", "#task-count"), 5)


def test_a_gone_tmp_task_may_have_expired(server, browser):
    """A TMP_ task's page once it is gone: the API's 404 is the same for deleted and expired
    (--tmp-task-ttl), so the page names both (it said "deleted by another client")."""
    tid = post(server, "/v1/tasks/tmp", {"prompt": "a short-lived one", "max_tokens": 2})["task_id"]
    wait_finished(server, tid)
    open_page(browser, server, f"#/tasks/{tid}", "#task-output[data-done]")
    post(server, f"/v1/tasks/{tid}/delete")
    message = browser.find_element("css selector", "#task-message")
    wait_for(browser, lambda d: "no longer exists" in message.text, 5)
    assert "expired" in message.text and "--tmp-task-ttl" in message.text, message.text
    assert browser.find_element("css selector", "#task-status").text == "deleted or expired"
    open_page(browser, server, f"#/tasks/{tid}", "#task-message .error")  # opened once it is gone
    text = browser.find_element("css selector", "#task-message").text
    assert "not found" in text and "expired" in text, text
    assert console_errors(browser, allow=("status of 404",)) == []


REFUSED_WHILE_RUNNING = ("#continue-form [type=submit]", "#fork-form [type=submit]", "#template-form [type=submit]")


def test_task_page_buttons_and_errors_follow_the_status(server, browser):
    """Continue, fork and make template, which the server refuses (409) while the task runs, are
    disabled meanwhile (they were enabled); an action's error goes once the task's status changes
    (a 409 stayed after the task had finished)."""
    tid = post(server, "/v1/tasks/create", {"prompt": "running for a while", "max_tokens": LONG})["task_id"]
    open_page(browser, server, f"#/tasks/{tid}", "#task-output")
    enabled = lambda d: [d.find_element("css selector", c).is_enabled() for c in REFUSED_WHILE_RUNNING]  # noqa: E731
    wait_for(browser, lambda d: d.find_element("css selector", "#task-output").text, 15)
    assert enabled(browser) == [False, False, False]
    assert browser.find_element("css selector", "#task-stop").is_enabled()
    browser.execute_script("document.getElementById('continue-form').requestSubmit()")  # (a click that raced)
    errors = lambda d: [e.text for e in d.find_elements("css selector", "#task-message .error")]  # noqa: E731
    wait_for(browser, lambda d: any("is running" in e for e in errors(d)), 10)
    post(server, f"/v1/tasks/{tid}/stop")
    wait_finished(server, tid)
    wait_for(browser, lambda d: not errors(d) and enabled(d) == [True, True, True], 10)
    assert not browser.find_element("css selector", "#task-stop").is_enabled()
    assert console_errors(browser, allow=("status of 409",)) == []

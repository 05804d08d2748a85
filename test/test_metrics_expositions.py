"""/metrics of a real server as the Prometheus text format and, for a scraper that asks for it
(Prometheus does, first), as OpenMetrics 1.0: each parses with prometheus_client's parser of that
format, with one family per name. Under OpenMetrics a counter's family is named without its
samples' `_total`, so the engine's time counters, once `rwkv_engine_step_seconds_total` (and
model / sample), were families of the same names as the recent-mean gauges
`rwkv_engine_step_seconds` (...): OpenMetrics refused the scrape ("Clashing name") and the text
format held two families of one name. They are `rwkv_engine_*_time_seconds_total` now."""

from __future__ import annotations

from collections import Counter

import httpx
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families as parse_text
from util_server import server_fixture

server = server_fixture()

PROMETHEUS_ACCEPT = (  # what Prometheus 3 asks for
    "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.6,"
    "application/openmetrics-text;version=0.0.1;q=0.5,text/plain;version=0.0.4;q=0.3,*/*;q=0.2"
)
OLD_NAMES = {f"rwkv_engine_{part}_seconds_total" for part in ("step", "model", "sample")}


def families(parse, text: str) -> dict[str, tuple[str, set[str]]]:
    """{family: (type, its sample names)}; fails where two families share a name."""
    found = list(parse(text))
    twice = [name for name, n in Counter(f.name for f in found).items() if n > 1]
    assert not twice, f"families of one name: {twice}"
    return {f.name: (f.type, {s.name for s in f.samples}) for f in found}


def test_both_expositions_parse_with_one_family_per_name(server):
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=60)
    assert r.status_code == 200, r.text  # the histograms and engine counters have samples
    text = httpx.get(server.url + "/metrics", timeout=30)
    om = httpx.get(server.url + "/metrics", headers={"Accept": PROMETHEUS_ACCEPT}, timeout=30)
    assert text.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    assert om.headers["content-type"] == "application/openmetrics-text; version=1.0.0; charset=utf-8"
    assert om.text.endswith("# EOF\n") and "\n\n" not in om.text
    classic, open_ = families(parse_text, text.text), families(parse_openmetrics, om.text)
    samples = {s for _, names in classic.values() for s in names}
    assert samples == {s for _, names in open_.values() for s in names}  # the same series either way
    assert {n: k for n, (k, _) in classic.items()} == {n: k for n, (k, _) in open_.items()}
    assert open_["rwkv_engine_step_seconds"] == ("gauge", {"rwkv_engine_step_seconds"})
    assert open_["rwkv_engine_step_time_seconds"] == ("counter", {"rwkv_engine_step_time_seconds_total"})
    assert not samples & OLD_NAMES
    assert {"rwkv_http_requests_total", "rwkv_time_to_first_token_seconds_bucket", "rwkv_task_events_total",
            "rwkv_conversation_cache_hits_total", "rwkv_state_cache_hits_total"} <= samples  # fmt: skip

"""The documentation agrees with the code and stays inside the repository.

- Every route the app registers under /v1/tasks appears in docs/task-api.md as "METHOD /path",
  and every "METHOD /v1/tasks..." written there is a route of the app. Routes are read from the
  app object (its OpenAPI schema and its route table), never from module paths, so the test
  holds whatever the API package's layout.
- No file of the repository points at a file outside it: a `.md` file, a path under `shared/`
  or a `../` path that does not resolve to a file or folder of the checkout fails the test.
- Every family a running server's /metrics exports (one engine, and one per device) has its row,
  with its type, in docs/deployment.md's "Metrics" tables, and every row there is exported.
- docs/architecture.md's "Files over 300 lines" names every code file of server/ and kernels/
  over 300 lines, and only those, each with a count (~N) within 10% of its `wc -l`.
- docs/architecture.md's "Module map" names every .py module of server/ and kernels/ (the
  packages' `__init__.py` files aside), and only modules that exist.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any, Iterable, Iterator

import pytest

from server.api.app import create_app
from server.config import Settings

ROOT = Path(__file__).resolve().parent.parent
TASK_DOC = ROOT / "docs" / "task-api.md"
PREFIX = "/v1/tasks"
METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE")
_DOC_ROUTE = re.compile(r"\b(" + "|".join(METHODS) + r") (" + re.escape(PREFIX) + r"[^\s`'\"?)|,]*)")


# --- routes ------------------------------------------------------------------------------------
def _walk(routes: Iterable[Any], prefix: str = "") -> Iterator[tuple[str, str]]:
    """(METHOD, path) of every route in a route table, nested routers and mounts included."""
    for r in routes:
        path, methods = getattr(r, "path", None), getattr(r, "methods", None)
        if path is not None and methods:
            for m in methods:
                if m in METHODS:
                    yield m, prefix + path
        if getattr(r, "routes", None) is not None and path is not None:  # a Mount
            yield from _walk(r.routes, prefix + path)
        inner = getattr(r, "original_router", None)  # an included router (newer FastAPI)
        if inner is not None:
            sub = getattr(getattr(r, "include_context", None), "prefix", "") or ""
            yield from _walk(inner.routes, prefix + sub)


def app_task_routes() -> set[tuple[str, str]]:
    app = create_app(Settings())
    found = {(m.upper(), p) for p, ops in app.openapi()["paths"].items() for m in ops
             if m.upper() in METHODS}
    found |= set(_walk(app.routes))
    return {(m, p) for m, p in found if p == PREFIX or p.startswith(PREFIX + "/")}


def doc_task_routes(text: str) -> set[tuple[str, str]]:
    return {(m, p.rstrip(".:;")) for m, p in _DOC_ROUTE.findall(text)}


def test_the_app_has_task_routes() -> None:
    """The route reader finds the routes (a reader that finds none would pass the tests below)."""
    routes = app_task_routes()
    assert ("POST", "/v1/tasks/create") in routes
    assert ("GET", "/v1/tasks/{task_id}/stream") in routes


def test_every_task_route_is_documented() -> None:
    documented = doc_task_routes(TASK_DOC.read_text(encoding="utf-8"))
    missing = sorted(app_task_routes() - documented)
    assert not missing, f"routes of the app missing from docs/task-api.md: {missing}"


def test_every_documented_task_route_exists() -> None:
    documented = doc_task_routes(TASK_DOC.read_text(encoding="utf-8"))
    assert documented, "docs/task-api.md names no route"
    unknown = sorted(documented - app_task_routes())
    assert not unknown, f"docs/task-api.md documents routes the app does not have: {unknown}"


def test_doc_route_reader() -> None:
    text = "### POST /v1/tasks/{task_id}/fork\nsee `GET /v1/tasks/list?limit=5`, then POST /v1/tasks/tmp."
    assert doc_task_routes(text) == {("POST", "/v1/tasks/{task_id}/fork"), ("GET", "/v1/tasks/list"),
                                     ("POST", "/v1/tasks/tmp")}


AGENTS_DOC = ROOT / "docs" / "agents.md"
RESPONSES = "/v1/responses"


@pytest.mark.parametrize("family", [RESPONSES, "/v1/conversations"])
def test_the_responses_routes_are_documented_in_agents_md(family: str) -> None:
    """Every /v1/responses and /v1/conversations route of the app is named in docs/agents.md, and
    only those."""
    app = create_app(Settings())
    found = {(m.upper(), p) for p, ops in app.openapi()["paths"].items() for m in ops if m.upper() in METHODS}
    found |= set(_walk(app.routes))
    routes = {(m, p) for m, p in found if p == family or p.startswith(family + "/")}
    assert ("POST", family) in routes
    pattern = re.compile(r"\b(" + "|".join(METHODS) + r") (" + re.escape(family) + r"[^\s`'\"?)|,]*)")
    documented = {(m, p.rstrip(".:;")) for m, p in pattern.findall(AGENTS_DOC.read_text(encoding="utf-8"))}
    assert documented == routes, (sorted(routes - documented), sorted(documented - routes))


# --- references to files outside the repository ------------------------------------------------
TEXT_SUFFIXES = {".py", ".md", ".sh", ".cu", ".cuh", ".toml", ".cfg", ".ini", ".yml", ".yaml",
                 ".mako", ".rst"}
_MD = re.compile(r"(?<![\w./~-])[\w.~/-]*\w\.md\b")
_SHARED = re.compile(r"(?<![\w./~-])shared/[\w.-][\w./-]*")
_UP = re.compile(r"(?<![\w./~-])(?:\.\./)+[\w.-][\w./-]*")
_WORD_END = re.compile(r"[\s\"'`()<>\[\]]")


def repo_files() -> list[Path]:
    """The checkout's files that git tracks or would track (untracked, not ignored)."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                             cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the file list comes from git")
    return [ROOT / p for p in sorted(set(out.decode().split("\0"))) if p and (ROOT / p).is_file()]


def _is_text_source(path: Path) -> bool:
    if path.suffix in TEXT_SUFFIXES:
        return True
    if path.suffix:
        return False
    with path.open("rb") as f:  # scripts without a suffix (.ci/run)
        return f.read(2) == b"#!"


def _in_url(text: str, start: int, end: int) -> bool:
    """The match text[start:end] is part of a URL (scheme://... in the same word)."""
    i, j = start, end
    while i > 0 and not _WORD_END.match(text[i - 1]):
        i -= 1
    while j < len(text) and not _WORD_END.match(text[j]):
        j += 1
    return "://" in text[i:j]


def _resolves(ref: str, source: Path) -> bool:
    ref = ref.rstrip("./")
    if not ref or ref.startswith(("/", "~")):
        return False
    for base in (source.parent, ROOT):
        target = (base / ref).resolve()
        if target.is_relative_to(ROOT) and target.exists():
            return True
    return False


def outside_references(path: Path, text: str) -> list[str]:
    """References in `text` (the file at `path`) to files that are not in the repository."""
    bad: dict[tuple[int, str], None] = {}  # (line, reference), in order, each once
    for pattern in (_MD, _SHARED, _UP):
        for m in pattern.finditer(text):
            if _in_url(text, m.start(), m.end()) or _resolves(m.group(0), path):
                continue
            bad[(text.count("\n", 0, m.start()) + 1, m.group(0))] = None
    return [f"{path.relative_to(ROOT)}:{line}: {ref}" for line, ref in sorted(bad)]


def test_no_file_points_outside_the_repository() -> None:
    bad: list[str] = []
    for path in repo_files():
        if path == Path(__file__).resolve():  # its own examples of bad references
            continue
        if _is_text_source(path):
            bad += outside_references(path, path.read_text(encoding="utf-8", errors="replace"))
    assert not bad, "references to files outside the repository:\n" + "\n".join(bad)


def test_outside_reference_finder() -> None:
    src = ROOT / "server" / "api" / "x.py"
    text = ("see shared/TASK-API.md and ../../../shared/GPU-NOTES.md, TASK-API.md, NOTES.md;\n"
            "fine: README.md, migrations/README.md, ../../README.md, ../engine/types.py,\n"
            "https://example.org/a/README-x.md, shared memory, self/shared/x, a..b\n")
    found = [b.split(": ", 1)[1] for b in outside_references(src, text)]
    assert sorted(found) == sorted(["shared/TASK-API.md", "../../../shared/GPU-NOTES.md",
                                    "TASK-API.md", "NOTES.md"])


# --- /metrics families -------------------------------------------------------------------------
DEPLOY_DOC = ROOT / "docs" / "deployment.md"
_METRIC_ROW = re.compile(r"^\| `(rwkv_[a-z0-9_]+)` \| (counter|gauge|histogram) \|", re.M)
_TYPE_LINE = re.compile(r"^# TYPE (rwkv_[a-z0-9_]+) (counter|gauge|histogram)$", re.M)


def doc_metric_families(text: str) -> dict[str, str]:
    """{family: type} of the table rows of the "## Metrics" section (up to the next "## ")."""
    head = re.search(r"^## Metrics$", text, re.M)
    assert head is not None, "no '## Metrics' section"
    end = text.find("\n## ", head.end())
    section = text[head.end():] if end < 0 else text[head.end():end]
    rows = _METRIC_ROW.findall(section)
    families = dict(rows)
    assert len(families) == len(rows), "a family has two rows in the metrics tables"
    return families


def exported_families(text: str) -> dict[str, str]:
    """{family: type} of a /metrics answer (its `# TYPE` lines)."""
    return dict(_TYPE_LINE.findall(text))


@pytest.fixture(scope="module")
def live_metric_families(tmp_path_factory) -> dict[str, str]:
    """The families real servers export once loaded: one engine, and one engine per device
    (`--devices cpu,cpu`: the device families in place of the per-step breakdown)."""
    from util_server import running_server  # test/ is on sys.path under pytest

    found: dict[str, str] = {}
    for args in ((), ("--devices", "cpu,cpu")):
        with running_server(tmp_path_factory.mktemp("metrics"), args=args) as srv:
            import httpx

            answer = httpx.get(srv.url + "/metrics", timeout=30)
            assert answer.status_code == 200, srv.log_tail()
            found.update(exported_families(answer.text))
    return found


def test_every_exported_metric_is_documented(live_metric_families: dict[str, str]) -> None:
    """Every family a running server exports has its row (with its type) in docs/deployment.md."""
    documented = doc_metric_families(DEPLOY_DOC.read_text(encoding="utf-8"))
    assert "rwkv_ready" in live_metric_families and "rwkv_device_slots" in live_metric_families
    missing = sorted(set(live_metric_families) - set(documented))
    assert not missing, f"/metrics families missing from docs/deployment.md's Metrics tables: {missing}"
    wrong = {n: (documented[n], k) for n, k in live_metric_families.items() if documented[n] != k}
    assert not wrong, f"families documented with another type (doc, server): {wrong}"


def test_every_documented_metric_is_exported(live_metric_families: dict[str, str]) -> None:
    documented = doc_metric_families(DEPLOY_DOC.read_text(encoding="utf-8"))
    unknown = sorted(set(documented) - set(live_metric_families))
    assert not unknown, f"docs/deployment.md documents families no server exports: {unknown}"


def test_metric_readers() -> None:
    doc = ("## Metrics\n\n| family | type |\n|---|---|\n| `rwkv_a_total` | counter | | x |\n"
           "| `rwkv_b` | gauge | `tier` | y |\n\n## Next\n\n| `rwkv_c` | gauge | | z |\n")
    assert doc_metric_families(doc) == {"rwkv_a_total": "counter", "rwkv_b": "gauge"}
    text = "# HELP rwkv_h x\n# TYPE rwkv_h histogram\nrwkv_h_bucket{le=\"1\"} 0\n# TYPE rwkv_g gauge\nrwkv_g 1\n"
    assert exported_families(text) == {"rwkv_h": "histogram", "rwkv_g": "gauge"}


# --- "Files over 300 lines" in docs/architecture.md --------------------------------------------
ARCH_DOC = ROOT / "docs" / "architecture.md"
LONG_LINES = 300
CODE_DIRS = ("server/", "kernels/")
CODE_SUFFIXES = {".py", ".cu", ".cuh", ".h", ".cpp", ".js", ".css", ".html"}
_LISTED = re.compile(r"`([\w./-]+)`\s+\(~(\d+)\)")
COUNT_TOLERANCE = 0.10
"""How far a listed count (~N) may be from its file's `wc -l`, as a share of it: beyond, stale."""


def listed_long_files(text: str) -> dict[str, int]:
    """{path: N} of the paths named with a line count ("`path` (~N)") in the "## Files over 300
    lines" section."""
    head = re.search(r"^## Files over 300 lines.*$", text, re.M)
    assert head is not None, "no '## Files over 300 lines' section"
    end = text.find("\n## ", head.end())
    found = _LISTED.findall(text[head.end():] if end < 0 else text[head.end():end])
    return {path: int(n) for path, n in found}


def stale_counts(listed: dict[str, int], lines: dict[str, int]) -> list[str]:
    """"path (~N, wc -l M)" of each listed file of `lines` whose count N is more than
    COUNT_TOLERANCE off its M lines (a file not in `lines` is the other check's)."""
    off = [(p, n, lines[p]) for p, n in listed.items() if p in lines]
    return sorted(f"{p} (~{n}, wc -l {m})" for p, n, m in off if abs(n - m) > COUNT_TOLERANCE * m)


def long_code_files() -> dict[str, int]:
    """{path: lines} of the code files of server/ and kernels/ over LONG_LINES lines (`wc -l`)."""
    out = {}
    for path in repo_files():
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(CODE_DIRS) and path.suffix in CODE_SUFFIXES:
            n = path.read_bytes().count(b"\n")
            if n > LONG_LINES:
                out[rel] = n
    return out


def test_the_long_files_are_listed_in_architecture_md() -> None:
    listed = listed_long_files(ARCH_DOC.read_text(encoding="utf-8"))
    long = long_code_files()
    assert long, "the line counter finds no long file"
    missing = sorted(f"{p} ({n})" for p, n in long.items() if p not in listed)
    assert not missing, f"files over {LONG_LINES} lines missing from docs/architecture.md's list: {missing}"
    stale = sorted(set(listed) - set(long))
    assert not stale, f"docs/architecture.md lists files no longer over {LONG_LINES} lines (or gone): {stale}"
    off = stale_counts(listed, long)
    assert not off, f"docs/architecture.md's line counts more than {COUNT_TOLERANCE:.0%} off `wc -l`: {off}"


def test_long_file_reader() -> None:
    text = ("## Files over 300 lines, and why\n\n- `a/b.py` (~310), `c.cu`\n  (~420): x; `d.py` went to `e.py`.\n"
            "## Next\n- `f.py` (~900)\n")
    assert listed_long_files(text) == {"a/b.py": 310, "c.cu": 420}
    assert stale_counts({"a/b.py": 310, "c.cu": 420}, {"a/b.py": 340, "c.cu": 470}) == ["c.cu (~420, wc -l 470)"]


# --- "Module map" in docs/architecture.md ------------------------------------------------------
_MAPPED = re.compile(r"`((?:server|kernels)/[\w/.-]+\.py)`")


def mapped_modules(text: str) -> set[str]:
    """The .py paths of server/ and kernels/ named (in backticks) in the "## Module map" section."""
    head = re.search(r"^## Module map$", text, re.M)
    assert head is not None, "no '## Module map' section"
    end = text.find("\n## ", head.end())
    return set(_MAPPED.findall(text[head.end():] if end < 0 else text[head.end():end]))


def test_every_module_is_in_the_module_map() -> None:
    """Every .py module of server/ (and of kernels/, the loader) is named in docs/architecture.md's
    module map, and every module named there exists. The map has one row per module; the
    packages' `__init__.py` files are described together below it, so they are not counted."""
    mapped = mapped_modules(ARCH_DOC.read_text(encoding="utf-8"))
    modules = set()
    for path in repo_files():
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(CODE_DIRS) and path.suffix == ".py" and path.name != "__init__.py":
            modules.add(rel)
    assert "server/engine/engine.py" in modules, "the module finder finds no module"
    missing = sorted(modules - mapped)
    assert not missing, f"modules missing from docs/architecture.md's module map: {missing}"
    gone = sorted(mapped - modules)
    assert not gone, f"docs/architecture.md's module map names modules that do not exist: {gone}"

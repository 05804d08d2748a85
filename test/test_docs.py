"""The documentation agrees with the code and stays inside the repository.

- Every route the app registers under /v1/tasks appears in docs/task-api.md as "METHOD /path",
  and every "METHOD /v1/tasks..." written there is a route of the app. Routes are read from the
  app object (its OpenAPI schema and its route table), never from module paths, so the test
  holds whatever the API package's layout.
- No file of the repository points at a file outside it: a `.md` file, a path under `shared/`
  or a `../` path that does not resolve to a file or folder of the checkout fails the test.
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


def test_the_responses_routes_are_documented_in_agents_md() -> None:
    """Every /v1/responses route of the app is named in docs/agents.md, and only those."""
    app = create_app(Settings())
    found = {(m.upper(), p) for p, ops in app.openapi()["paths"].items() for m in ops if m.upper() in METHODS}
    found |= set(_walk(app.routes))
    routes = {(m, p) for m, p in found if p == RESPONSES or p.startswith(RESPONSES + "/")}
    assert ("POST", RESPONSES) in routes
    pattern = re.compile(r"\b(" + "|".join(METHODS) + r") (" + re.escape(RESPONSES) + r"[^\s`'\"?)|,]*)")
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

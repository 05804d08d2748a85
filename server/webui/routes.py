"""Routes of the dashboard.

- GET /ui: the single page (index.html); its views are hash routes (#/tasks, #/playground, ...).
- GET /ui/static/{name}: the page's CSS and JavaScript, from this package (no build step, nothing
  fetched from elsewhere at run time).
- GET /: redirects to /ui, so a browser pointed at the server lands on the dashboard.
- The page and its files are served no-cache with an ETag: the browser asks again each time
  with If-None-Match, answered 304 (no body) while the file is the same, so an upgraded
  server's files load at once. HEAD works on /, /ui and /ui/static/* as GET does.
- GET /v1/ui/tasks/{task_id}: what the task API does not return and the task and template pages
  show: the task's last prompt (`prompt`: its text, "" for token ids or none; `prompt_len`: its
  tokens, 0 for none) and its stored parameters, and `output_start` (where in the token
  history the current output starts: it grows when a run starts with a new prompt). `brief=true`
  leaves out the prompt and parameters (the task page's poll, which watches for new runs).
  `elsewhere` (full answer only): null, or {message, instance, url} when the task runs on another
  server of the database (a replica), the 409 its stream would answer: the page shows it without
  asking for the stream. Under /v1, so API keys and ownership apply as on the task routes
  (another key's task is a 404).

The pages need no key to load; every /v1 call they make carries the key the user typed.
"""

from __future__ import annotations

import mimetypes
from pathlib import Path
from typing import Any

import orjson
from fastapi import APIRouter, Query, Request
from fastapi.responses import FileResponse, RedirectResponse, Response
from starlette.staticfiles import NotModifiedResponse, StaticFiles

from server.api.errors import ApiError, task_error
from server.api.openapi import answers
from server.api.services import get_owner, get_services
from server.tasks.errors import TaskElsewhere, TaskError
from server.tasks.inventory import seen_by

STATIC = Path(__file__).resolve().parent / "static"
_NO_CACHE = {"Cache-Control": "no-cache"}  # revalidate (ETag) so an upgraded server's files load

router = APIRouter()


def _assets() -> dict[str, Path]:
    """Served files by URL name ("style.css", "js/app.js"): only what the package ships."""
    return {p.relative_to(STATIC).as_posix(): p for p in STATIC.rglob("*") if p.is_file() and p.name != "index.html"}


ASSETS = _assets()


_GET_HEAD = ["GET", "HEAD"]


_REVALIDATE = StaticFiles(directory=STATIC, check_dir=False)
"""Starlette's conditional-request rule (If-None-Match, If-Modified-Since), for the files below."""


def _file(request: Request, path: Path, media: str) -> Response:
    """The file, or a 304 when the request's If-None-Match or If-Modified-Since says the client
    has it (FileResponse itself never answers 304). HEAD: the same headers, no body (FileResponse
    sends none)."""
    response = FileResponse(path, media_type=media, headers=_NO_CACHE, stat_result=path.stat())
    if _REVALIDATE.is_not_modified(response.headers, request.headers):
        return NotModifiedResponse(response.headers)
    return response


@router.api_route("/", methods=_GET_HEAD, include_in_schema=False)
async def root() -> Response:
    return RedirectResponse("/ui", status_code=307)


@router.api_route("/ui", methods=_GET_HEAD, include_in_schema=False)
async def index(request: Request) -> Response:
    return _file(request, STATIC / "index.html", "text/html; charset=utf-8")


@router.api_route("/ui/static/{name:path}", methods=_GET_HEAD, include_in_schema=False)
async def asset(name: str, request: Request) -> Response:
    path = ASSETS.get(name)
    if path is None:
        raise ApiError(404, f"no dashboard file {name!r}", code="not_found")
    media = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
    if media.startswith("text/") or media.endswith("javascript"):
        media += "; charset=utf-8"
    return _file(request, path, media)


@router.get("/v1/ui/tasks/{task_id}", tags=["dashboard"], responses=answers(401, 404, 422, 503))
async def task_detail(task_id: str, request: Request, brief: bool = Query(False)) -> Response:
    """A task's or template's last prompt, parameters and counters (the dashboard's task and
    template pages); brief=true: the counters only. Same visibility as GET
    /v1/tasks/{id}/status: 404 for another key's task."""
    services = get_services(request)
    if services.tasks is None:
        raise ApiError(503, "the task manager is not running", code="tasks_unavailable")
    owner, away = get_owner(request), None
    try:
        try:  # what the page's stream would meet: a task running on a replica is a 409 there
            t = await services.tasks.get(task_id, owner, stream=not brief)
        except TaskElsewhere as exc:
            away = {"message": str(exc), "instance": exc.instance, "url": exc.url}
            t = await services.tasks.get(task_id, owner)
    except TaskError as exc:
        raise task_error(exc) from None
    out = seen_by(services.tasks.owner_id(owner), owner is None, t.owner, _detail(t, brief))
    if not brief:
        out["elsewhere"] = away
    return Response(orjson.dumps(out), media_type="application/json")


def _detail(t: Any, brief: bool = False) -> dict[str, Any]:
    out = {
        **t.summary(),
        "output_start": t.out_start,
        "prompt_tokens": t.prompt_tokens,
        "completion_tokens": t.completion_tokens,
        "speed": t.speed(),
    }
    if not brief:
        out.update(prompt=t.prompt, prompt_len=t.prompt_len, params=t.params, tag=t.tag)
    return out

"""The web dashboard: static pages served at /ui, built only on the public HTTP APIs.

`app.include_router(server.webui.router)` adds it to an app (server/api/app.py does).
"""

from server.webui.routes import router

__all__ = ["router"]

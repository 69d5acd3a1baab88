"""The hub's web UI (GPU > Optimizer): server-rendered pages under ``/ui`` in the hub's own process, with the
API's database, roles and write functions. ``install(app)`` mounts it."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import RedirectResponse
from fastapi.staticfiles import StaticFiles

from hub.web import admin
from hub.web import clusters
from hub.web import operations
from hub.web import policies
from hub.web.common import install_error_pages
from hub.web.render import STATIC
from hub.web.session_db import WebSession

__all__ = ["WebSession", "install"]


def install(app: FastAPI) -> None:
    """Add the pages (after the API's error handlers are installed: ``/ui`` errors become pages)."""
    app.mount("/ui/static", StaticFiles(directory=STATIC), name="ui-static")
    for module in (clusters, policies, operations, admin):
        app.include_router(module.router)
    install_error_pages(app)

    @app.get("/", include_in_schema=False)
    def root() -> RedirectResponse:
        return RedirectResponse("/ui/clusters", status_code=303)

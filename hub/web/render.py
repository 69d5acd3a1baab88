"""Templates (Jinja2, autoescaped: every value from the database or a form is escaped) and the headers every
page gets."""

from __future__ import annotations

import json
from datetime import UTC
from datetime import datetime
from pathlib import Path
from typing import Any
from typing import Final

from fastapi import Request
from fastapi.responses import HTMLResponse
from jinja2 import Environment
from jinja2 import FileSystemLoader
from jinja2 import StrictUndefined
from jinja2 import select_autoescape

from hub.web.sessions import SignedIn

TEMPLATES: Final = Path(__file__).parent / "templates"
STATIC: Final = Path(__file__).parent / "static"

# No inline script or style anywhere: a value that escaped escaping still could not run.
SECURITY_HEADERS: Final = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",  # "no-referrer" would make browsers send "Origin: null"
    "X-Frame-Options": "DENY",
    # Pages show tokens once: never from a cache.
    "Cache-Control": "no-store",
}


def _when(value: datetime | None) -> str:
    if value is None:
        return "never"
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _money(value: float | None) -> str:
    return "?" if value is None else f"${value:,.2f}"


environment = Environment(
    loader=FileSystemLoader(TEMPLATES), autoescape=select_autoescape(default=True, default_for_string=True),
    undefined=StrictUndefined, trim_blocks=True, lstrip_blocks=True,
)
environment.filters["when"] = _when
environment.filters["money"] = _money
# Plain text, escaped like any other value (Jinja's tojson writes \u003c for "<": unreadable in a page).
environment.filters["as_json"] = lambda value: json.dumps(value, ensure_ascii=False, sort_keys=True)

NAV: Final = [
    ("clusters", "Clusters", "/ui/clusters", "viewer"),
    ("approvals", "Approvals", "/ui/approvals", "viewer"),
    ("activity", "Activity", "/ui/activity", "viewer"),
    ("pools", "Pools", "/ui/pools", "viewer"),
    ("audit", "Audit log", "/ui/audit", "admin"),
]


def page(request: Request, template: str, *, title: str, signed_in: SignedIn | None, section: str = "",
         status_code: int = 200, **context: Any) -> HTMLResponse:
    html = environment.get_template(template).render(
        title=title, signed_in=signed_in, section=section, nav=NAV, request_path=request.url.path,
        csrf=signed_in.csrf_token if signed_in else "", **context,
    )
    return HTMLResponse(html, status_code=status_code, headers=SECURITY_HEADERS)


def confirm(request: Request, signed_in: SignedIn, *, section: str, title: str, button: str, back: str, text: str,
            danger: bool = True) -> HTMLResponse:
    """A page that asks before a change: its form posts to the page's own path, the change's POST route, so a
    confirmation can never name one change and post another."""
    return page(request, "confirm.html", title=title, signed_in=signed_in, section=section, button=button,
                back=back, text=text, danger=danger)

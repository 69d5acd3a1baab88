"""`kubeon-gpu console`: the Temporal UI as the operator's console, served through a small reverse proxy.

The Temporal UI keeps the workflow list's columns in the browser (localStorage ``namespace-workflow-table-columns``)
and shows Status, Workflow ID, Run ID, Type, Start and End until someone configures more by hand; nothing on the
server can change that. The console proxies the UI unchanged except for two things:

- ``/`` opens the operations awaiting approval (``KubeonPhase="AwaitingApproval"``) of the namespace;
- each HTML page gets one inline script that, when this browser has no column choice for the namespace yet,
  stores the Kubeon columns (policy, location, $/h, phase), so the list shows what approving will spend. A choice
  the operator made in the UI is never overwritten. The page's Content-Security-Policy gets the script's hash, so
  nothing else is allowed to run that was not allowed before.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from dataclasses import field
from urllib.parse import quote

import httpx
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import RedirectResponse
from starlette.responses import Response
from starlette.responses import StreamingResponse
from starlette.routing import Route

from models import search_attributes as sa

COLUMNS_KEY = "namespace-workflow-table-columns"
DEFAULT_COLUMNS = ("Status", "Workflow ID", sa.POLICY.name, sa.LOCATION.name, sa.USD_PER_HOUR.name, sa.PHASE.name,
                   sa.OPERATION_KIND.name, "Start", "End")
AWAITING_APPROVAL_QUERY = f'{sa.PHASE.name}="AwaitingApproval"'
# Request headers that belong to one hop (RFC 9110 7.6.1) or that the proxy sets itself.
_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
        "transfer-encoding", "upgrade", "host", "content-length"}
_CSP_META = re.compile(r'(<meta http-equiv="content-security-policy" content="[^"]*script-src)([^";]*)', re.I)


def workflows_url(base: str, namespace: str, query: str = AWAITING_APPROVAL_QUERY) -> str:
    """A link to the UI's workflow list filtered by ``query`` (what `kubeon-gpu ops list` prints)."""
    return f"{base.rstrip('/')}/namespaces/{quote(namespace, safe='')}/workflows?query={quote(query, safe='')}"


def column_script(namespace: str, columns: tuple[str, ...] = DEFAULT_COLUMNS) -> str:
    """Seeds the column choice of the namespace in the page's URL (else ``namespace``) when there is none."""
    cols = json.dumps([{"label": c} for c in columns])
    return ("(function(){try{var k=" + json.dumps(COLUMNS_KEY) + ";"
            "var m=location.pathname.match(/^\\/namespaces\\/([^\\/]+)/);"
            "var ns=m?decodeURIComponent(m[1]):" + json.dumps(namespace) + ";"
            "var s=JSON.parse(localStorage.getItem(k)||'{}')||{};"
            "if(!s[ns]||!s[ns].length){s[ns]=" + cols + ";localStorage.setItem(k,JSON.stringify(s));}"
            "}catch(e){}})();")


def inject(html: str, script: str) -> str:
    """The page with ``script`` first in its head, and the script's hash allowed by the page's CSP meta tag."""
    digest = base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()
    html, _ = _CSP_META.subn(lambda m: f"{m.group(1)}{m.group(2)} 'sha256-{digest}'", html, count=1)
    head = re.search(r"<head[^>]*>", html, re.I)
    if head is None:
        return html
    return html[: head.end()] + f"<script>{script}</script>" + html[head.end():]


@dataclass
class ConsoleSettings:
    upstream: str  # the Temporal UI, e.g. http://127.0.0.1:8233
    namespace: str = "default"
    columns: tuple[str, ...] = field(default=DEFAULT_COLUMNS)


def create_app(settings: ConsoleSettings) -> Starlette:
    script = column_script(settings.namespace, settings.columns)
    upstream: dict[str, httpx.AsyncClient] = {}

    @asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        async with httpx.AsyncClient(base_url=settings.upstream, timeout=httpx.Timeout(60, connect=5),
                                     follow_redirects=False) as client:
            upstream["ui"] = client
            yield

    async def home(_request: Request) -> Response:
        return RedirectResponse(workflows_url("", settings.namespace), status_code=302)

    async def proxy(request: Request) -> Response:
        client = upstream["ui"]
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in _HOP]
        wants_html = "text/html" in request.headers.get("accept", "")
        if wants_html:  # the page is rewritten: ask for it uncompressed
            headers = [(k, v) for k, v in headers if k.lower() != "accept-encoding"]
        # The raw path: workflow IDs hold `/`, sent by the UI as %2F, which a decoded path would turn into
        # separators (a 404 upstream).
        raw = request.scope.get("raw_path") or request.url.path.encode()
        target = raw.decode("latin-1") + (f"?{request.url.query}" if request.url.query else "")
        req = client.build_request(request.method, target, headers=headers, content=request.stream())
        try:
            resp = await client.send(req, stream=True)
        except httpx.TransportError as exc:
            return Response(f"Temporal UI at {settings.upstream} unreachable: {exc}\n", status_code=502,
                            media_type="text/plain")
        out_headers = [(k, v) for k, v in resp.headers.multi_items() if k.lower() not in _HOP]
        if resp.headers.get("content-type", "").startswith("text/html"):
            body = await resp.aread()
            await resp.aclose()
            page = inject(body.decode(resp.encoding or "utf-8"), script).encode()
            out_headers = [(k, v) for k, v in out_headers if k.lower() != "content-encoding"]
            response = Response(page, status_code=resp.status_code)
        else:
            response = StreamingResponse(resp.aiter_raw(), status_code=resp.status_code,
                                         background=BackgroundTask(resp.aclose))
        # Raw pairs: the UI sets several cookies (Set-Cookie repeated).
        response.raw_headers = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in out_headers
                                if k.lower() != "content-length"] + [
            (k, v) for k, v in response.raw_headers if k == b"content-length"]
        return response

    methods = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]
    return Starlette(routes=[Route("/", home), Route("/{path:path}", proxy, methods=methods)], lifespan=lifespan)

"""The gateway's own metrics (``/metrics`` on its health port, Prometheus text format): requests by route
template and status, joins by outcome. Labels carry bounded values only, never a node name, ticket or token."""

from __future__ import annotations

from typing import Final

from fastapi import FastAPI
from fastapi import Response
from prometheus_client import REGISTRY
from prometheus_client import Counter
from prometheus_client import generate_latest
from starlette.types import ASGIApp
from starlette.types import Message
from starlette.types import Receive
from starlette.types import Scope
from starlette.types import Send

from models.join import gateway_route

METRICS_CONTENT_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"

GATEWAY_REQUESTS = Counter("kubeon_gateway_requests", "Requests to the burst gateway by route and status code",
                           ["route", "code"])
GATEWAY_JOINS = Counter("kubeon_gateway_joins", "Join attempts of burst nodes by outcome (admitted, refused, "
                        "invalid, error)", ["outcome"])

# Bytes burst nodes moved through the tunnel, measured at the gateway's WireGuard interface (gateway.transfer), by the
# node's location (its ticket's location label) and direction: ``egress`` node -> home (leaving the remote cloud,
# what it charges for), ``ingress`` home -> node. Added as each node's slot record is written.
BURST_TRANSFER = Counter("kubeon_burst_transfer_bytes", "Bytes burst nodes moved through the tunnel, measured at the "
                         "gateway: direction egress (node -> home, leaving the remote cloud) or ingress (home -> "
                         "node)", ["location", "direction"])

GATEWAY_ROUTES = ("/v1/join", "/v1/tickets", "/healthz", "/readyz", "/metrics")


def _gateway_route(path: str) -> str:
    route = gateway_route(path)
    return route if route in GATEWAY_ROUTES or route.startswith("/v1/nodes/") else "other"


def _join_outcome(status: int) -> str:
    if status < 300:
        return "admitted"
    if status in (401, 403, 409):
        return "refused"
    return "invalid" if status < 500 else "error"


class GatewayRequestCounter:
    """ASGI middleware of the gateway: requests by route template and status, joins by outcome. It sees only the
    status code, never a body (the join ticket) or a header."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            route = _gateway_route(str(scope.get("path", "")))
            GATEWAY_REQUESTS.labels(route=route, code=str(status)).inc()
            if route == "/v1/join" and scope.get("method") == "POST":
                GATEWAY_JOINS.labels(outcome=_join_outcome(status)).inc()


def add_metrics_route(app: FastAPI) -> None:
    """``GET /metrics`` (Prometheus text format) on a FastAPI app: the gateway's health port."""

    @app.get("/metrics", include_in_schema=False)
    def metrics() -> Response:
        return Response(generate_latest(REGISTRY), media_type=METRICS_CONTENT_TYPE)

"""`kubeon-gpu gateway`: the burst gateway as a network service (R4.2, R5.x).

It runs as its own Deployment with its own ServiceAccount (``kubeon-gpu-optimizer-gateway``: node rules and
``tokenreviews create``) and alone holds the ticket signing key. Endpoints on ``KUBEON_GATEWAY_LISTEN``:

- ``POST /v1/tickets`` (the optimizer): a one-time join ticket for one node of one operation, and where the node
  joins: ``endpoint`` (``KUBEON_GATEWAY_PUBLIC_URL``, else ``https://<LoadBalancer address>:<port>`` of the
  Service ``KUBEON_GATEWAY_SERVICE``, read with the gateway's namespaced Role) and ``serverName`` (the URL's host,
  else ``<service>.<namespace>.svc``, which the chart's certificate carries). 503 ``address_pending`` until the
  LoadBalancer has an address. The ticket reserves the node's address slot (tunnel IP, pod CIDR) until it
  expires or the node is removed; 503 ``addresses_exhausted`` when none is free (no instance should launch).
- ``GET /v1/capacity`` (the optimizer): the address slots, ``total`` and ``held`` (reservations included), and
  the ``nodes`` holding them; the optimizer plans no more new nodes than are free.
- ``DELETE /v1/nodes/{name}?operation=op-...`` (the optimizer): remove a burst Node of that operation; 409 for a
  Node of another operation.
- ``POST /v1/join`` (a booting burst node; the ticket is its only credential): redeem the ticket with the node's
  WireGuard public key and kubelet CSR (``models.join.JoinRedeem``); the answer (``JoinAnswer``) carries the
  signed kubelet certificate, the tunnel's parameters, the pod CIDR and the API server address. The gateway creates
  no Node; the node registers itself, then the gateway's reconciler applies its ticket's labels and taints.

With ``KUBEON_GATEWAY_TUNNEL_INTERFACE`` the gateway runs ``wireguard-go`` on that interface (UDP
``KUBEON_GATEWAY_UDP_PORT``), gives it the first address of ``KUBEON_GATEWAY_TUNNEL_CIDR``, clamps the TCP MSS and
masquerades tunnel traffic to the service CIDR (nftables), and proxies ``<gateway tunnel IP>:443`` to the API
server. Peers and address slots live in ConfigMaps in its namespace and are restored from there on start.

The optimizer authenticates with its ServiceAccount token (``Authorization: Bearer``), checked with the
TokenReview API; only the usernames in ``KUBEON_GATEWAY_ALLOWED_CLIENTS`` may ask for tickets, capacity or removals.
``/healthz`` and ``/readyz`` are served on ``KUBEON_HEALTH_PORT`` (the chart probes port 8080), or on the main
listener when both ports are the same. Every error is JSON: ``{"error": "<code>", "message": "<reason>"}``.
Tokens and tickets are never logged.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import ssl
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Final

import urllib3
import uvicorn
from fastapi import Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from kubernetes import client, config
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from activities.gateway import GatewayAddressPending, GatewayAddressUnknown, KubeGateway, ServiceRef
from activities.gateway_join import AddressPlan, GatewayTunnel
from models.errors import JoinRefused, TicketError
from models.join import JoinRedeem, JoinTicketRequest
from models.labels import LABEL_OPERATION
from tunnel import keys, link
from tunnel.proxy import TcpProxy
from worker import telemetry
from worker.config import ConfigError, Settings, load_settings
from worker.pool_join import DEFAULT_CLAIM_KEYS_FILE, POOL_CLAIM_HEADER, JoinTokenRefused, check_pool_claim
from worker.runtime import kube_api

log = logging.getLogger("kubeon.gateway")

DEFAULT_LISTEN: Final = "0.0.0.0:8443"
DEFAULT_ALLOWED_CLIENTS: Final = "system:serviceaccount:kubeon-gpu:kubeon-gpu-optimizer"
MAX_BODY_BYTES: Final = 64 * 1024
MAX_TICKET_TTL_SECONDS: Final = 24 * 3600
# Labels no ticket may set: the gateway sets the hostname and OS; node roles are the cluster admin's.
RESERVED_LABELS: Final = frozenset({"kubernetes.io/hostname", "kubernetes.io/os"})
RESERVED_LABEL_PREFIXES: Final = ("node-role.kubernetes.io/", "node-restriction.kubernetes.io/")
NODE_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


# ----- configuration -------------------------------------------------------------------------------------------


def parse_listen(value: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[IPv6]:PORT``."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"KUBEON_GATEWAY_LISTEN {value!r}: expected HOST:PORT, e.g. {DEFAULT_LISTEN}")
    return host.removeprefix("[").removesuffix("]"), int(port)


@dataclass(frozen=True)
class GatewayServerConfig:
    host: str
    port: int
    health_port: int
    ticket_key_file: Path
    kubeconfig: Path | None = None  # None: in-cluster ServiceAccount credentials (the gateway's own)
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None
    allowed_clients: frozenset[str] = frozenset({DEFAULT_ALLOWED_CLIENTS})
    # Empty: the API server's own audiences (the default ServiceAccount token). Set to make the optimizer send a
    # projected token only the gateway accepts, so the gateway never holds a token usable against the API server.
    token_audiences: tuple[str, ...] = ()
    max_body_bytes: int = MAX_BODY_BYTES
    # Where burst nodes join: public_url, else the LoadBalancer address of service; neither: the worker's URL.
    public_url: str = ""
    service: ServiceRef | None = None
    namespace: str = "kubeon-gpu"
    plan: AddressPlan = field(default_factory=AddressPlan)
    tunnel_interface: str = ""
    wireguard_key_file: Path | None = None
    udp_port: int = 51820
    tunnel_endpoint: str = ""
    mtu: int = 1380
    api_upstream: str = ""

    @property
    def tls(self) -> bool:
        return self.tls_cert_file is not None

    @classmethod
    def from_settings(cls, settings: Settings) -> GatewayServerConfig:
        host, port = parse_listen(settings.gateway_listen)
        if settings.gateway_ticket_key_file is None:
            raise ConfigError("KUBEON_GATEWAY_TICKET_KEY_FILE is required: the file holding the join ticket key")
        cert, key = settings.gateway_tls_cert_file, settings.gateway_tls_key_file
        if bool(cert) != bool(key):
            raise ConfigError("KUBEON_GATEWAY_TLS_CERT_FILE and KUBEON_GATEWAY_TLS_KEY_FILE go together")
        clients = frozenset(c.strip() for c in settings.gateway_allowed_clients.split(",") if c.strip())
        if not clients:
            raise ConfigError("KUBEON_GATEWAY_ALLOWED_CLIENTS is empty: name the optimizer's ServiceAccount user, "
                              f"e.g. {DEFAULT_ALLOWED_CLIENTS}")
        audiences = settings.gateway_token_audiences
        # The gateway's own credentials: KUBEON_GATEWAY_KUBECONFIG, else KUBEON_KUBECONFIG, else in-cluster.
        kubeconfig = settings.gateway_kubeconfig or settings.kubeconfig
        service = (ServiceRef(settings.gateway_service, settings.gateway_service_namespace)
                   if settings.gateway_service else None)
        try:
            plan = AddressPlan(tunnel_cidr=settings.gateway_tunnel_cidr, pod_cidr=settings.gateway_pod_cidr,
                               node_mask=settings.gateway_node_cidr_mask, service_cidr=settings.gateway_service_cidr)
        except ValueError as exc:
            raise ConfigError(f"KUBEON_GATEWAY_TUNNEL_CIDR / KUBEON_GATEWAY_POD_CIDR / KUBEON_GATEWAY_SERVICE_CIDR: "
                              f"{exc}") from None
        if settings.gateway_tunnel_interface:
            link.check_ifname(settings.gateway_tunnel_interface)
            if settings.gateway_wireguard_key_file is None:
                raise ConfigError("KUBEON_GATEWAY_WIREGUARD_KEY_FILE is required with KUBEON_GATEWAY_TUNNEL_INTERFACE:"
                                  " the gateway's WireGuard private key (it must survive restarts)")
        return cls(
            host=host, port=port, health_port=settings.health_port, ticket_key_file=settings.gateway_ticket_key_file,
            kubeconfig=kubeconfig, tls_cert_file=cert, tls_key_file=key, allowed_clients=clients,
            token_audiences=tuple(a.strip() for a in audiences.split(",") if a.strip()),
            public_url=settings.gateway_public_url, service=service,
            namespace=settings.gateway_service_namespace, plan=plan,
            tunnel_interface=settings.gateway_tunnel_interface, wireguard_key_file=settings.gateway_wireguard_key_file,
            udp_port=settings.gateway_udp_port, tunnel_endpoint=settings.gateway_tunnel_endpoint,
            mtu=settings.gateway_tunnel_mtu, api_upstream=settings.gateway_api_upstream,
        )


def check_tls_files(cfg: GatewayServerConfig) -> None:
    """The certificate and key load and belong together (the chart mounts them from the gateway's TLS Secret)."""
    if cfg.tls_cert_file is None or cfg.tls_key_file is None:
        return
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cfg.tls_cert_file, cfg.tls_key_file)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"KUBEON_GATEWAY_TLS_CERT_FILE {cfg.tls_cert_file} / KUBEON_GATEWAY_TLS_KEY_FILE "
                          f"{cfg.tls_key_file}: cannot load the certificate and key: "
                          f"{getattr(exc, 'strerror', None) or exc}") from None


# ----- optimizer authentication --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Identity:
    authenticated: bool
    username: str = ""
    error: str = ""


class TokenReviewer:
    """Who a bearer token belongs to, by the TokenReview API, asked with the gateway's own credentials."""

    def __init__(self, api: client.ApiClient, audiences: tuple[str, ...] = ()) -> None:
        self._auth = client.AuthenticationV1Api(api)
        self._audiences = list(audiences) or None

    def review(self, token: str) -> Identity:
        review = self._auth.create_token_review(client.V1TokenReview(
            spec=client.V1TokenReviewSpec(token=token, audiences=self._audiences)))
        status = review.status
        if status is None or not status.authenticated:
            return Identity(False, error=(status.error if status is not None else "") or "")
        user = status.user
        return Identity(True, username=(user.username if user is not None else "") or "")

    def whoami(self) -> str:
        """The gateway's own user (SelfSubjectReview, allowed to every authenticated user)."""
        review = self._auth.create_self_subject_review(client.V1SelfSubjectReview())
        info = review.status.user_info if review.status is not None else None
        return str(info.username) if info is not None and info.username else "?"


# ----- errors --------------------------------------------------------------------------------------------------


class GatewayHTTPError(Exception):
    def __init__(self, status: int, code: str, message: str, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = dict(headers or {})

    def response(self) -> JSONResponse:
        return JSONResponse({"error": self.code, "message": self.message}, status_code=self.status,
                            headers=self.headers)


def _unauthorized(message: str) -> GatewayHTTPError:
    description = message.replace('"', "'")
    return GatewayHTTPError(401, "unauthorized", message, {
        "WWW-Authenticate": f'Bearer realm="kubeon-gateway", error="invalid_token", '
                            f'error_description="{description}"'})


def _kube_error(exc: client.ApiException, what: str) -> GatewayHTTPError:
    reason = exc.reason or ""
    with contextlib.suppress(ValueError, AttributeError, TypeError):
        reason = json.loads(exc.body or "{}").get("message") or reason
    if exc.status in (400, 422):
        return GatewayHTTPError(400, "invalid_node", f"{what}: the Kubernetes API refused it: {reason}")
    return GatewayHTTPError(502, "kubernetes_api_error", f"{what}: Kubernetes API error {exc.status}: {reason}")


def _service_error(exc: client.ApiException, gateway: KubeGateway) -> GatewayHTTPError:
    ref = gateway.service
    what = f"reading the gateway's Service {ref.name} in {ref.namespace}" if ref else "reading the gateway's Service"
    if exc.status == 403 and ref is not None:
        return GatewayHTTPError(503, "kubernetes_api_error",
                                f"{what}: forbidden; the gateway's ServiceAccount needs 'get' on services/{ref.name} "
                                f"in {ref.namespace} (the chart's Role {ref.name}), or set burst.gateway.publicUrl")
    if exc.status == 404:
        return GatewayHTTPError(503, "kubernetes_api_error", f"{what}: it does not exist")
    return _kube_error(exc, what)


class BodySizeLimit:
    """413 for bodies over ``max_bytes``: by Content-Length up front, and while reading a chunked body."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        error: GatewayHTTPError | None = None
        if length is not None and not length.isdigit():
            error = GatewayHTTPError(400, "bad_request", "invalid Content-Length header")
        elif length is not None and int(length) > self.max_bytes:
            error = self._too_large(f"Content-Length {int(length)}")
        if error is not None:
            await error.response()(scope, receive, send)
            return
        received = 0
        refused = False

        async def limited_receive() -> Message:
            # Over the limit while reading (a chunked body has no Content-Length): answer 413 here, then tell
            # the application the client went away. Raising would reach FastAPI's body parser, which turns any
            # error into a 400.
            nonlocal received, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    refused = True
                    await self._too_large(f"more than {self.max_bytes} bytes").response()(scope, receive, send)
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: Message) -> None:
            if not refused:
                await send(message)

        await self.app(scope, limited_receive, guarded_send)

    def _too_large(self, got: str) -> GatewayHTTPError:
        return GatewayHTTPError(413, "body_too_large",
                                f"request body too large: {got}, the limit is {self.max_bytes} bytes")


# ----- request checks ------------------------------------------------------------------------------------------


def check_ticket_request(req: JoinTicketRequest) -> None:
    """Only tickets for burst nodes the optimizer can later remove, each tainted (R4.4)."""
    problems: list[str] = []
    if len(req.node_name) > 253 or not NODE_NAME.match(req.node_name):
        problems.append(f"node_name {req.node_name[:80]!r} is not a valid Node name")
    if not req.operation:
        problems.append("operation is empty")
    if req.labels.get(LABEL_OPERATION) != req.operation:
        problems.append(f"labels[{LABEL_OPERATION!r}] must be the operation {req.operation!r}")
    for key in req.labels:
        if key in RESERVED_LABELS or key.startswith(RESERVED_LABEL_PREFIXES):
            problems.append(f"label {key!r} is reserved")
    if not any(t.effect == "NoSchedule" for t in req.taints):
        problems.append("taints must hold the burst taint with effect NoSchedule")
    if not 0 < req.ttl_seconds <= MAX_TICKET_TTL_SECONDS:
        problems.append(f"ttl_seconds must be between 1 and {MAX_TICKET_TTL_SECONDS}")
    if problems:
        raise GatewayHTTPError(400, "invalid_ticket_request", "join ticket refused: " + "; ".join(problems))


# ----- the application -----------------------------------------------------------------------------------------


@dataclass
class HealthState:
    identity: str = "?"
    ready: Callable[[], bool] = field(default=lambda: True)


def add_health_routes(app: FastAPI, state: HealthState) -> None:
    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    def readyz() -> JSONResponse:
        ok = state.ready()
        return JSONResponse({"status": "ready" if ok else "not ready", "identity": state.identity},
                            status_code=200 if ok else 503)

    telemetry.add_metrics_route(app)


def _bare_app() -> FastAPI:
    app = FastAPI(title="kubeon burst gateway", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(GatewayHTTPError)
    async def gateway_error(_: Request, exc: GatewayHTTPError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        problems = []
        for err in exc.errors()[:5]:
            where = ".".join(str(p) for p in err.get("loc", ()))
            problems.append(f"{where}: {err.get('msg', 'invalid')}")
        return GatewayHTTPError(400, "bad_request", "; ".join(problems) or "invalid request").response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "error")
        return GatewayHTTPError(exc.status_code, code, str(exc.detail)).response()

    return app


def optimizer(request: Request) -> str:
    """The caller's username when it is an allowed optimizer; 401 without a valid token, 403 otherwise."""
    reviewer: TokenReviewer = request.app.state.reviewer
    allowed_clients: frozenset[str] = request.app.state.allowed_clients
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    token = token.strip()
    if not header:
        raise _unauthorized("no Authorization header: send the optimizer's ServiceAccount token as "
                            "'Authorization: Bearer <token>'")
    if scheme.lower() != "bearer" or not token:
        raise _unauthorized("Authorization header is not 'Bearer <token>'")
    try:
        who = reviewer.review(token)
    except client.ApiException as exc:
        log.warning("TokenReview failed: HTTP %s %s", exc.status, exc.reason)
        hint = ("; the gateway's ServiceAccount needs 'create' on authentication.k8s.io tokenreviews"
                if exc.status == 403 else "")
        raise GatewayHTTPError(503, "authentication_unavailable",
                               f"cannot verify the token: TokenReview answered {exc.status} {exc.reason}{hint}"
                               ) from None
    except (urllib3.exceptions.HTTPError, OSError) as exc:  # the API server is unreachable
        log.warning("TokenReview failed: %s", type(exc).__name__)
        raise GatewayHTTPError(503, "authentication_unavailable",
                               f"cannot verify the token: the Kubernetes API is unreachable "
                               f"({type(exc).__name__})") from None
    if not who.authenticated:
        raise _unauthorized(f"token not accepted by the Kubernetes API: {who.error or 'not authenticated'}")
    if who.username not in allowed_clients:
        log.warning("refused %s %s from %s: not an allowed optimizer", request.method, request.url.path,
                    who.username)
        raise GatewayHTTPError(403, "forbidden",
                               f"{who.username} may not use the burst gateway; allowed: "
                               f"{', '.join(sorted(allowed_clients))}")
    return who.username


Caller = Annotated[str, Depends(optimizer)]


def create_app(gateway: KubeGateway, reviewer: TokenReviewer, allowed_clients: frozenset[str], *,
               max_body_bytes: int = MAX_BODY_BYTES, health: HealthState | None = None,
               hub_claim_keys: Path | None = DEFAULT_CLAIM_KEYS_FILE) -> FastAPI:
    app = _bare_app()
    app.state.reviewer = reviewer
    app.state.allowed_clients = allowed_clients
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes)
    app.add_middleware(telemetry.GatewayRequestCounter)
    if health is not None:
        add_health_routes(app, health)


    @app.post("/v1/tickets")
    def issue_ticket(body: JoinTicketRequest, caller: Caller) -> dict[str, str]:
        check_ticket_request(body)
        try:
            grant = gateway.issue_ticket(body)
        except JoinRefused as exc:  # no free address slot (addresses_exhausted): no ticket, so no instance
            log.warning("refused a join ticket for node %s (operation %s): %s", body.node_name, body.operation, exc)
            raise GatewayHTTPError(exc.status, exc.code, str(exc)) from None
        except GatewayAddressPending as exc:
            raise GatewayHTTPError(503, "address_pending", str(exc), {"Retry-After": "10"}) from None
        except GatewayAddressUnknown as exc:
            raise GatewayHTTPError(503, "no_public_address", str(exc)) from None
        except client.ApiException as exc:
            raise _service_error(exc, gateway) from None
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise GatewayHTTPError(503, "kubernetes_api_unreachable",
                                   f"cannot issue the ticket (the gateway's Service, the address slots): the "
                                   f"Kubernetes API is unreachable ({type(exc).__name__})") from None
        log.info("issued a join ticket for node %s (operation %s, location %s) to %s; the node joins at %s as %s",
                 body.node_name, body.operation, body.location, caller, grant.endpoint or "the worker's URL",
                 grant.server_name or "its host")
        return {"ticket": grant.ticket, "endpoint": grant.endpoint, "serverName": grant.server_name}

    @app.get("/v1/capacity")
    def capacity(caller: Caller) -> dict[str, object]:
        try:
            room = gateway.capacity()
        except client.ApiException as exc:
            raise _kube_error(exc, "reading the address slots") from None
        return {"total": room.total, "held": room.held, "nodes": room.nodes}

    @app.delete("/v1/nodes/{name}")
    def remove_node(name: str, caller: Caller,
                    operation: Annotated[str, Query(min_length=1, max_length=253)]) -> dict[str, bool]:
        try:
            removed = gateway.remove_node(name, operation=operation)
        except TicketError as exc:
            raise GatewayHTTPError(409, "not_owned", str(exc)) from None
        except client.ApiException as exc:
            raise _kube_error(exc, f"removing node {name}") from None
        log.info("node %s of operation %s: %s (asked by %s)", name, operation,
                 "removed" if removed else "already gone", caller)
        return {"removed": removed}

    @app.post("/v1/join")
    def join(body: JoinRedeem, request: Request) -> dict[str, object]:
        try:
            # On-prem servers also present the claim the hub signed for them (R4.5); cloud nodes: the ticket alone.
            check_pool_claim(gateway.verify(body.ticket), body.ticket, request.headers.get(POOL_CLAIM_HEADER),
                             hub_claim_keys)
            answer = gateway.join(body)
        except JoinTokenRefused as exc:
            log.warning("refused a join: %s", exc)
            raise GatewayHTTPError(403, "join_token_refused", str(exc)) from None
        except TicketError as exc:
            log.warning("refused a join: %s", exc)
            status = 409 if exc.code == "node_exists" else 403
            raise GatewayHTTPError(status, exc.code, str(exc)) from None
        except JoinRefused as exc:
            log.warning("refused a join: %s", exc)
            raise GatewayHTTPError(exc.status, exc.code, str(exc)) from None
        except client.ApiException as exc:
            raise _kube_error(exc, "joining the node") from None
        log.info("node %s joined: pod CIDR %s%s; it registers itself now", answer.node_name, answer.pod_cidr,
                 f", tunnel {answer.tunnel.address}" if answer.tunnel else "")
        return answer.model_dump(mode="json", by_alias=True)

    return app


class _QuietProbes(logging.Filter):
    """Drop access-log lines of kubelet probes (every few seconds): uvicorn's access logger is process-wide."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        return not (len(args) >= 3 and args[2] in ("/healthz", "/readyz", "/metrics"))


def create_health_app(state: HealthState) -> FastAPI:
    app = _bare_app()
    add_health_routes(app, state)
    return app


# ----- the tunnel ----------------------------------------------------------------------------------------------


def build_tunnel(cfg: GatewayServerConfig) -> GatewayTunnel | None:
    if not cfg.tunnel_interface:
        return None
    assert cfg.wireguard_key_file is not None
    try:
        private = keys.check_key(cfg.wireguard_key_file.read_text().strip(), str(cfg.wireguard_key_file))
    except ValueError as exc:
        raise ConfigError(f"KUBEON_GATEWAY_WIREGUARD_KEY_FILE: {exc}") from None
    return GatewayTunnel(interface=cfg.tunnel_interface, private_key=private, endpoint=cfg.tunnel_endpoint,
                         listen_port=cfg.udp_port, plan=cfg.plan, mtu=cfg.mtu)


@dataclass
class TunnelLinks:
    """What the gateway process runs for its tunnel: wireguard-go and the API server proxy."""

    wireguard: object
    proxy: TcpProxy

    def stop(self) -> None:
        self.proxy.stop()
        if hasattr(self.wireguard, "poll"):
            link.stop_wireguard_go(self.wireguard)  # type: ignore[arg-type]


def api_upstream(cfg: GatewayServerConfig, api: client.ApiClient) -> tuple[str, int]:
    from urllib.parse import urlsplit

    target = cfg.api_upstream or urlsplit(str(api.configuration.host)).netloc
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"KUBEON_GATEWAY_API_UPSTREAM {target!r}: expected HOST:PORT")
    return host.strip("[]"), int(port)


def start_tunnel(cfg: GatewayServerConfig, gateway: KubeGateway, api: client.ApiClient) -> TunnelLinks:
    """wireguard-go on the interface (kept if it already runs), its key and port, the gateway's tunnel address
    and routes for the burst pod CIDR, nftables (MSS clamp, service CIDR masquerade), the peers from the API, and
    the API server proxy on <gateway tunnel IP>:443."""
    tunnel = gateway.tunnel
    assert tunnel is not None
    wireguard: object = None
    if not tunnel.uapi.path.exists():
        wireguard = link.start_wireguard_go(tunnel.interface)
    tunnel.configure()
    prefix = cfg.plan.tunnel_cidr.split("/")[1]
    link.bring_up(tunnel.interface, f"{cfg.plan.gateway_ip}/{prefix}", mtu=cfg.mtu, routes=[cfg.plan.pod_cidr])
    link.apply_gateway_rules(tunnel.interface, service_cidr=cfg.plan.service_cidr, tunnel_cidr=cfg.plan.tunnel_cidr,
                             pod_cidr=cfg.plan.pod_cidr)
    try:
        gateway.reconcile()  # the peers back from the API before the first node's packets
    except (client.ApiException, urllib3.exceptions.HTTPError, OSError) as exc:
        log.warning("cannot restore the tunnel's peers yet (%s); the reconciler retries every second",
                    type(exc).__name__)
    proxy = TcpProxy((cfg.plan.gateway_ip, tunnel.api_proxy_port), api_upstream(cfg, api)).start()
    log.info("tunnel %s up: %s, UDP %d, %d peer(s) restored from the API; API server proxy %s:%d -> %s:%d",
             tunnel.interface, cfg.plan.gateway_ip, cfg.udp_port, len(tunnel.uapi.get().peers), *proxy.address,
             *proxy.upstream)
    return TunnelLinks(wireguard=wireguard, proxy=proxy)


# ----- serving -------------------------------------------------------------------------------------------------


def serve(settings: Settings) -> int:
    """Run the gateway until SIGTERM/SIGINT. Returns the exit code (2: configuration error)."""
    try:
        cfg = GatewayServerConfig.from_settings(settings)
        key = cfg.ticket_key_file.read_bytes().strip()
        if len(key) < 16:
            raise ConfigError(f"{cfg.ticket_key_file}: the join ticket key must be at least 16 bytes")
        check_tls_files(cfg)
        try:
            api = kube_api(cfg.kubeconfig)
        except config.ConfigException as exc:
            raise ConfigError(f"no Kubernetes credentials: KUBEON_GATEWAY_KUBECONFIG is not set and this is not a "
                              f"pod with a ServiceAccount ({exc})") from None
        tunnel = build_tunnel(cfg)
        gateway = KubeGateway(api, key, public_url=cfg.public_url, service=cfg.service, namespace=cfg.namespace,
                              plan=cfg.plan, tunnel=tunnel)
    except (ConfigError, OSError, ValueError) as exc:
        print(f"kubeon-gpu gateway: {exc}", file=sys.stderr)
        return 2
    try:
        links = start_tunnel(cfg, gateway, api) if tunnel is not None else None
    except (link.LinkError, OSError) as exc:
        print(f"kubeon-gpu gateway: the tunnel cannot start: {exc}", file=sys.stderr)
        return 1
    gateway.start_reconciler()
    reviewer = TokenReviewer(api, cfg.token_audiences)
    state = HealthState()
    try:
        state.identity = reviewer.whoami()
    except (client.ApiException, urllib3.exceptions.HTTPError, OSError) as exc:  # not fatal: the API server
        # may come up after the gateway
        log.warning("cannot tell the gateway's own identity (SelfSubjectReview): %s", type(exc).__name__)
    same_port = cfg.health_port in (0, cfg.port)
    app = create_app(gateway, reviewer, cfg.allowed_clients, max_body_bytes=cfg.max_body_bytes,
                     health=state if same_port else None, hub_claim_keys=settings.hub_claim_keys_file)
    if not cfg.tls and cfg.host not in ("127.0.0.1", "::1", "localhost"):
        log.warning("serving plain HTTP on %s: set KUBEON_GATEWAY_TLS_CERT_FILE and KUBEON_GATEWAY_TLS_KEY_FILE",
                    cfg.host)
    health_server: uvicorn.Server | None = None
    if not same_port:
        # Configured before the main server: uvicorn's logging set-up is process-wide, and the main server's
        # (access log on, level info) must be the one that stays.
        health_server = uvicorn.Server(uvicorn.Config(
            create_health_app(state), host=cfg.host, port=cfg.health_port, log_level="warning",
            access_log=False, server_header=False))
    main_server = uvicorn.Server(uvicorn.Config(
        app, host=cfg.host, port=cfg.port, log_level="info", server_header=False, proxy_headers=False,
        ssl_certfile=str(cfg.tls_cert_file) if cfg.tls_cert_file else None,
        ssl_keyfile=str(cfg.tls_key_file) if cfg.tls_key_file else None,
        limit_concurrency=128, timeout_keep_alive=5, timeout_graceful_shutdown=10,
    ))
    state.ready = lambda: bool(main_server.started) and not main_server.should_exit
    logging.getLogger("uvicorn.access").addFilter(_QuietProbes())
    if health_server is not None:
        # Its own thread and loop: uvicorn only handles signals in the main thread, where the main server runs.
        threading.Thread(target=health_server.run, name="health", daemon=True).start()
    scheme = "https" if cfg.tls else "http"
    if cfg.public_url:
        where = f"burst nodes join at {cfg.public_url}"
    elif cfg.service is not None:
        where = (f"burst nodes join at the LoadBalancer address of Service {cfg.service.namespace}/"
                 f"{cfg.service.name}, verified as {cfg.service.dns_name}")
    else:
        where = "burst nodes join at the worker's configured URL"
    log.info("burst gateway on %s://%s:%d (health on port %d), acting as %s; optimizer clients: %s%s; %s", scheme,
             cfg.host, cfg.port, cfg.port if same_port else cfg.health_port, state.identity,
             ", ".join(sorted(cfg.allowed_clients)),
             f"; token audiences: {', '.join(cfg.token_audiences)}" if cfg.token_audiences else "", where)
    # uvicorn re-raises the signal it stopped on once it has shut down; with the default SIGTERM handler that
    # would end the process before the tunnel (wireguard-go, the proxy) is stopped below.
    signal.signal(signal.SIGTERM, lambda *_: setattr(main_server, "should_exit", True))
    try:
        main_server.run()
    finally:
        if health_server is not None:
            health_server.should_exit = True
        gateway.stop()
        if links is not None:
            links.stop()
    return 0


def main() -> None:
    try:
        telemetry.configure_logging()
    except ConfigError as exc:
        print(f"kubeon-gpu gateway: {exc}", file=sys.stderr)
        sys.exit(2)
    environ = dict(os.environ)
    if not environ.get("KUBEON_CLUSTER"):
        environ["KUBEON_CLUSTER"] = "unset"  # the gateway does not use it; the chart sets it anyway
    try:
        settings = load_settings(environ)
    except ConfigError as exc:
        print(f"kubeon-gpu gateway: {exc}", file=sys.stderr)
        sys.exit(2)
    sys.exit(serve(settings))


if __name__ == "__main__":
    main()


__all__ = ["GatewayServerConfig", "TokenReviewer", "create_app", "main", "serve"]

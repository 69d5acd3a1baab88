"""The burst gateway's HTTP API and its authentication of the optimizer (R4.2, R5.x); `kubeon-gpu gateway` runs it
(``gateway.main``).

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
- ``GET /v1/nodes/{name}/transfer?operation=op-...`` (the optimizer): the bytes the node moved through its tunnel
  (``models.join.NodeTransfer``: ``rxBytes`` node -> home, the remote cloud's egress; ``txBytes`` home -> node),
  kept across gateway restarts in its slot record (``gateway.transfer``); 409 for a node of another operation, 404
  for one the gateway holds no slot for.
- ``GET /v1/nodes/{name}/identity?operation=op-...`` (the optimizer): the signed instance identity the node joined
  with, as the gateway verified it (``models.join.NodeIdentity``); the optimizer checks it is the instance it
  launched. 409 for a node of another operation, 404 for one not joined or unknown.
- ``POST /v1/join`` (a booting burst node; the ticket is its only credential): redeem the ticket with the node's
  WireGuard public key and kubelet CSR (``models.join.JoinRedeem``); the answer (``JoinAnswer``) carries the
  signed kubelet certificate, the tunnel's parameters, the pod CIDR and the API server address. The gateway creates
  no Node; the node registers itself, then the gateway's reconciler applies its ticket's labels and taints.
- ``POST /v1/renew`` (a joined burst node, before its certificate expires; ``kubeon-gpu node renew``): a new
  kubelet certificate for a CSR of the kubelet key the node joined with, while it holds its address slot (never
  for a removed or refused node). Burst nodes cannot renew through the API server (the node admission policy
  refuses their CSRs), so a removed node's certificate ends with its lifetime (``KUBEON_GATEWAY_CERT_SECONDS``).

With ``KUBEON_GATEWAY_TUNNEL_INTERFACE`` the gateway runs ``wireguard-go`` on that interface (UDP
``KUBEON_GATEWAY_UDP_PORT``), gives it the first address of ``KUBEON_GATEWAY_TUNNEL_CIDR``, clamps the TCP MSS,
filters what the tunnel reaches and masquerades tunnel traffic to the service CIDR (nftables:
``gateway.tunnel_end.TunnelFilter``), and proxies ``<gateway tunnel IP>:443`` to the API server. Peers and address
slots live in ConfigMaps in its namespace and are restored from there on start.

The optimizer authenticates with its ServiceAccount token (``Authorization: Bearer``; the chart projects one of
audience ``kubeon-gateway``, ``KUBEON_GATEWAY_TOKEN_AUDIENCES``), checked with the TokenReview API; only the
usernames in ``KUBEON_GATEWAY_ALLOWED_CLIENTS`` may ask for tickets, capacity or removals. Failed authentications
are throttled per source address, and requests must arrive within a deadline (``gateway.limits``).
``/healthz`` and ``/readyz`` are served on ``KUBEON_HEALTH_PORT`` (the chart probes port 8080), or on the main
listener when both ports are the same. Every error is JSON: ``{"error": "<code>", "message": "<reason>"}``.
Tokens and tickets are never logged.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
from collections.abc import Callable
from collections.abc import Iterator
from collections.abc import Mapping
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path
from typing import Annotated
from typing import Final

import urllib3
from fastapi import Depends
from fastapi import FastAPI
from fastapi import Query
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from kubernetes import client
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from common.asgi import BodySizeLimit
from gateway import metrics
from gateway.limits import FailureLimiter
from gateway.limits import RefusedTokens
from gateway.pool_tokens import DEFAULT_CLAIM_KEYS_FILE
from gateway.pool_tokens import POOL_CLAIM_HEADER
from gateway.pool_tokens import JoinTokenRefused
from gateway.pool_tokens import check_pool_claim
from gateway.service import GatewayAddressPending
from gateway.service import GatewayAddressUnknown
from gateway.service import KubeGateway
from gateway.settings import MAX_BODY_BYTES
from models.errors import JoinRefused
from models.errors import TicketError
from models.join import CertRenewal
from models.join import JoinRedeem
from models.join import JoinTicketRequest
from models.labels import LABEL_OPERATION
from tunnel.uapi import UapiError

log = logging.getLogger("kubeon.gateway")

MAX_TICKET_TTL_SECONDS: Final = 24 * 3600
# Labels no ticket may set: the gateway sets the hostname and OS; node roles are the cluster admin's.
RESERVED_LABELS: Final = frozenset({"kubernetes.io/hostname", "kubernetes.io/os"})
RESERVED_LABEL_PREFIXES: Final = ("node-role.kubernetes.io/", "node-restriction.kubernetes.io/")
NODE_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


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
        # A token refused once is refused again for a minute without asking the API server (issue 21, 9).
        self._refused = RefusedTokens()

    def review(self, token: str) -> Identity:
        cached = self._refused.get(token)
        if isinstance(cached, Identity):
            return cached
        review = self._auth.create_token_review(client.V1TokenReview(
            spec=client.V1TokenReviewSpec(token=token, audiences=self._audiences)))
        status = review.status
        if status is None or not status.authenticated:
            refused = Identity(False, error=(status.error if status is not None else "") or "")
            self._refused.add(token, refused)
            return refused
        if self._audiences and not set(self._audiences) <= set(status.audiences or []):
            # The API server answers with the audiences the token is good for: one it was not minted for (e.g.
            # the API server's own, so a gateway holding it could act as the optimizer) is refused.
            refused = Identity(False, error=f"the token's audiences {status.audiences or []} are not "
                                            f"{self._audiences}")
            self._refused.add(token, refused)
            return refused
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


@contextlib.contextmanager
def _node_errors(what: str) -> Iterator[None]:
    """The answers of the optimizer's calls about one node: another operation's node 409 ``not_owned``, the
    gateway's refusals as they are, a Kubernetes API error named, the tunnel's UAPI down 503."""
    try:
        yield
    except TicketError as exc:
        raise GatewayHTTPError(409, "not_owned", str(exc)) from None
    except JoinRefused as exc:
        raise GatewayHTTPError(exc.status, exc.code, str(exc)) from None
    except client.ApiException as exc:
        raise _kube_error(exc, what) from None
    except UapiError as exc:
        raise GatewayHTTPError(503, "tunnel_unavailable", str(exc)) from None


def _node_report(read: Callable[..., BaseModel], name: str, operation: str, what: str) -> dict[str, object]:
    """What the gateway holds of one node of ``operation`` (its transfer, its identity), as the optimizer reads it."""
    with _node_errors(f"reading {what} of node {name}"):
        return read(name, operation=operation).model_dump(mode="json", by_alias=True)


def _refusal(status: int, code: str, message: str) -> JSONResponse:
    return GatewayHTTPError(status, code, message).response()


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

    metrics.add_metrics_route(app)


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
    limiter: FailureLimiter = request.app.state.auth_failures
    source = request.client.host if request.client else ""
    wait = limiter.retry_after(source)
    if wait:
        raise GatewayHTTPError(429, "too_many_failures",
                               f"more than {limiter.limit} failed authentications from {source} in "
                               f"{limiter.window:.0f}s; retry later", {"Retry-After": str(int(wait))})
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
        limiter.failed(source)
        raise _unauthorized(f"token not accepted by the Kubernetes API: {who.error or 'not authenticated'}")
    if who.username not in allowed_clients:
        limiter.failed(source)
        log.warning("refused %s %s from %s: not an allowed optimizer", request.method, request.url.path,
                    who.username)
        raise GatewayHTTPError(403, "forbidden",
                               f"{who.username} may not use the burst gateway; allowed: "
                               f"{', '.join(sorted(allowed_clients))}")
    return who.username


Caller = Annotated[str, Depends(optimizer)]
# The operation a call about one node names (``?operation=op-...``): the gateway acts only on that operation's node.
NodeOperation = Annotated[str, Query(min_length=1, max_length=253)]


def create_app(gateway: KubeGateway, reviewer: TokenReviewer, allowed_clients: frozenset[str], *,
               max_body_bytes: int = MAX_BODY_BYTES, health: HealthState | None = None,
               hub_claim_keys: Path | None = DEFAULT_CLAIM_KEYS_FILE, auth_failures_per_minute: int = 10) -> FastAPI:
    app = _bare_app()
    app.state.reviewer = reviewer
    app.state.auth_failures = FailureLimiter(auth_failures_per_minute, window=60.0)
    app.state.allowed_clients = allowed_clients
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes, refusal=_refusal)
    app.add_middleware(metrics.GatewayRequestCounter)
    if health is not None:
        add_health_routes(app, health)


    @app.post("/v1/tickets")
    def issue_ticket(body: JoinTicketRequest, caller: Caller) -> dict[str, object]:
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
        return {"ticket": grant.ticket, "endpoint": grant.endpoint, "serverName": grant.server_name,
                "attestation": grant.attestation}

    @app.get("/v1/capacity")
    def capacity(caller: Caller) -> dict[str, object]:
        try:
            room = gateway.capacity()
        except client.ApiException as exc:
            raise _kube_error(exc, "reading the address slots") from None
        return {"total": room.total, "held": room.held, "nodes": room.nodes}

    @app.delete("/v1/nodes/{name}")
    def remove_node(name: str, caller: Caller, operation: NodeOperation) -> dict[str, bool]:
        with _node_errors(f"removing node {name}"):
            removed = gateway.remove_node(name, operation=operation)
        log.info("node %s of operation %s: %s (asked by %s)", name, operation,
                 "removed" if removed else "already gone", caller)
        return {"removed": removed}

    @app.get("/v1/nodes/{name}/transfer")
    def node_transfer(name: str, caller: Caller, operation: NodeOperation) -> dict[str, object]:
        return _node_report(gateway.transfer, name, operation, "the transfer")

    @app.get("/v1/nodes/{name}/identity")
    def node_identity(name: str, caller: Caller, operation: NodeOperation) -> dict[str, object]:
        return _node_report(gateway.identity, name, operation, "the attested identity")

    @app.post("/v1/nodes/{name}/probe")
    def probe_node(name: str, caller: Caller, operation: NodeOperation) -> dict[str, object]:
        with _node_errors(f"probing the tunnel of node {name}"):
            probed = gateway.probe(name, operation=operation)
        log.info("tunnel probe of node %s (operation %s, asked by %s): %s", name, operation, caller, probed.detail)
        return probed.model_dump(mode="json", by_alias=True)

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

    @app.post("/v1/renew")
    def renew(body: CertRenewal, request: Request) -> dict[str, object]:
        # No bearer token: the proof is the CSR, signed by the kubelet key the node joined with. Refusals count
        # against the source like failed authentications, so no one probes node names and keys at speed.
        limiter: FailureLimiter = request.app.state.auth_failures
        source = request.client.host if request.client else ""
        wait = limiter.retry_after(source)
        if wait:
            raise GatewayHTTPError(429, "too_many_failures", f"more than {limiter.limit} refused requests from "
                                   f"{source} in {limiter.window:.0f}s; retry later", {"Retry-After": str(int(wait))})
        try:
            answer = gateway.renew(body)
        except JoinRefused as exc:
            if exc.status == 403:
                limiter.failed(source)
            log.warning("refused a certificate renewal for %s: %s", body.node_name, exc)
            raise GatewayHTTPError(exc.status, exc.code, str(exc)) from None
        except client.ApiException as exc:
            raise _kube_error(exc, f"renewing the certificate of {body.node_name}") from None
        log.info("renewed the kubelet certificate of node %s", body.node_name)
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


__all__ = ["GatewayHTTPError", "HealthState", "TokenReviewer", "create_app", "create_health_app"]

"""Who is calling: the bootstrap admin key, a person's or automation's API key, or a cluster token.

Header: ``Authorization: Bearer <key or token>``. Missing, malformed, unknown, revoked or expired credentials are
401 (with ``WWW-Authenticate``); valid credentials used where they are not allowed are 403.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Annotated

from fastapi import Depends
from fastapi import Request
from fastapi import Security
from fastapi.security import HTTPAuthorizationCredentials
from fastapi.security import HTTPBearer
from sqlalchemy.orm import Session

from hub import ops
from hub import optimizer_clients
from hub import tokens
from hub.audit import BOOTSTRAP_ACTOR
from hub.audit import Actor
from hub.audit import ActorKind
from hub.audit import Role
from hub.db import Database
from hub.errors import Forbidden
from hub.errors import Unauthorized
from hub.settings import Clock
from hub.settings import HubSettings
from hub.tokens import TokenKind


@dataclass(frozen=True)
class HubState:
    settings: HubSettings
    clock: Clock
    db: Database


def hub_state(request: Request) -> HubState:
    state: HubState = request.app.state.hub
    return state


def db_session(state: Annotated[HubState, Depends(hub_state)]) -> Iterator[Session]:
    """One session (one transaction) per request. Handlers commit on success; anything raised rolls back, so a
    refused request changes nothing (not even last-seen times)."""
    with state.db.session() as session:
        yield session


def request_time(state: Annotated[HubState, Depends(hub_state)]) -> datetime:
    """The injected clock, read once per request."""
    now = state.clock()
    if now.tzinfo is None:
        raise RuntimeError("the hub clock must return timezone-aware datetimes")
    return now


SessionDep = Annotated[Session, Depends(db_session)]
NowDep = Annotated[datetime, Depends(request_time)]

api_key_scheme = HTTPBearer(
    scheme_name="ApiKey",
    description="A person's or automation's API key (`kgk_...`) or the bootstrap admin key.",
    auto_error=False,
)
cluster_token_scheme = HTTPBearer(
    scheme_name="ClusterToken",
    description="The cluster's token (`kgc_...`), from the Secret `kubeon-gpu-optimizer-token` (key `token`).",
    auto_error=False,
)


def _digest(value: str) -> bytes:
    return hashlib.sha256(value.encode()).digest()


def authenticate(request: Request, session: Session, now: datetime, settings: HubSettings) -> Actor:
    header = request.headers.get("authorization")
    if header is None or not header.strip():
        raise Unauthorized("Authorization header missing: send 'Authorization: Bearer <token>'", code="missing_token")
    scheme, _, value = header.strip().partition(" ")
    value = value.strip()
    if scheme.lower() == "bearer" and not value:
        raise Unauthorized("malformed Authorization header: the Bearer token is empty", code="malformed_authorization")
    if scheme.lower() != "bearer" or " " in value:
        raise Unauthorized(
            f"malformed Authorization header: expected 'Bearer <token>', got scheme {scheme[:20]!r}",
            code="malformed_authorization",
        )
    return authenticate_credential(value, session, now, settings)


def authenticate_credential(value: str, session: Session, now: datetime, settings: HubSettings) -> Actor:
    """Who ``value`` (an API key, the bootstrap admin key or a cluster token) is; raises ``Unauthorized``. The
    API reads it from the Authorization header, the web UI's sign-in from its form."""
    bootstrap = settings.bootstrap_admin_key
    if bootstrap is not None and hmac.compare_digest(_digest(value), _digest(bootstrap)):
        return BOOTSTRAP_ACTOR
    parsed = tokens.parse(value)
    if parsed is None:
        raise Unauthorized("invalid token: not a hub cluster token (kgc_...) or API key (kgk_...)")
    if parsed.kind is TokenKind.CLUSTER:
        return ops.authenticate_cluster(session, now, parsed)
    return ops.authenticate_api_key(session, now, parsed)


def caller(
    request: Request, state: Annotated[HubState, Depends(hub_state)], session: SessionDep, now: NowDep
) -> Actor:
    """Dependency: whoever the Authorization header names (401 if nobody), before any rule on who may call."""
    return authenticate(request, session, now, state.settings)


CallerDep = Annotated[Actor, Depends(caller)]


def require_role(role: Role) -> Callable[..., Actor]:
    """Dependency: an API key (or the bootstrap admin key) whose role includes ``role``."""

    def dependency(
        request: Request,
        actor: CallerDep,
        _: Annotated[HTTPAuthorizationCredentials | None, Security(api_key_scheme)],
    ) -> Actor:
        if actor.kind is ActorKind.CLUSTER:
            raise Forbidden(
                f"cluster tokens may only call /v1/cluster/... (their own cluster's policies, approvals and "
                f"reports); {request.method} {request.url.path} needs an API key",
                code="cluster_token_not_allowed",
            )
        assert actor.role is not None
        if not actor.role.allows(role):
            raise Forbidden(
                f"{actor.label} has role {actor.role.value}; {request.method} {request.url.path} needs "
                f"{role.value}", code="insufficient_role",
            )
        return actor

    return dependency


def require_cluster(
    request: Request,
    session: SessionDep,
    now: NowDep,
    actor: CallerDep,
    _: Annotated[HTTPAuthorizationCredentials | None, Security(cluster_token_scheme)],
) -> Actor:
    """Dependency: a valid cluster token. Records the cluster's last-seen time and its optimizer's User-Agent
    (committed with the request: ``session`` is the one the token was checked in, FastAPI caches it per
    request)."""
    if actor.kind is not ActorKind.CLUSTER:
        raise Forbidden(
            f"{request.method} {request.url.path} is for clusters: authenticate with the cluster's token (kgc_...), "
            f"not the API key of {actor.label}", code="cluster_token_required",
        )
    assert actor.cluster_id is not None
    optimizer_clients.note(session, actor.cluster_id, request.headers.get("user-agent"), now)
    return actor


ViewerDep = Annotated[Actor, Depends(require_role(Role.VIEWER))]
OperatorDep = Annotated[Actor, Depends(require_role(Role.OPERATOR))]
AdminDep = Annotated[Actor, Depends(require_role(Role.ADMIN))]
ClusterDep = Annotated[Actor, Depends(require_cluster)]

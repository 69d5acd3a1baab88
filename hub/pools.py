"""On-prem burst pools: idle GPU servers registered under a pool's rate card, claimed by bursts, returned when
released.

Three kinds of callers:

* people and automation (API keys): ``/v1/pools/...`` create pools (admin), set rate cards (operator), register
  and retire servers (operator), issue and revoke join tokens (admin); every change is in the audit log.
* a server's agent. An operator registers the server (its name, GPU product and count: the inventory); its agent
  then enrols once with the pool's enrolment token (``kgp_...``, ``POST /v1/pool-agent/enrol``) and gets the
  server's own credential (``kgs_...``), or an operator issues that credential directly. The enrolment token does
  nothing else, and never leaves the operator and the servers. With its credential (which names the server: the
  request cannot) the agent heartbeats (``POST /v1/pool-agent/heartbeat``): online, and what it should be part of
  (a claim, or nothing: be idle). Only once it has taken a claim up (``joining``) does it get the node's user data
  and the claim the hub signs for it (``models.pool_claim``), which the claiming cluster's gateway checks.
* an optimizer (its cluster token): ``/v1/cluster/pools/{pool}/...`` offerings, claims, release. A cluster may
  use a pool only for a location one of its policies in the hub names (``onprem/<pool>``), and only through that
  policy, and for at most its ``limits.maxNodes`` servers at a time.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from collections.abc import Callable
from collections.abc import Iterable
from datetime import datetime
from datetime import timedelta
from typing import Annotated
from typing import Any
from typing import Final
from typing import TypeVar

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from fastapi import APIRouter
from fastapi import Depends
from fastapi import Path
from fastapi import Request
from fastapi import Response
from sqlalchemy import exists
from sqlalchemy import func
from sqlalchemy import select
from sqlalchemy import update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from hub.audit import Actor
from hub.audit import ActorKind
from hub.auth import AdminDep
from hub.auth import ClusterDep
from hub.auth import NowDep
from hub.auth import OperatorDep
from hub.auth import SessionDep
from hub.auth import ViewerDep
from hub.db import AuditEvent
from hub.db import Cluster
from hub.db import Policy
from hub.errors import Conflict
from hub.errors import Forbidden
from hub.errors import NotFound
from hub.errors import Unauthorized
from hub.errors import Unprocessable
from hub.http import ERROR_RESPONSES
from hub.http import body_doc
from hub.http import json_body
from hub.pool_db import HubSigningKey
from hub.pool_db import Pool
from hub.pool_db import PoolJoinToken
from hub.pool_db import PoolServer
from hub.pool_db import PoolServerCredential
from hub.pool_schemas import AgentClaim
from hub.pool_schemas import Claim
from hub.pool_schemas import ClaimCreate
from hub.pool_schemas import ClaimKey
from hub.pool_schemas import ClaimKeys
from hub.pool_schemas import ClaimRelease
from hub.pool_schemas import ClaimResult
from hub.pool_schemas import Enrolment
from hub.pool_schemas import Heartbeat
from hub.pool_schemas import HeartbeatAnswer
from hub.pool_schemas import JoinTokenIssued
from hub.pool_schemas import JoinTokenOut
from hub.pool_schemas import PoolCreate
from hub.pool_schemas import PoolCreated
from hub.pool_schemas import PoolOffering
from hub.pool_schemas import PoolOfferings
from hub.pool_schemas import PoolOut
from hub.pool_schemas import RateCard
from hub.pool_schemas import ReleaseResult
from hub.pool_schemas import ServerCredentialIssued
from hub.pool_schemas import ServerOut
from hub.pool_schemas import ServerRegister
from hub.pool_schemas import ShownState
from hub.schemas import NAME_PATTERN
from models import pool_claim
from models.join import parse_user_data

LOCATION_PROVIDER: Final = "onprem"
_JOIN_TOKEN_RE: Final = re.compile(r"^kgp_([0-9a-f]{16})_([A-Za-z0-9_-]{43})$")
_SERVER_CREDENTIAL_RE: Final = re.compile(r"^kgs_([0-9a-f]{16})_([A-Za-z0-9_-]{43})$")

PoolName = Annotated[str, Path(max_length=63, pattern=NAME_PATTERN, description="pool name")]
ServerName = Annotated[str, Path(max_length=63, pattern=NAME_PATTERN, description="server name")]
TokenId = Annotated[str, Path(pattern=r"^[0-9a-f]{16}$")]

pools_admin = APIRouter(prefix="/v1/pools", tags=["pools"], responses=ERROR_RESPONSES)
pools_agent = APIRouter(prefix="/v1/pool-agent", tags=["pools (server agent)"], responses=ERROR_RESPONSES)
pools_cluster = APIRouter(prefix="/v1/cluster/pools", tags=["pools (optimizer)"], responses=ERROR_RESPONSES)
pool_claim_keys = APIRouter(prefix="/v1/pool-claims", tags=["pools (gateway)"], responses=ERROR_RESPONSES)


def location(pool: str) -> str:
    return f"{LOCATION_PROVIDER}/{pool}"


# ----- audit -----


def _audit(session: Session, now: datetime, actor: Actor | str, action: str, *, target: str,
           cluster: str | None = None, detail: dict[str, Any] | None = None, key_id: str | None = None) -> None:
    label = actor if isinstance(actor, str) else actor.label
    session.add(AuditEvent(at=now, actor=label, actor_key_id=key_id if isinstance(actor, str) else actor.key_id,
                           action=action, cluster=cluster, target=target, detail=detail or {}))


# ----- join tokens -----


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def issue_join_token(session: Session, now: datetime, actor: Actor, pool: Pool, existing: str | None = None
                     ) -> JoinTokenIssued:
    """A new join token, or ``existing`` (one generated elsewhere: the dev seed's token file) adopted."""
    if existing is not None:
        match = _JOIN_TOKEN_RE.match(existing)
        if match is None:
            raise ValueError("not a pool join token: expected kgp_<16 hex digits>_<43 URL-safe characters>")
        token_id, token = match.group(1), existing
    else:
        token_id = secrets.token_hex(8)
        token = f"kgp_{token_id}_{secrets.token_urlsafe(32)}"
    session.add(PoolJoinToken(token_id=token_id, pool_id=pool.id, digest=_digest(token), created_at=now,
                              created_by=actor.label))
    session.flush()
    _audit(session, now, actor, "pool.join_token_created", target=pool.name, detail={"token_id": token_id})
    return JoinTokenIssued(pool=pool.name, token_id=token_id, token=token)


def _bearer(request: Request, what: str) -> str:
    header = request.headers.get("authorization") or ""
    scheme, _, value = header.strip().partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        raise Unauthorized(f"Authorization header missing or malformed: send 'Bearer <{what}>'", code="missing_token")
    return value.strip()


def authenticate_agent(session: Session, now: datetime, request: Request) -> PoolJoinToken:
    """The pool's enrolment token (``POST /v1/pool-agent/enrol`` only)."""
    value = _bearer(request, "pool enrolment token")
    return _stored_secret(
        session, now, value, PoolJoinToken, _JOIN_TOKEN_RE, "join token", "a pool enrolment token (kgp_...)",
        lambda token: f"join token {token.token_id} of pool {token.pool.name!r} was revoked at "
                      f"{_revoked(token)}")


def authenticate_server(session: Session, now: datetime, request: Request) -> PoolServerCredential:
    """A server's own credential: the server is the credential's, whatever the request says."""
    value = _bearer(request, "server credential")
    if _JOIN_TOKEN_RE.match(value):
        raise Forbidden("the pool's enrolment token only enrols a server (POST /v1/pool-agent/enrol); heartbeat "
                        "with the server's own credential (kgs_...)", code="enrolment_token_only")
    return _stored_secret(
        session, now, value, PoolServerCredential, _SERVER_CREDENTIAL_RE, "server credential",
        "a pool server credential (kgs_...)",
        lambda cred: f"the credential {cred.token_id} of server {cred.server.name!r} was revoked at "
                     f"{_revoked(cred)}; enrol the server again")


_Secret = TypeVar("_Secret", PoolJoinToken, PoolServerCredential)


def _stored_secret(session: Session, now: datetime, value: str, model: type[_Secret], pattern: re.Pattern[str],
                   kind: str, shape: str, revoked: Callable[[_Secret], str]) -> _Secret:
    """The stored secret ``value`` names (``<prefix>_<token id>_<secret>``), its digest compared in constant
    time; 401 naming why for a malformed, unknown, wrong or revoked one. Records its use."""
    match = pattern.match(value)
    if match is None:
        raise Unauthorized(f"invalid {kind}: not {shape}")
    secret = session.scalar(select(model).where(model.token_id == match.group(1)))
    if secret is None or not hmac.compare_digest(_digest(value).encode(), secret.digest.encode()):
        raise Unauthorized(f"invalid {kind}: unknown or wrong secret")
    if secret.revoked_at is not None:
        raise Unauthorized(revoked(secret), code="token_revoked")
    secret.last_used_at = now
    return secret


def _revoked(secret: PoolJoinToken | PoolServerCredential) -> str:
    assert secret.revoked_at is not None
    return f"{secret.revoked_at.isoformat()} by {secret.revoked_by}"


def _active_credential(session: Session, server: PoolServer) -> PoolServerCredential | None:
    return session.scalar(select(PoolServerCredential).where(PoolServerCredential.server_id == server.id,
                                                             PoolServerCredential.revoked_at.is_(None)))


def _revoke_credential(session: Session, now: datetime, actor: str, key_id: str | None, server: PoolServer
                       ) -> str | None:
    cred = _active_credential(session, server)
    if cred is None:
        return None
    cred.revoked_at, cred.revoked_by = now, actor
    _audit(session, now, actor, "pool.server_credential_revoked", target=f"{server.pool.name}/{server.name}",
           key_id=key_id, detail={"credential_id": cred.token_id})
    return cred.token_id


def issue_server_credential(session: Session, now: datetime, actor: str, key_id: str | None, server: PoolServer,
                            *, via_join_token: str | None) -> ServerCredentialIssued:
    """A new credential for the server; its previous one, if any, is revoked."""
    _revoke_credential(session, now, actor, key_id, server)
    token_id = secrets.token_hex(8)
    token = f"kgs_{token_id}_{secrets.token_urlsafe(32)}"
    session.add(PoolServerCredential(token_id=token_id, server_id=server.id, digest=_digest(token), created_at=now,
                                     created_by=actor, via_join_token=via_join_token))
    session.flush()
    _audit(session, now, actor, "pool.server_enrolled" if via_join_token else "pool.server_credential_issued",
           target=f"{server.pool.name}/{server.name}", key_id=key_id,
           detail={"credential_id": token_id, "join_token_id": via_join_token})
    return ServerCredentialIssued(pool=server.pool.name, server=server.name, credential_id=token_id, credential=token)


# ----- the hub's claim signing key -----


def signing_key(session: Session, now: datetime) -> tuple[str, Ed25519PrivateKey]:
    """The newest claim signing key, made on first use (kept in the database, like everything of the hub's)."""
    row = session.scalar(select(HubSigningKey).order_by(HubSigningKey.id.desc()).limit(1))
    if row is None:
        key = Ed25519PrivateKey.generate()
        row = HubSigningKey(kid=pool_claim.key_id(key.public_key()), created_at=now, private_pem=key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()).decode())
        session.add(row)
        session.flush()
    loaded = serialization.load_pem_private_key(row.private_pem.encode(), password=None)
    assert isinstance(loaded, Ed25519PrivateKey)
    return row.kid, loaded


def _ticket_of(user_data: str) -> str:
    try:
        ticket = parse_user_data(user_data).get("ticket")
    except ValueError:
        ticket = None
    return ticket if isinstance(ticket, str) else ""


def sign_claim(session: Session, now: datetime, server: PoolServer, cluster: str) -> str:
    kid, key = signing_key(session, now)
    assert server.claim_operation is not None and server.claim_user_data is not None
    iat = int(now.timestamp())
    return pool_claim.sign(key, pool_claim.PoolClaim(
        kid=kid, pool=server.pool.name, server=server.name, cluster=cluster, operation=server.claim_operation,
        node=server.claim_node_name or "", ticket_sha256=pool_claim.ticket_digest(_ticket_of(server.claim_user_data)),
        iat=iat, exp=iat + pool_claim.CLAIM_SECONDS))


@pool_claim_keys.get("/keys", summary="The hub's public claim keys (no authentication: nothing secret); gateways "
                     "verify on-prem servers' joins with them (the chart's hub.claimPublicKeys)")
def claim_keys(session: SessionDep, now: NowDep) -> ClaimKeys:
    signing_key(session, now)
    out = []
    for row in session.scalars(select(HubSigningKey).order_by(HubSigningKey.id)):
        loaded = serialization.load_pem_private_key(row.private_pem.encode(), password=None)
        assert isinstance(loaded, Ed25519PrivateKey)
        out.append(ClaimKey(kid=row.kid, pem=pool_claim.public_pem(loaded.public_key())))
    session.commit()
    return ClaimKeys(keys=out, pem="".join(k.pem for k in out))


# ----- lookups and views -----


def get_pool(session: Session, name: str) -> Pool:
    pool = session.scalar(select(Pool).where(Pool.name == name))
    if pool is None:
        raise NotFound(f"pool {name!r} not found (location {location(name)})", code="pool_not_found")
    return pool


def get_server(session: Session, pool: Pool, name: str) -> PoolServer:
    server = session.scalar(select(PoolServer).where(PoolServer.name == name, PoolServer.pool_id == pool.id))
    if server is None:
        raise NotFound(f"pool {pool.name!r} has no server {name!r}", code="server_not_found")
    return server


def _online_since(pool: Pool, now: datetime) -> datetime:
    return now - timedelta(seconds=pool.offline_after_seconds)


def is_online(server: PoolServer, now: datetime) -> bool:
    seen = server.last_heartbeat_at
    return seen is not None and seen >= _online_since(server.pool, now)


def shown_state(server: PoolServer, now: datetime) -> ShownState:
    if server.retired_at is not None and server.state == "idle":
        return "retired"
    if not is_online(server, now):
        return "offline"
    state: ShownState = server.state  # type: ignore[assignment]
    return state


def price(server: PoolServer) -> float:
    if server.usd_per_gpu_hour is not None:
        return server.usd_per_gpu_hour
    rate = server.pool.rate_card.get("usd_per_gpu_hour", {}).get(server.gpu_product)
    return float(rate) if rate is not None else 0.0


def _cluster_name(session: Session, cluster_id: int | None) -> str | None:
    if cluster_id is None:
        return None
    cluster = session.get(Cluster, cluster_id)
    return cluster.name if cluster else None


def server_out(session: Session, server: PoolServer, now: datetime) -> ServerOut:
    cred = _active_credential(session, server)
    return ServerOut(
        name=server.name, pool=server.pool.name, gpu_product=server.gpu_product, gpus=server.gpus,
        labels=dict(server.labels), usd_per_gpu_hour=price(server), state=shown_state(server, now),
        stored_state=server.state, last_heartbeat_at=server.last_heartbeat_at,
        registered_at=server.registered_at, registered_by=server.registered_by,
        claim_cluster=_cluster_name(session, server.claim_cluster_id), claim_operation=server.claim_operation,
        claim_policy=server.claim_policy, claim_node_name=server.claim_node_name, claimed_at=server.claimed_at,
        credential_id=cred.token_id if cred else None,
    )


def pool_out(session: Session, pool: Pool, now: datetime) -> PoolOut:
    return PoolOut(
        name=pool.name, location=location(pool.name), description=pool.description,
        rate_card=RateCard.model_validate(pool.rate_card), offline_after_seconds=pool.offline_after_seconds,
        created_at=pool.created_at, created_by=pool.created_by,
        join_tokens=[JoinTokenOut(id=t.token_id, created_at=t.created_at, created_by=t.created_by,
                                  last_used_at=t.last_used_at, revoked_at=t.revoked_at, revoked_by=t.revoked_by,
                                  active=t.revoked_at is None) for t in pool.tokens],
        servers=[server_out(session, s, now) for s in pool.servers],
    )


def claim_out(server: PoolServer, now: datetime) -> Claim:
    assert server.claim_operation is not None and server.claimed_at is not None
    return Claim(server=server.name, pool=server.pool.name, location=location(server.pool.name),
                 operation=server.claim_operation, policy=server.claim_policy or "",
                 node_name=server.claim_node_name or "", gpu_product=server.gpu_product, gpus=server.gpus,
                 state=shown_state(server, now), claimed_at=server.claimed_at)


def _clear_claim(server: PoolServer) -> None:
    server.state = "idle"
    server.claim_cluster_id = None
    server.claim_operation = None
    server.claim_policy = None
    server.claim_node_name = None
    server.claim_user_data = None  # the ticket is gone with the claim
    server.claimed_at = None
    server.release_requested_at = None


# ----- people and automation -----


@pools_admin.post("", status_code=201, summary="Create a pool with its rate card (admin); its first join token is "
                  "shown only in this response", openapi_extra=body_doc(PoolCreate))
def create_pool(actor: AdminDep, session: SessionDep, now: NowDep,
                body: Annotated[PoolCreate, Depends(json_body(PoolCreate))]) -> PoolCreated:
    pool, issued = add_pool(session, now, actor, body)
    session.commit()
    session.refresh(pool)
    return PoolCreated(pool=pool_out(session, pool, now), join_token=issued)


def add_pool(session: Session, now: datetime, actor: Actor, body: PoolCreate, join_token: str | None = None
             ) -> tuple[Pool, JoinTokenIssued]:
    """Create the pool and its first join token (``join_token``: adopt that one). Callers commit."""
    if session.scalar(select(Pool.id).where(Pool.name == body.name)) is not None:
        raise Conflict(f"pool {body.name!r} already exists", code="pool_exists", details=[("name", "taken")])
    pool = Pool(name=body.name, description=body.description, rate_card=body.rate_card.model_dump(),
                transfer_usd_per_gpu_hour=body.rate_card.transfer_usd_per_gpu_hour,
                offline_after_seconds=body.offline_after_seconds, created_at=now, created_by=actor.label)
    session.add(pool)
    session.flush()
    _audit(session, now, actor, "pool.created", target=pool.name,
           detail={"rate_card": pool.rate_card, "offline_after_seconds": pool.offline_after_seconds})
    return pool, issue_join_token(session, now, actor, pool, join_token)


@pools_admin.get("", summary="List pools with their servers (viewer)")
def list_pools(_: ViewerDep, session: SessionDep, now: NowDep) -> list[PoolOut]:
    pools = list(session.scalars(select(Pool).order_by(Pool.name)))
    out = [pool_out(session, p, now) for p in pools]
    session.commit()
    return out


@pools_admin.get("/{pool}", summary="One pool: rate card, join tokens, servers and their states (viewer)")
def show_pool(_: ViewerDep, session: SessionDep, now: NowDep, pool: PoolName) -> PoolOut:
    out = pool_out(session, get_pool(session, pool), now)
    session.commit()
    return out


@pools_admin.put("/{pool}/rate-card", summary="Replace the pool's rate card (operator)",
                 openapi_extra=body_doc(RateCard))
def put_rate_card(actor: OperatorDep, session: SessionDep, now: NowDep, pool: PoolName,
                  body: Annotated[RateCard, Depends(json_body(RateCard))]) -> PoolOut:
    found = get_pool(session, pool)
    before = dict(found.rate_card)
    found.rate_card = body.model_dump()
    found.transfer_usd_per_gpu_hour = body.transfer_usd_per_gpu_hour
    _audit(session, now, actor, "pool.rate_card_changed", target=found.name,
           detail={"before": before, "after": found.rate_card})
    session.commit()
    return pool_out(session, found, now)


@pools_admin.post("/{pool}/join-tokens", status_code=201, summary="Issue another join token (admin); shown once")
def create_join_token(actor: AdminDep, session: SessionDep, now: NowDep, pool: PoolName) -> JoinTokenIssued:
    issued = issue_join_token(session, now, actor, get_pool(session, pool))
    session.commit()
    return issued


@pools_admin.post("/{pool}/join-tokens/{token_id}/revoke",
                  summary="Revoke a join token (admin): servers holding it can no longer heartbeat")
def revoke_join_token(actor: AdminDep, session: SessionDep, now: NowDep, pool: PoolName, token_id: TokenId
                      ) -> PoolOut:
    found = get_pool(session, pool)
    token = next((t for t in found.tokens if t.token_id == token_id), None)
    if token is None:
        raise NotFound(f"pool {pool!r} has no join token {token_id!r}", code="join_token_not_found")
    if token.revoked_at is None:
        token.revoked_at = now
        token.revoked_by = actor.label
        _audit(session, now, actor, "pool.join_token_revoked", target=found.name, detail={"token_id": token_id})
    session.commit()
    return pool_out(session, found, now)


@pools_admin.put("/{pool}/servers/{server}", summary="Register or update a server (operator)",
                 openapi_extra=body_doc(ServerRegister))
def register_server(actor: OperatorDep, session: SessionDep, now: NowDep, response: Response, pool: PoolName,
                    server: ServerName, body: Annotated[ServerRegister, Depends(json_body(ServerRegister))]
                    ) -> ServerOut:
    found = get_pool(session, pool)
    row, created = register_inventory(session, now, actor.label, actor.key_id, found, server, body.gpu_product,
                                      body.gpus, body.labels, override=body.usd_per_gpu_hour, set_override=True)
    session.commit()
    response.status_code = 201 if created else 200
    return server_out(session, row, now)


@pools_admin.post("/{pool}/servers/{server}/retire", summary="Retire a server (operator): never claimed again")
def retire_server(actor: OperatorDep, session: SessionDep, now: NowDep, pool: PoolName, server: ServerName
                  ) -> ServerOut:
    row = get_server(session, get_pool(session, pool), server)
    if row.retired_at is None:
        row.retired_at = now
        row.retired_by = actor.label
        _audit(session, now, actor, "pool.server_retired", target=f"{pool}/{server}",
               detail={"state": row.state, "operation": row.claim_operation})
    session.commit()
    return server_out(session, row, now)


@pools_admin.post("/{pool}/servers/{server}/credential", status_code=201,
                  summary="Issue the server's own credential (operator; shown once): its previous one is revoked")
def create_server_credential(actor: OperatorDep, session: SessionDep, now: NowDep, pool: PoolName,
                             server: ServerName) -> ServerCredentialIssued:
    row = get_server(session, get_pool(session, pool), server)
    issued = issue_server_credential(session, now, actor.label, actor.key_id, row, via_join_token=None)
    session.commit()
    return issued


@pools_admin.post("/{pool}/servers/{server}/credential/revoke",
                  summary="Revoke the server's credential (operator): it can no longer heartbeat, is never claimed "
                  "and gets no claim signed until it enrols again")
def revoke_server_credential(actor: OperatorDep, session: SessionDep, now: NowDep, pool: PoolName,
                             server: ServerName) -> ServerOut:
    row = get_server(session, get_pool(session, pool), server)
    _revoke_credential(session, now, actor.label, actor.key_id, row)
    session.commit()
    return server_out(session, row, now)


def register_inventory(session: Session, now: datetime, actor: str, key_id: str | None, pool: Pool, name: str,
                       gpu_product: str, gpus: int, labels: dict[str, str], *, override: float | None = None,
                       set_override: bool = False) -> tuple[PoolServer, bool]:
    """The operator's inventory entry of a server (created, or changed): what its agent may enrol as."""
    row = session.scalar(select(PoolServer).where(PoolServer.name == name))
    if row is not None and row.pool_id != pool.id:
        raise Conflict(f"server {name!r} is registered in pool {row.pool.name!r}, not {pool.name!r}: retire it "
                       "there first", code="server_in_another_pool", details=[("server", f"in pool {row.pool.name}")])
    if row is None:
        row = PoolServer(name=name, pool_id=pool.id, gpu_product=gpu_product, gpus=gpus, labels=labels,
                         usd_per_gpu_hour=override, state="idle", registered_at=now, registered_by=actor)
        session.add(row)
        session.flush()
        session.refresh(row)
        _audit(session, now, actor, "pool.server_registered", target=f"{pool.name}/{name}", key_id=key_id,
               detail={"gpu_product": gpu_product, "gpus": gpus, "labels": labels, "usd_per_gpu_hour": override})
        return row, True
    changed = {}
    if (row.gpu_product, row.gpus, dict(row.labels)) != (gpu_product, gpus, labels):
        changed = {"gpu_product": gpu_product, "gpus": gpus, "labels": labels}
        row.gpu_product, row.gpus, row.labels = gpu_product, gpus, labels
    if set_override and row.usd_per_gpu_hour != override:
        changed["usd_per_gpu_hour"] = override
        row.usd_per_gpu_hour = override
    if changed:
        _audit(session, now, actor, "pool.server_changed", target=f"{pool.name}/{name}", key_id=key_id,
               detail=changed)
    return row, False


# ----- the server's agent -----


@pools_agent.post("/enrol", status_code=201, summary="Enrol a server (the pool's enrolment token): an "
                  "operator-registered server with no credential gets its own, once", openapi_extra=body_doc(Enrolment))
def enrol(request: Request, session: SessionDep, now: NowDep,
          body: Annotated[Enrolment, Depends(json_body(Enrolment))]) -> ServerCredentialIssued:
    token = authenticate_agent(session, now, request)
    pool = token.pool
    if body.pool != pool.name:
        raise Forbidden(f"the enrolment token {token.token_id} is pool {pool.name!r}'s; it cannot enrol a server of "
                        f"pool {body.pool!r}", code="wrong_pool", details=[("pool", "not this token's pool")])
    row = session.scalar(select(PoolServer).where(PoolServer.name == body.server))
    if row is not None and row.pool_id != pool.id:
        raise Conflict(f"server {body.server!r} is registered in pool {row.pool.name!r}, not {pool.name!r}",
                       code="server_in_another_pool", details=[("server", f"in pool {row.pool.name}")])
    if row is None or row.retired_at is not None:
        raise Forbidden(f"pool {pool.name!r} has no server {body.server!r} to enrol: an operator registers it first "
                        f"(PUT /v1/pools/{pool.name}/servers/{body.server})", code="server_not_registered",
                        details=[("server", "not registered by an operator")])
    if (row.gpu_product, row.gpus) != (body.gpu_product, body.gpus):
        raise Conflict(f"server {row.name!r} is registered with {row.gpus} x {row.gpu_product}, not {body.gpus} x "
                       f"{body.gpu_product}: an operator changes that", code="server_mismatch",
                       details=[("gpus", "not what the operator registered")])
    if _active_credential(session, row) is not None:
        raise Conflict(f"server {row.name!r} is enrolled already: an operator revokes its credential before it "
                       "enrols again", code="server_enrolled", details=[("server", "has a credential")])
    issued = issue_server_credential(session, now, f"agent:{row.name}", token.token_id, row,
                                     via_join_token=token.token_id)
    session.commit()
    return issued


@pools_agent.post("/heartbeat", summary="A server's heartbeat (its own credential): online, and what it should be "
                  "part of", openapi_extra=body_doc(Heartbeat))
def heartbeat(request: Request, session: SessionDep, now: NowDep,
              body: Annotated[Heartbeat, Depends(json_body(Heartbeat))]) -> HeartbeatAnswer:
    cred = authenticate_server(session, now, request)
    server = cred.server
    pool = server.pool
    if body.pool != pool.name or (body.server is not None and body.server != server.name):
        raise Forbidden(f"the credential {cred.token_id} is server {pool.name}/{server.name}'s; it cannot report "
                        f"{body.pool}/{body.server or server.name}", code="wrong_server",
                        details=[("server" if body.pool == pool.name else "pool", "not this credential's")])
    if (server.gpu_product, server.gpus) != (body.gpu_product, body.gpus):
        raise Conflict(f"server {server.name!r} is registered with {server.gpus} x {server.gpu_product}, it reports "
                       f"{body.gpus} x {body.gpu_product}: an operator changes the registration",
                       code="server_mismatch", details=[("gpus", "not what the operator registered")])
    actor, key_id = f"agent:{server.name}", cred.token_id
    target = f"{pool.name}/{server.name}"
    was_offline = not is_online(server, now)
    server.last_heartbeat_at = now
    if was_offline:
        _audit(session, now, actor, "pool.server_online", target=target, key_id=key_id,
               detail={"phase": body.phase, "operation": body.operation})
    cluster = _cluster_name(session, server.claim_cluster_id)
    holds = server.claim_operation is not None and body.operation == server.claim_operation
    if body.phase == "idle":
        if server.state == "releasing" or (server.state in ("joining", "serving") and holds):
            _audit(session, now, actor, "pool.server_released", target=target, cluster=cluster, key_id=key_id,
                   detail={"operation": server.claim_operation, "policy": server.claim_policy,
                           "requested_at": server.release_requested_at.isoformat()
                           if server.release_requested_at else None})
            _clear_claim(server)
        elif server.state == "claimed" and holds:  # the agent declines (a cluster it is not configured for)
            _audit(session, now, actor, "pool.claim_declined", target=target, cluster=cluster, key_id=key_id,
                   detail={"operation": server.claim_operation, "policy": server.claim_policy})
            _clear_claim(server)
    elif holds and server.state == "claimed":
        # Taken up: from now on the claim cannot be withdrawn, so its ticket reaches this server only. Conditional:
        # of this and a concurrent withdrawal exactly one wins.
        won = session.execute(  # type: ignore[attr-defined]
            update(PoolServer).where(PoolServer.id == server.id, PoolServer.state == "claimed",
                                     PoolServer.claim_operation == body.operation)
            .values(state=body.phase).execution_options(synchronize_session=False)).rowcount
        session.refresh(server)
        if won == 1:
            _audit(session, now, actor, f"pool.server_{body.phase}", target=target, cluster=cluster, key_id=key_id,
                   detail={"operation": server.claim_operation})
    elif holds and server.state in ("joining", "serving") and server.state != body.phase:
        _audit(session, now, actor, f"pool.server_{body.phase}", target=target, cluster=cluster, key_id=key_id,
               detail={"operation": server.claim_operation})
        server.state = body.phase
    if holds and server.state == "serving":
        server.claim_user_data = None  # the ticket was redeemed: nothing to keep
    claim = None
    if server.claim_operation is not None and server.state in ("claimed", "joining", "serving"):
        taken_up = holds and server.state == "joining" and server.claim_user_data is not None
        claim = AgentClaim(operation=server.claim_operation, cluster=cluster or "", policy=server.claim_policy or "",
                           node_name=server.claim_node_name or "",
                           user_data=server.claim_user_data if taken_up else None,
                           pool_claim=sign_claim(session, now, server, cluster or "") if taken_up else None)
    answer = HeartbeatAnswer(server=server.name, pool=pool.name, state=server.state,
                             claim=claim, heartbeat_seconds=max(1, pool.offline_after_seconds // 4))
    session.commit()
    return answer


# ----- the optimizer -----


def _policies_naming(session: Session, cluster: Cluster, loc: str) -> list[str]:
    rows: Iterable[Policy] = session.scalars(select(Policy).where(Policy.cluster_id == cluster.id))
    return sorted(p.name for p in rows if loc in ((p.document.get("spec") or {}).get("locations") or []))


def _own(session: Session, actor: Actor) -> Cluster:
    assert actor.kind is ActorKind.CLUSTER and actor.cluster_id is not None
    cluster = session.get(Cluster, actor.cluster_id)
    assert cluster is not None
    return cluster


def _authorized_pool(session: Session, actor: Actor, pool_name: str, policy: str | None = None
                     ) -> tuple[Cluster, Pool]:
    """The cluster may use the pool only for a location its policies (in the hub) name, through such a policy."""
    cluster = _own(session, actor)
    loc = location(pool_name)
    naming = _policies_naming(session, cluster, loc)
    if not naming:
        raise Forbidden(f"cluster {cluster.name!r} has no policy naming location {loc}: it may not use pool "
                        f"{pool_name!r}", code="location_not_in_policies", details=[("pool", f"{loc} not named")])
    if policy is not None and policy not in naming:
        raise Forbidden(f"policy {policy!r} of cluster {cluster.name!r} does not name location {loc} (policies "
                        f"that do: {', '.join(naming)})", code="location_not_in_policy",
                        details=[("policy", f"does not name {loc}")])
    return cluster, get_pool(session, pool_name)


@pools_cluster.get("/{pool}/offerings", summary="The pool's offerings from its rate card (cluster token)")
def offerings(actor: ClusterDep, session: SessionDep, now: NowDep, pool: PoolName) -> PoolOfferings:
    _, found = _authorized_pool(session, actor, pool)
    kinds: dict[tuple[str, int, float], int] = {}
    for s in found.servers:
        if s.retired_at is not None:
            continue
        key = (s.gpu_product, s.gpus, round(price(s), 6))
        idle = s.state == "idle" and is_online(s, now) and _active_credential(session, s) is not None
        kinds[key] = kinds.get(key, 0) + (1 if idle else 0)
    out = PoolOfferings(
        pool=found.name, location=location(found.name), transfer_usd_per_gpu_hour=found.transfer_usd_per_gpu_hour,
        offerings=[PoolOffering(instance_type=f"onprem.{gpus}x{product}", gpu_product=product, gpus=gpus,
                                usd_per_hour=round(rate * gpus, 6), idle=idle)
                   for (product, gpus, rate), idle in sorted(kinds.items())])
    session.commit()
    return out


@pools_cluster.post("/{pool}/claims", summary="Claim an idle server that fits (idempotent by operation)",
                    description="201 with the claimed server; 200 with the same server when this cluster already "
                    "claimed one for the operation (a retry); 409 `no_idle_server` when no idle, online server of "
                    "the GPU product with at least that many GPUs is left.",
                    openapi_extra=body_doc(ClaimCreate), responses={201: {"model": ClaimResult}})
def claim(actor: ClusterDep, session: SessionDep, now: NowDep, response: Response, pool: PoolName,
          body: Annotated[ClaimCreate, Depends(json_body(ClaimCreate))]) -> ClaimResult:
    cluster, found = _authorized_pool(session, actor, pool, body.policy)
    held = _claimed(session, cluster, found, body.operation)
    if held is not None:
        session.commit()
        response.status_code = 200
        return ClaimResult(created=False, claim=claim_out(held, now))
    _check_user_data(body)
    _check_max_nodes(session, cluster, body.policy)
    enrolled = exists().where(PoolServerCredential.server_id == PoolServer.id,
                              PoolServerCredential.revoked_at.is_(None))
    candidates = list(session.scalars(
        select(PoolServer).where(
            PoolServer.pool_id == found.id, PoolServer.state == "idle", PoolServer.retired_at.is_(None),
            PoolServer.gpu_product == body.gpu_product, PoolServer.gpus >= body.gpus,
            PoolServer.last_heartbeat_at >= _online_since(found, now), enrolled,
            PoolServer.name.not_in(body.exclude),
        ).order_by(PoolServer.gpus, PoolServer.name)))
    for candidate in candidates:
        # Compare-and-set: of two clusters racing for the last server, exactly one update matches.
        try:
            won = session.execute(  # type: ignore[attr-defined]
                update(PoolServer).where(PoolServer.id == candidate.id, PoolServer.state == "idle")
                .values(state="claimed", claim_cluster_id=cluster.id, claim_operation=body.operation,
                        claim_policy=body.policy, claim_node_name=body.node_name, claim_user_data=body.user_data,
                        claimed_at=now, release_requested_at=None)
                .execution_options(synchronize_session=False)).rowcount
        except IntegrityError:  # the same operation claimed concurrently (a retry racing itself)
            session.rollback()
            held = _claimed(session, cluster, get_pool(session, pool), body.operation)
            if held is None:
                raise
            session.commit()
            response.status_code = 200
            return ClaimResult(created=False, claim=claim_out(held, now))
        if won != 1:
            continue
        session.refresh(candidate)
        _audit(session, now, actor, "pool.server_claimed", target=f"{found.name}/{candidate.name}",
               cluster=cluster.name, detail={"operation": body.operation, "policy": body.policy,
                                             "node": body.node_name, "location": location(found.name),
                                             "usd_per_gpu_hour": price(candidate)})
        session.commit()
        response.status_code = 201
        return ClaimResult(created=True, claim=claim_out(candidate, now))
    raise Conflict(f"pool {found.name!r} has no idle, online server with {body.gpus} x {body.gpu_product}",
                   code="no_idle_server")


def _check_user_data(body: ClaimCreate) -> None:
    """The user data must hold a join document for the claimed node with its ticket: the hub signs the ticket's
    digest into the server's pool claim, so the gateway lets the server join with that ticket only."""
    try:
        doc = parse_user_data(body.user_data)
    except ValueError as exc:
        raise Unprocessable(f"user_data: {exc}", details=[("user_data", "no kubeon join document")]) from None
    if not isinstance(doc.get("ticket"), str) or not doc["ticket"] or doc.get("nodeName") != body.node_name:
        raise Unprocessable(f"user_data: the join document must hold a ticket for node {body.node_name!r}",
                            details=[("user_data", "no ticket for node_name")])


def _check_max_nodes(session: Session, cluster: Cluster, policy: str) -> None:
    """A cluster holds at most its policy's ``limits.maxNodes`` servers for it (across pools). The policy row is
    locked (PostgreSQL; SQLite's write transactions are serialised anyway): two concurrent claims count in turn."""
    row = session.scalar(select(Policy).where(Policy.cluster_id == cluster.id, Policy.name == policy)
                         .with_for_update())
    limit = ((row.document.get("spec") or {}).get("limits") or {}).get("maxNodes") if row is not None else None
    if not isinstance(limit, int):
        return
    held = session.scalar(select(func.count()).select_from(PoolServer).where(
        PoolServer.claim_cluster_id == cluster.id, PoolServer.claim_policy == policy)) or 0
    if held >= limit:
        raise Conflict(f"policy {policy!r} of cluster {cluster.name!r} already holds {held} on-prem server(s), its "
                       f"maxNodes is {limit}", code="max_nodes_reached", details=[("policy", f"maxNodes {limit}")])


def _claimed(session: Session, cluster: Cluster, pool: Pool, operation: str) -> PoolServer | None:
    return session.scalar(select(PoolServer).where(
        PoolServer.pool_id == pool.id, PoolServer.claim_cluster_id == cluster.id,
        PoolServer.claim_operation == operation))


@pools_cluster.get("/{pool}/claims", summary="This cluster's claims in the pool (cluster token)")
def list_claims(actor: ClusterDep, session: SessionDep, now: NowDep, pool: PoolName,
                policy: str | None = None, operation: str | None = None) -> list[Claim]:
    cluster, found = _authorized_pool(session, actor, pool)
    query = select(PoolServer).where(PoolServer.pool_id == found.id, PoolServer.claim_cluster_id == cluster.id)
    if policy is not None:
        query = query.where(PoolServer.claim_policy == policy)
    if operation is not None:
        query = query.where(PoolServer.claim_operation == operation)
    out = [claim_out(s, now) for s in session.scalars(query.order_by(PoolServer.name))]
    session.commit()
    return out


@pools_cluster.get("/{pool}/servers/{server}", summary="A server this cluster has claimed (cluster token)")
def get_claimed(actor: ClusterDep, session: SessionDep, now: NowDep, pool: PoolName, server: ServerName) -> Claim:
    cluster, found = _authorized_pool(session, actor, pool)
    row = session.scalar(select(PoolServer).where(PoolServer.pool_id == found.id, PoolServer.name == server))
    if row is None or row.claim_cluster_id != cluster.id:
        raise NotFound(f"cluster {cluster.name!r} holds no claim on server {server!r} of pool {pool!r}",
                       code="claim_not_found")
    out = claim_out(row, now)
    session.commit()
    return out


@pools_cluster.post("/{pool}/servers/{server}/release", summary="Release a claimed server (idempotent)",
                    description="The server's agent leaves the cluster and reports idle. Releasing a server this "
                    "cluster does not hold (already released) is a no-op; one held for another policy is 409. "
                    "`withdraw` frees a claim the agent has not taken up yet at once, and is a no-op (released "
                    "false, its state) once the agent has: it has the ticket then.",
                    openapi_extra=body_doc(ClaimRelease))
def release(actor: ClusterDep, session: SessionDep, now: NowDep, pool: PoolName, server: ServerName,
            body: Annotated[ClaimRelease, Depends(json_body(ClaimRelease))]) -> ReleaseResult:
    cluster, found = _authorized_pool(session, actor, pool)
    row = get_server(session, found, server)
    if row.claim_cluster_id != cluster.id or row.claim_operation != body.operation:
        session.commit()
        return ReleaseResult(server=row.name, released=False, state=shown_state(row, now))
    if row.claim_policy != body.policy:
        raise Conflict(f"server {server!r} is held for policy {row.claim_policy!r}, not {body.policy!r}",
                       code="not_owned", details=[("policy", "not the claiming policy")])
    released = False
    target = f"{found.name}/{row.name}"
    detail = {"operation": row.claim_operation, "policy": row.claim_policy, "location": location(found.name)}
    withdrawn = body.withdraw and row.state == "claimed" and session.execute(  # type: ignore[attr-defined]
        # Only while the agent has not taken it up (and so has not seen the ticket): conditional, against a
        # heartbeat taking it up at the same moment.
        update(PoolServer).where(PoolServer.id == row.id, PoolServer.state == "claimed",
                                 PoolServer.claim_operation == body.operation)
        .values(state="idle", claim_cluster_id=None, claim_operation=None, claim_policy=None, claim_node_name=None,
                claim_user_data=None, claimed_at=None, release_requested_at=None)
        .execution_options(synchronize_session=False)).rowcount == 1
    session.refresh(row)
    if withdrawn:
        _audit(session, now, actor, "pool.claim_withdrawn", target=target, cluster=cluster.name,
               detail={**detail, "online": is_online(row, now)})
        released = True
    elif row.state == "idle" or body.withdraw:
        # Withdrawn or declined meanwhile; or (withdraw) taken up by the agent after all: it has the ticket, so the
        # claim stands (not withdrawn, not released) and the answer says it is joining.
        pass
    elif row.state != "releasing":
        row.state = "releasing"
        row.release_requested_at = now
        row.claim_user_data = None
        _audit(session, now, actor, "pool.server_release_requested", target=target, cluster=cluster.name,
               detail=detail)
        released = True
    out = ReleaseResult(server=row.name, released=released, state=shown_state(row, now))
    session.commit()
    return out


ROUTERS: Final = (pools_admin, pools_agent, pools_cluster, pool_claim_keys)
BODY_MODELS: Final = (PoolCreate, RateCard, ServerRegister, Enrolment, Heartbeat, ClaimCreate, ClaimRelease)

"""On-prem pools (rate cards, servers and their states, join tokens) and the audit log (read-only)."""

from __future__ import annotations

from typing import Annotated
from typing import Final

from fastapi import APIRouter
from fastapi import Query
from fastapi import Request
from fastapi.responses import Response
from sqlalchemy import select

from hub import pools
from hub.audit import Role
from hub.auth import NowDep
from hub.auth import SessionDep
from hub.db import AuditEvent
from hub.pool_db import Pool
from hub.pools import PoolName
from hub.pools import TokenId
from hub.web import sessions
from hub.web.common import FormDep
from hub.web.common import SignedInDep
from hub.web.common import redirect
from hub.web.render import confirm
from hub.web.render import page

router = APIRouter(prefix="/ui", include_in_schema=False)
AUDIT_PAGE: Final = 50
ActorFilter = Annotated[str | None, Query(max_length=80, pattern=r"^[a-z]+:[a-z0-9-]*$|^[a-z0-9-]+$")]
ActionFilter = Annotated[str | None, Query(max_length=64, pattern=r"^[a-z][a-z0-9_.]*$")]


@router.get("/pools")
def pool_list(request: Request, who: SignedInDep, session: SessionDep, now: NowDep) -> Response:
    rows = [pools.pool_out(session, p, now) for p in session.scalars(select(Pool).order_by(Pool.name))]
    session.commit()
    return page(request, "pools.html", title="On-prem pools", signed_in=who, section="pools", pools=rows)


@router.post("/pools/{pool}/join-tokens")
def issue_join_token(request: Request, who: SignedInDep, session: SessionDep, now: NowDep, pool: PoolName,
                     _: FormDep) -> Response:
    sessions.require(who, Role.ADMIN, "issuing a join token")
    issued = pools.create_join_token(who.actor, session, now, pool)
    return page(request, "join_token.html", title=f"Join token for pool {pool}", signed_in=who, section="pools",
                issued=issued, status_code=201)


@router.get("/pools/{pool}/join-tokens/{token_id}/revoke")
def revoke_join_token_confirm(request: Request, who: SignedInDep, session: SessionDep, pool: PoolName,
                              token_id: TokenId) -> Response:
    sessions.require(who, Role.ADMIN, "revoking a join token")
    pools.get_pool(session, pool)
    session.commit()
    return confirm(request, who, section="pools", title=f"Revoke join token {token_id} of pool {pool}?",
                   button=f"Revoke join token {token_id}", back="/ui/pools",
                   text=f"Servers of pool {pool} that hold join token {token_id} can no longer heartbeat, so they "
                   "show offline and are never claimed until they get another token.")


@router.post("/pools/{pool}/join-tokens/{token_id}/revoke")
def revoke_join_token(who: SignedInDep, session: SessionDep, now: NowDep, pool: PoolName, token_id: TokenId,
                      _: FormDep) -> Response:
    sessions.require(who, Role.ADMIN, "revoking a join token")
    pools.revoke_join_token(who.actor, session, now, pool, token_id)
    return redirect("/ui/pools")


@router.get("/audit")
def audit(request: Request, who: SignedInDep, session: SessionDep, actor: ActorFilter = None,
          action: ActionFilter = None, before: Annotated[int | None, Query(ge=1, le=2**31 - 1)] = None
          ) -> Response:
    """Newest first, a page at a time; the API's ``GET /v1/audit`` is admin-only, and so is this."""
    sessions.require(who, Role.ADMIN, "the audit log")
    query = select(AuditEvent)
    if actor:
        query = query.where(AuditEvent.actor == actor if ":" in actor else AuditEvent.actor.like(f"%:{actor}"))
    if action:
        query = query.where(AuditEvent.action == action)
    if before:
        query = query.where(AuditEvent.id < before)
    rows = list(session.scalars(query.order_by(AuditEvent.id.desc()).limit(AUDIT_PAGE + 1)))
    actions = sorted(set(session.scalars(select(AuditEvent.action).distinct())))
    session.commit()
    events = rows[:AUDIT_PAGE]
    return page(request, "audit.html", title="Audit log", signed_in=who, section="audit", events=events,
                filters={"actor": actor or "", "action": action or ""}, actions=actions,
                older=events[-1].id if len(rows) > AUDIT_PAGE else None)

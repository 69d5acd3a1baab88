"""Approvals (proposals waiting, with their plan; Approve / Reject bound to the plan ID) and the Activity timeline
of the clusters' action reports."""

from __future__ import annotations

from typing import Annotated
from typing import Any
from typing import Final

from fastapi import APIRouter
from fastapi import Query
from fastapi import Request
from fastapi.responses import Response
from sqlalchemy import select
from sqlalchemy.orm import Session

from hub import ops
from hub import routes
from hub.audit import Role
from hub.auth import NowDep
from hub.auth import SessionDep
from hub.db import ActionReport
from hub.db import Approval
from hub.db import Cluster
from hub.errors import HubError
from hub.http import validate_body
from hub.plans import console_url
from hub.plans import parse_plan
from hub.schemas import ApprovalCreate
from hub.web import sessions
from hub.web.common import FormDep
from hub.web.common import SignedInDep
from hub.web.common import redirect
from hub.web.common import valid_name
from hub.web.render import page

router = APIRouter(prefix="/ui", include_in_schema=False)
MAX_PROPOSALS: Final = 500
TIMELINE_PAGE: Final = 200
Filter = Annotated[str | None, Query(max_length=253, pattern=r"^[^\x00-\x1f\x7f]*$")]


def pending(session: Session) -> list[dict[str, Any]]:
    """Operations reported as proposed, neither decided in the hub nor ended: the newest proposal of each."""
    latest: dict[tuple[int, str], ActionReport] = {}
    for report in session.scalars(select(ActionReport).where(ActionReport.action == "proposed")
                                  .order_by(ActionReport.id.desc()).limit(MAX_PROPOSALS)):
        latest.setdefault((report.cluster_id, report.operation), report)
    if not latest:
        return []
    operations = sorted({operation for _, operation in latest})
    decided = {(cluster_id, operation) for cluster_id, operation in session.execute(
        select(Approval.cluster_id, Approval.operation).where(Approval.operation.in_(operations)))}
    # Approved in the cluster itself (its Temporal UI, the CLI) counts as decided too.
    ended = {(cluster_id, operation) for cluster_id, operation in session.execute(
        select(ActionReport.cluster_id, ActionReport.operation).where(
            ActionReport.operation.in_(operations),
            ActionReport.action.in_(sorted(ops.ENDED_ACTIONS | {"approved"}))))}
    names = {c.id: c.name for c in session.scalars(select(Cluster))}
    out = []
    for key, report in sorted(latest.items(), key=lambda kv: kv[1].id, reverse=True):
        if key in decided or key in ended:
            continue
        out.append({"cluster": names.get(report.cluster_id, "?"), "report": report,
                    "plan": parse_plan(report.detail), "console_url": console_url(report.detail)})
    return out


def _decisions(session: Session) -> list[dict[str, Any]]:
    names = {c.id: c.name for c in session.scalars(select(Cluster))}
    return [{"cluster": names.get(a.cluster_id, "?"), "approval": a}
            for a in session.scalars(select(Approval).order_by(Approval.id.desc()).limit(50))]


@router.get("/approvals")
def approvals(request: Request, who: SignedInDep, session: SessionDep) -> Response:
    waiting = pending(session)
    decided = _decisions(session)
    session.commit()
    return page(request, "approvals.html", title="Approvals", signed_in=who, section="approvals",
                waiting=waiting, decided=decided, problem=None)


@router.post("/approvals")
def decide(request: Request, who: SignedInDep, session: SessionDep, now: NowDep, form: FormDep) -> Response:
    """Through the API's ``decide``: the same rules (proposed and not ended, decisions final, a stale plan
    refused) and the same audit record."""
    sessions.require(who, Role.OPERATOR, "approving or rejecting an operation")
    cluster = form.get("cluster")
    try:
        body = validate_body(ApprovalCreate, {
            "operation": form.get("operation"), "decision": form.get("decision"), "plan_id": form.optional("plan_id"),
            "reason": form.get("reason").strip()})
        cluster = valid_name(cluster, "cluster")
        routes.decide(who.actor, session, now, Response(), cluster, body)
    except HubError as exc:
        session.rollback()
        waiting = pending(session)
        decided = _decisions(session)
        session.commit()
        return page(request, "approvals.html", title="Approvals", signed_in=who, section="approvals",
                    waiting=waiting, decided=decided, status_code=exc.status_code,
                    problem={"message": exc.message, "operation": form.get("operation")})
    return redirect("/ui/approvals")


@router.get("/activity")
def activity(request: Request, who: SignedInDep, session: SessionDep, cluster: Filter = None,
             policy: Filter = None, location: Filter = None, operation: Filter = None,
             before: Annotated[int | None, Query(ge=1, le=2**31 - 1)] = None) -> Response:
    names = {c.id: c.name for c in session.scalars(select(Cluster).order_by(Cluster.name))}
    query = select(ActionReport)
    if cluster:
        query = query.where(ActionReport.cluster_id.in_([i for i, n in names.items() if n == cluster]))
    if policy:
        query = query.where(ActionReport.policy == policy)
    if location:
        query = query.where(ActionReport.location == location)
    if operation:
        query = query.where(ActionReport.operation == operation)
    if before:
        query = query.where(ActionReport.id < before)
    rows = list(session.scalars(query.order_by(ActionReport.id.desc()).limit(TIMELINE_PAGE + 1)))
    consoles: dict[tuple[int, str], str] = {}
    for r in rows:
        url = console_url(r.detail)
        if url:
            consoles.setdefault((r.cluster_id, r.operation), url)
    session.commit()
    page_rows = rows[:TIMELINE_PAGE]
    events = [{"cluster": names.get(r.cluster_id, "?"), "report": r, "plan": parse_plan(r.detail),
               "console_url": consoles.get((r.cluster_id, r.operation))} for r in page_rows]
    filters = {"cluster": cluster or "", "policy": policy or "", "location": location or "",
               "operation": operation or ""}
    older = page_rows[-1].id if len(rows) > TIMELINE_PAGE else None
    return page(request, "activity.html", title="Activity", signed_in=who, section="activity", events=events,
                filters=filters, clusters=sorted(names.values()), older=older)

"""The hub's HTTP API (v1). People and automation use ``/v1/users``, ``/v1/clusters/...`` and ``/v1/audit`` with
API keys; an optimizer uses ``/v1/cluster/...`` with its cluster token and sees only its own cluster."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated
from typing import Any
from typing import Final

from fastapi import APIRouter
from fastapi import Depends
from fastapi import Header
from fastapi import Path
from fastapi import Query
from fastapi import Request
from fastapi import Response
from sqlalchemy import select
from sqlalchemy.orm import Session

from hub import ops
from hub.audit import Actor
from hub.audit import ActorKind
from hub.auth import AdminDep
from hub.auth import ClusterDep
from hub.auth import HubState
from hub.auth import NowDep
from hub.auth import OperatorDep
from hub.auth import SessionDep
from hub.auth import ViewerDep
from hub.auth import authenticate
from hub.auth import hub_state
from hub.db import ActionReport
from hub.db import Approval
from hub.db import AuditChainHead
from hub.db import AuditEvent
from hub.db import Cluster
from hub.db import Policy
from hub.db import Principal
from hub.db import ReportedAuditHead
from hub.http import ERROR_RESPONSES
from hub.http import body_doc
from hub.http import json_body
from hub.http import read_json
from hub.schemas import AUDIT_ACTION_PATTERN
from hub.schemas import MAX_ID
from hub.schemas import NAME_PATTERN
from hub.schemas import OPERATION_PATTERN
from hub.schemas import ActionReportCreate
from hub.schemas import ActionReportOut
from hub.schemas import ActionReportPage
from hub.schemas import ApiKeyCreate
from hub.schemas import ApiKeyIssued
from hub.schemas import ApiKeyOut
from hub.schemas import ApprovalCreate
from hub.schemas import ApprovalDecided
from hub.schemas import ApprovalOut
from hub.schemas import ApprovalPage
from hub.schemas import AuditChains
from hub.schemas import AuditEventOut
from hub.schemas import AuditPage
from hub.schemas import ChainHeadOut
from hub.schemas import ClusterCreate
from hub.schemas import ClusterCreated
from hub.schemas import ClusterInfo
from hub.schemas import ClusterOut
from hub.schemas import ClusterPolicySet
from hub.schemas import ClusterRevoked
from hub.schemas import PolicyDeleted
from hub.schemas import PolicyList
from hub.schemas import PolicyOut
from hub.schemas import PolicyWritten
from hub.schemas import ReportedHeadOut
from hub.schemas import TokenIssued
from hub.schemas import TokenOut
from hub.schemas import UserCreate
from hub.schemas import UserOut
from hub.schemas import WhoAmI
from models.policy import RESOURCE_NAME_PATTERN

MAX_PAGE: Final = 1000
DEFAULT_PAGE: Final = 100

ClusterName = Annotated[str, Path(max_length=63, pattern=NAME_PATTERN, description="cluster name")]
UserName = Annotated[str, Path(max_length=63, pattern=NAME_PATTERN, description="user name")]
PolicyName = Annotated[str, Path(max_length=253, pattern=RESOURCE_NAME_PATTERN, description="GpuPolicy name")]
After = Annotated[int, Query(ge=0, le=MAX_ID, description="cursor: return only items with a larger id")]
Limit = Annotated[int, Query(ge=1, le=MAX_PAGE, description="page size")]
IfNoneMatch = Annotated[str | None, Header(description="an ETag from an earlier answer; 304 if unchanged")]
StateDep = Annotated[HubState, Depends(hub_state)]

people = APIRouter(prefix="/v1", responses=ERROR_RESPONSES)
clusters_api = APIRouter(prefix="/v1/cluster", tags=["cluster (optimizer)"], responses=ERROR_RESPONSES)


def _etag_matches(if_none_match: str | None, etag: str) -> bool:
    if if_none_match is None:
        return False
    candidates = [c.strip().removeprefix("W/") for c in if_none_match.split(",")]
    return "*" in candidates or etag in candidates


# ----- conversions -----


def _cluster_out(cluster: Cluster, now: datetime) -> ClusterOut:
    status = ops.cluster_status(cluster, now)
    return ClusterOut(
        name=cluster.name, description=cluster.description, created_at=cluster.created_at,
        created_by=cluster.created_by, status=status, connected=status == "connected",
        last_seen=cluster.last_seen_at, policy_revision=cluster.policy_revision,
        tokens=[
            TokenOut(
                id=t.token_id, state=ops.token_state(t, now), created_at=t.created_at, created_by=t.created_by,
                first_used_at=t.first_used_at, last_used_at=t.last_used_at, expires_at=t.expires_at,
                revoked_at=t.revoked_at, revoked_by=t.revoked_by,
            )
            for t in cluster.tokens
        ],
    )


def _user_out(user: Principal) -> UserOut:
    return UserOut(
        name=user.name, role=user.role, created_at=user.created_at, created_by=user.created_by,
        keys=[
            ApiKeyOut(
                id=k.key_id, description=k.description, created_at=k.created_at, created_by=k.created_by,
                last_used_at=k.last_used_at, revoked_at=k.revoked_at, revoked_by=k.revoked_by,
                active=k.revoked_at is None,
            )
            for k in user.keys
        ],
    )


def _policy_out(policy: Policy) -> PolicyOut:
    return PolicyOut(
        name=policy.name, revision=policy.revision, created_at=policy.created_at, created_by=policy.created_by,
        updated_at=policy.updated_at, updated_by=policy.updated_by, document=policy.document,
    )


def _approval_out(cluster: Cluster, approval: Approval) -> ApprovalOut:
    return ApprovalOut(
        id=approval.id, cluster=cluster.name, operation=approval.operation, decision=approval.decision,
        plan_id=approval.plan_id, reason=approval.reason, decided_by=approval.decided_by,
        decided_at=approval.decided_at,
    )


def _report_out(cluster: Cluster, r: ActionReport, audit_problem: str | None = None) -> ActionReportOut:
    return ActionReportOut(
        id=r.id, cluster=cluster.name, idempotency_key=r.idempotency_key, operation=r.operation, policy=r.policy,
        action=r.action, location=r.location, instance=r.instance, node=r.node,
        detail=r.detail, occurred_at=r.occurred_at, received_at=r.received_at, chain_seq=r.chain_seq,
        chain_prev=r.chain_prev, chain_hash=r.chain_hash, audit_chain=r.audit_chain, audit_seq=r.audit_seq,
        audit_hash=r.audit_hash, audit_prev=r.audit_prev, audit_problem=audit_problem,
    )


def _own_cluster(session: Session, actor: Actor) -> Cluster:
    assert actor.cluster_id is not None
    cluster = session.get(Cluster, actor.cluster_id)
    assert cluster is not None
    return cluster


# ----- people and automation -----


@people.get("/me", tags=["users"], summary="Who am I (any API key or cluster token)")
def whoami(request: Request, state: StateDep, session: SessionDep, now: NowDep) -> WhoAmI:
    actor = authenticate(request, session, now, state.settings)
    session.commit()
    return WhoAmI(
        kind=actor.kind.value, name=actor.name, role=actor.role, key_id=actor.key_id,
        cluster=actor.name if actor.kind is ActorKind.CLUSTER else None,
    )


@people.post("/users", status_code=201, tags=["users"], summary="Create a user (admin)",
             openapi_extra=body_doc(UserCreate))
def create_user(
    actor: AdminDep, session: SessionDep, now: NowDep, body: Annotated[UserCreate, Depends(json_body(UserCreate))]
) -> UserOut:
    user = ops.create_user(session, now, actor, body.name, body.role)
    session.commit()
    return _user_out(user)


@people.get("/users", tags=["users"], summary="List users and their API keys (admin)")
def list_users(_: AdminDep, session: SessionDep) -> list[UserOut]:
    users = list(session.scalars(select(Principal).order_by(Principal.name)))
    session.commit()
    return [_user_out(u) for u in users]


@people.get("/users/{user}", tags=["users"], summary="One user and its API keys (admin)")
def get_user(_: AdminDep, session: SessionDep, user: UserName) -> UserOut:
    found = ops.get_user(session, user)
    session.commit()
    return _user_out(found)


@people.post("/users/{user}/keys", status_code=201, tags=["users"],
             summary="Issue an API key for a user (admin); the key is shown only in this response",
             openapi_extra=body_doc(ApiKeyCreate))
def create_api_key(
    actor: AdminDep, session: SessionDep, now: NowDep, user: UserName,
    body: Annotated[ApiKeyCreate, Depends(json_body(ApiKeyCreate))],
) -> ApiKeyIssued:
    found = ops.get_user(session, user)
    issued = ops.issue_api_key(session, now, actor, found, body.description)
    session.commit()
    return ApiKeyIssued(user=found.name, id=issued.token_id, key=issued.secret, created_at=now)


@people.post("/users/{user}/keys/{key_id}/revoke", tags=["users"], summary="Revoke an API key (admin)")
def revoke_api_key(
    actor: AdminDep, session: SessionDep, now: NowDep, user: UserName,
    key_id: Annotated[str, Path(pattern=r"^[0-9a-f]{16}$")],
) -> UserOut:
    found = ops.get_user(session, user)
    ops.revoke_api_key(session, now, actor, found, key_id)
    session.commit()
    session.refresh(found)
    return _user_out(found)


@people.post("/clusters", status_code=201, tags=["clusters"],
             summary="Register a cluster (admin); its token is shown only in this response",
             openapi_extra=body_doc(ClusterCreate))
def create_cluster(
    actor: AdminDep, session: SessionDep, now: NowDep,
    body: Annotated[ClusterCreate, Depends(json_body(ClusterCreate))],
) -> ClusterCreated:
    cluster, issued = ops.create_cluster(session, now, actor, body.name, body.description)
    session.commit()
    return ClusterCreated(
        cluster=_cluster_out(cluster, now),
        token=TokenIssued(cluster=cluster.name, token_id=issued.token_id, token=issued.secret,
                          previous_tokens_expire_at=None),
    )


@people.get("/clusters", tags=["clusters"], summary="List clusters with status and last seen (viewer)")
def list_clusters(_: ViewerDep, session: SessionDep, now: NowDep) -> list[ClusterOut]:
    clusters = list(session.scalars(select(Cluster).order_by(Cluster.name)))
    session.commit()
    return [_cluster_out(c, now) for c in clusters]


@people.get("/clusters/{cluster}", tags=["clusters"], summary="One cluster: status, last seen, tokens (viewer)")
def get_cluster(_: ViewerDep, session: SessionDep, now: NowDep, cluster: ClusterName) -> ClusterOut:
    found = ops.get_cluster(session, cluster)
    session.commit()
    return _cluster_out(found, now)


@people.post(
    "/clusters/{cluster}/token/rotate", status_code=201, tags=["clusters"],
    summary="Rotate the cluster token (admin)",
    description="Issues a new token, shown only in this response. The previous token keeps working until the new "
    "one is first used, or for 24 hours, whichever is first (R2.2). After a revocation this issues a token that "
    "reconnects the cluster.",
)
def rotate_token(actor: AdminDep, state: StateDep, session: SessionDep, now: NowDep, cluster: ClusterName
                 ) -> TokenIssued:
    found = ops.get_cluster(session, cluster, lock=True)
    issued, expires_at = ops.rotate_token(session, now, actor, found, state.settings.rotation_grace)
    session.commit()
    return TokenIssued(cluster=found.name, token_id=issued.token_id, token=issued.secret,
                       previous_tokens_expire_at=expires_at)


@people.post(
    "/clusters/{cluster}/token/revoke", tags=["clusters"], summary="Revoke the cluster's tokens (admin)",
    description="Every token of the cluster stops working at once; the cluster shows as disconnected (R2.3). "
    "Rotate to issue a new token.",
)
def revoke_token(actor: AdminDep, session: SessionDep, now: NowDep, cluster: ClusterName) -> ClusterRevoked:
    found = ops.get_cluster(session, cluster, lock=True)
    revoked = ops.revoke_tokens(session, now, actor, found)
    session.commit()
    return ClusterRevoked(cluster=_cluster_out(found, now), revoked_tokens=revoked)


@people.get("/clusters/{cluster}/policies", tags=["policies"], summary="The cluster's policies (viewer)")
def list_policies(_: ViewerDep, session: SessionDep, cluster: ClusterName) -> PolicyList:
    found = ops.get_cluster(session, cluster)
    policies = ops.list_policies(session, found)
    session.commit()
    return PolicyList(cluster=found.name, revision=found.policy_revision, policies=[_policy_out(p) for p in policies])


@people.get("/clusters/{cluster}/policies/{policy}", tags=["policies"], summary="One policy (viewer)")
def get_policy(_: ViewerDep, session: SessionDep, cluster: ClusterName, policy: PolicyName) -> PolicyOut:
    found = ops.get_policy(session, ops.get_cluster(session, cluster), policy)
    session.commit()
    return _policy_out(found)


@people.put(
    "/clusters/{cluster}/policies/{policy}", tags=["policies"],
    summary="Create or replace a policy (operator)",
    description="The body is a GpuPolicy document (`apiVersion: gpu.kubeon.io/v1`, `kind: GpuPolicy`), validated "
    "with the optimizer's own model; an invalid one is refused with 422 naming each field. `metadata.name` must "
    "equal the path. 201 when created, 200 when replaced or unchanged; a change bumps the cluster's policy-set "
    "revision, an identical document does not.",
    openapi_extra=body_doc("GpuPolicy"),
    responses={201: {"model": PolicyWritten, "description": "Created"}},
)
def put_policy(
    actor: OperatorDep, session: SessionDep, now: NowDep, response: Response, cluster: ClusterName,
    policy: PolicyName, document: Annotated[Any, Depends(read_json)],
) -> PolicyWritten:
    found = ops.get_cluster(session, cluster, lock=True)
    written = ops.put_policy(session, now, actor, found, policy, document)
    session.commit()
    response.status_code = 201 if written.created else 200
    return PolicyWritten(cluster=found.name, revision=found.policy_revision, created=written.created,
                         changed=written.changed, policy=_policy_out(written.policy))


@people.delete("/clusters/{cluster}/policies/{policy}", tags=["policies"], summary="Delete a policy (operator)")
def delete_policy(actor: OperatorDep, session: SessionDep, now: NowDep, cluster: ClusterName, policy: PolicyName
                  ) -> PolicyDeleted:
    found = ops.get_cluster(session, cluster, lock=True)
    revision = ops.delete_policy(session, now, actor, found, policy)
    session.commit()
    return PolicyDeleted(cluster=found.name, name=policy, revision=revision)


@people.post(
    "/clusters/{cluster}/approvals", tags=["approvals"], summary="Approve or reject an operation (operator)",
    description="201 when recorded; 200 when the same decision was already recorded (safe to retry); 409 when a "
    "different decision exists for the operation (decisions are final). Only an operation the cluster reported as "
    "`proposed` can be decided: 404 `operation_not_proposed` before that report arrived (the cluster sends it with "
    "its next poll: retry), 409 `operation_ended` once it was rejected, expired, withdrawn, cancelled, removed or "
    "failed.",
    openapi_extra=body_doc(ApprovalCreate), responses={201: {"model": ApprovalDecided, "description": "Recorded"}},
)
def decide(
    actor: OperatorDep, session: SessionDep, now: NowDep, response: Response, cluster: ClusterName,
    body: Annotated[ApprovalCreate, Depends(json_body(ApprovalCreate))],
) -> ApprovalDecided:
    found = ops.get_cluster(session, cluster, lock=True)
    approval, created = ops.decide(session, now, actor, found, body)
    session.commit()
    response.status_code = 201 if created else 200
    return ApprovalDecided(created=created, approval=_approval_out(found, approval))


@people.get("/clusters/{cluster}/approvals", tags=["approvals"], summary="The cluster's decisions (viewer)")
def list_approvals(
    _: ViewerDep, session: SessionDep, cluster: ClusterName, after: After = 0, limit: Limit = DEFAULT_PAGE
) -> ApprovalPage:
    found = ops.get_cluster(session, cluster)
    rows, more = ops.approvals_after(session, found, after, limit)
    session.commit()
    return ApprovalPage(cluster=found.name, approvals=[_approval_out(found, a) for a in rows],
                        cursor=rows[-1].id if rows else after, more=more)


@people.get("/clusters/{cluster}/reports", tags=["reports"], summary="The cluster's action reports (viewer)")
def list_reports(
    _: ViewerDep, session: SessionDep, cluster: ClusterName, after: After = 0, limit: Limit = DEFAULT_PAGE,
    operation: Annotated[str | None, Query(max_length=128, pattern=OPERATION_PATTERN)] = None,
) -> ActionReportPage:
    found = ops.get_cluster(session, cluster)
    query = select(ActionReport).where(ActionReport.cluster_id == found.id, ActionReport.id > after)
    if operation is not None:
        query = query.where(ActionReport.operation == operation)
    rows = list(session.scalars(query.order_by(ActionReport.id).limit(limit + 1)))
    session.commit()
    page = rows[:limit]
    return ActionReportPage(cluster=found.name, reports=[_report_out(found, r) for r in page],
                            cursor=page[-1].id if page else after, more=len(rows) > limit)


@people.get("/audit", tags=["audit"], summary="The append-only audit log, oldest first (admin)")
def audit_log(
    _: AdminDep, session: SessionDep, after: After = 0, limit: Limit = DEFAULT_PAGE,
    cluster: Annotated[str | None, Query(max_length=63, pattern=NAME_PATTERN)] = None,
    action: Annotated[str | None, Query(max_length=64, pattern=AUDIT_ACTION_PATTERN,
                                        description="e.g. token.rotated")] = None,
) -> AuditPage:
    query = select(AuditEvent).where(AuditEvent.id > after)
    if cluster is not None:
        query = query.where(AuditEvent.cluster == cluster)
    if action is not None:
        query = query.where(AuditEvent.action == action)
    rows = list(session.scalars(query.order_by(AuditEvent.id).limit(limit + 1)))
    session.commit()
    page = rows[:limit]
    return AuditPage(
        events=[
            AuditEventOut(id=e.id, at=e.at, actor=e.actor, actor_key_id=e.actor_key_id, action=e.action,
                          cluster=e.cluster, target=e.target, detail=e.detail, chain_seq=e.chain_seq,
                          chain_prev=e.chain_prev, chain_hash=e.chain_hash)
            for e in page
        ],
        cursor=page[-1].id if page else after, more=len(rows) > limit,
    )


@people.get(
    "/audit/chains", tags=["audit"], summary="The heads of the audit hash chains (admin)",
    description="The last record of each of the hub's chains (the audit log and the action reports, one chain per "
    "cluster, and the hub's own for events of no cluster) and the head of each worker audit log as its cluster "
    "reported it, with the first record that did not fit. `kubeon-gpu audit verify --hub` checks the chains "
    "against them.",
)
def audit_chains(_: AdminDep, session: SessionDep) -> AuditChains:
    heads = list(session.scalars(select(AuditChainHead).order_by(AuditChainHead.log, AuditChainHead.chain)))
    reported = session.execute(select(ReportedAuditHead, Cluster.name).join(
        Cluster, Cluster.id == ReportedAuditHead.cluster_id).order_by(Cluster.name, ReportedAuditHead.id)).all()
    session.commit()
    return AuditChains(
        chains=[ChainHeadOut(log=h.log, chain=h.chain, seq=h.seq, hash=h.hash, updated_at=h.updated_at)
                for h in heads],
        reported=[ReportedHeadOut(cluster=name, chain=h.chain, seq=h.seq, hash=h.hash, first_seq=h.first_seq,
                                  reports=h.reports, first_reported_at=h.first_reported_at,
                                  reported_at=h.reported_at, problem=h.problem, problem_at=h.problem_at)
                  for h, name in reported],
    )


# ----- the optimizer's side: a cluster token, its own cluster only -----


@clusters_api.get("", summary="The calling cluster: name, token id, policy revision")
def cluster_info(actor: ClusterDep, session: SessionDep) -> ClusterInfo:
    cluster = _own_cluster(session, actor)
    session.commit()
    assert actor.key_id is not None
    return ClusterInfo(cluster=cluster.name, token_id=actor.key_id, policy_revision=cluster.policy_revision)


@clusters_api.get(
    "/policies", summary="Pull the cluster's policies (conditional)",
    description="All GpuPolicy documents of the calling cluster, sorted by name, with the policy-set revision. "
    "Send the ETag back in `If-None-Match`: 304 with an empty body while nothing changed.",
    response_model=ClusterPolicySet, responses={304: {"description": "Not modified"}},
)
def pull_policies(actor: ClusterDep, session: SessionDep, if_none_match: IfNoneMatch = None) -> Response:
    cluster = _own_cluster(session, actor)
    etag = ops.policy_etag(cluster)
    if _etag_matches(if_none_match, etag):
        session.commit()
        return Response(status_code=304, headers={"ETag": etag})
    policies = ops.list_policies(session, cluster)
    session.commit()
    body = ClusterPolicySet(cluster=cluster.name, revision=cluster.policy_revision, etag=etag,
                            policies=[p.document for p in policies])
    return _with_etag(body, etag)


@clusters_api.get(
    "/approvals", summary="Pull decisions after a cursor (conditional)",
    description="Approvals and rejections of the calling cluster's operations with id > `after`, oldest first. "
    "Keep `cursor` and pass it as `after` next time. `If-None-Match` with the last ETag: 304 when nothing new.",
    response_model=ApprovalPage, responses={304: {"description": "Not modified"}},
)
def pull_approvals(
    actor: ClusterDep, session: SessionDep, after: After = 0, limit: Limit = DEFAULT_PAGE,
    if_none_match: IfNoneMatch = None,
) -> Response:
    cluster = _own_cluster(session, actor)
    etag = ops.approvals_etag(session, cluster, after, limit)
    if _etag_matches(if_none_match, etag):
        session.commit()
        return Response(status_code=304, headers={"ETag": etag})
    rows, more = ops.approvals_after(session, cluster, after, limit)
    session.commit()
    page = ApprovalPage(cluster=cluster.name, approvals=[_approval_out(cluster, a) for a in rows],
                        cursor=rows[-1].id if rows else after, more=more)
    return _with_etag(page, etag)


@clusters_api.post(
    "/reports", summary="Report an action (idempotent)",
    description="201 with the stored report when new; 200 with the same stored report when this cluster already "
    "sent this `idempotency_key` with the same content (stored once); 409 when the key was used for a different "
    "report. A report with a `location` is also written to the audit log. A report may name its audit record's "
    "place in the worker's audit log (`audit_chain`, `audit_seq`, `audit_hash`, `audit_prev`): the hub records "
    "the head and, when the record does not follow what it has of that log, stores the report anyway, writes "
    "`audit.chain_broken` to the audit log and says why in `audit_problem`.",
    openapi_extra=body_doc(ActionReportCreate),
    responses={201: {"model": ActionReportOut, "description": "Stored"}},
)
def post_report(
    actor: ClusterDep, session: SessionDep, now: NowDep, response: Response,
    body: Annotated[ActionReportCreate, Depends(json_body(ActionReportCreate))],
) -> ActionReportOut:
    cluster = _own_cluster(session, actor)
    added = ops.add_report(session, now, actor, cluster, body)
    session.commit()
    response.status_code = 201 if added.created else 200
    return _report_out(cluster, added.report, added.audit_problem)


def _with_etag(model: ClusterPolicySet | ApprovalPage, etag: str) -> Response:
    return Response(content=model.model_dump_json(), media_type="application/json", headers={"ETag": etag})


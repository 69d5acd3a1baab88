"""What the hub does, independent of HTTP: used by the API and by the dev seed. Callers commit."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from datetime import timedelta
from typing import Any
from typing import Final

from sqlalchemy import func
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from hub import chain
from hub import tokens
from hub.audit import Actor
from hub.audit import ActorKind
from hub.audit import AuditAction
from hub.audit import Role
from hub.audit import record
from hub.db import ActionReport
from hub.db import ApiKey
from hub.db import Approval
from hub.db import Cluster
from hub.db import ClusterToken
from hub.db import Policy
from hub.db import Principal
from hub.errors import Conflict
from hub.errors import NotFound
from hub.errors import Unauthorized
from hub.errors import Unprocessable
from hub.plans import parse_plan
from hub.schemas import ActionReportCreate
from hub.schemas import ApprovalCreate
from hub.schemas import ClusterStatus
from hub.schemas import TokenState
from hub.schemas import disallowed_character
from hub.tokens import IssuedToken
from hub.tokens import TokenKind
from models.policy import PolicyError
from models.policy import parse_policy

VALID_TOKEN_STATES: Final = ("active", "expiring")
# Reports after which an operation takes no decision any more.
ENDED_ACTIONS: Final = frozenset({"rejected", "expired", "withdrawn", "cancelled", "removed", "failed"})
_METADATA_KEPT: Final = ("name", "labels", "annotations")


# ----- users and API keys -----


def get_user(session: Session, name: str) -> Principal:
    user = session.scalar(select(Principal).where(Principal.name == name))
    if user is None:
        raise NotFound(f"user {name!r} not found", code="user_not_found")
    return user


def create_user(session: Session, now: datetime, actor: Actor, name: str, role: Role) -> Principal:
    if session.scalar(select(Principal.id).where(Principal.name == name)) is not None:
        raise Conflict(f"user {name!r} already exists", code="user_exists")
    user = Principal(name=name, role=role.value, created_at=now, created_by=actor.label)
    session.add(user)
    session.flush()
    record(session, at=now, actor=actor, action=AuditAction.USER_CREATED, target=name, detail={"role": role.value})
    return user


def issue_api_key(
    session: Session, now: datetime, actor: Actor, user: Principal, description: str = "",
    existing: IssuedToken | None = None,
) -> IssuedToken:
    issued = existing or tokens.issue(TokenKind.API_KEY)
    key = ApiKey(
        key_id=issued.token_id, principal_id=user.id, digest=issued.digest, description=description,
        created_at=now, created_by=actor.label,
    )
    session.add(key)
    session.flush()
    record(
        session, at=now, actor=actor, action=AuditAction.API_KEY_CREATED, target=user.name,
        detail={"key_id": issued.token_id, "description": description},
    )
    return issued


def revoke_api_key(session: Session, now: datetime, actor: Actor, user: Principal, key_id: str) -> ApiKey:
    key = session.scalar(select(ApiKey).where(ApiKey.key_id == key_id, ApiKey.principal_id == user.id))
    if key is None:
        raise NotFound(f"user {user.name!r} has no API key {key_id!r}", code="api_key_not_found")
    if key.revoked_at is None:
        key.revoked_at = now
        key.revoked_by = actor.label
        record(session, at=now, actor=actor, action=AuditAction.API_KEY_REVOKED, target=user.name,
               detail={"key_id": key_id})
    return key


# ----- clusters and tokens -----


def get_cluster(session: Session, name: str, *, lock: bool = False) -> Cluster:
    query = select(Cluster).where(Cluster.name == name)
    if lock:
        query = query.with_for_update()
    cluster = session.scalar(query)
    if cluster is None:
        raise NotFound(f"cluster {name!r} not found", code="cluster_not_found")
    return cluster


def token_state(token: ClusterToken, now: datetime) -> TokenState:
    if token.revoked_at is not None:
        return "superseded" if token.revoked_reason == "superseded" else "revoked"
    if token.expires_at is not None:
        return "expiring" if now < token.expires_at else "expired"
    return "active"


def cluster_status(cluster: Cluster, now: datetime) -> ClusterStatus:
    if not any(token_state(t, now) in VALID_TOKEN_STATES for t in cluster.tokens):
        return "disconnected"
    seen = cluster.last_seen_at
    if seen is None or (cluster.revoked_at is not None and seen <= cluster.revoked_at):
        return "pending"
    return "connected"


def create_cluster(
    session: Session, now: datetime, actor: Actor, name: str, description: str = "",
    existing_token: IssuedToken | None = None,
) -> tuple[Cluster, IssuedToken]:
    if session.scalar(select(Cluster.id).where(Cluster.name == name)) is not None:
        raise Conflict(f"cluster {name!r} already exists", code="cluster_exists")
    cluster = Cluster(
        uid=uuid.uuid4().hex, name=name, description=description, created_at=now, created_by=actor.label,
        policy_revision=0,
    )
    session.add(cluster)
    session.flush()
    record(session, at=now, actor=actor, action=AuditAction.CLUSTER_CREATED, cluster=name, target=name)
    issued = _add_token(session, now, actor, cluster, existing_token)
    record(session, at=now, actor=actor, action=AuditAction.TOKEN_CREATED, cluster=name, target=name,
           detail={"token_id": issued.token_id})
    return cluster, issued


def _add_token(
    session: Session, now: datetime, actor: Actor, cluster: Cluster, existing: IssuedToken | None
) -> IssuedToken:
    issued = existing or tokens.issue(TokenKind.CLUSTER)
    token = ClusterToken(
        token_id=issued.token_id, cluster_id=cluster.id, digest=issued.digest, created_at=now, created_by=actor.label
    )
    session.add(token)
    session.flush()
    session.refresh(cluster, ["tokens"])
    return issued


def rotate_token(
    session: Session, now: datetime, actor: Actor, cluster: Cluster, grace: timedelta,
    existing: IssuedToken | None = None,
) -> tuple[IssuedToken, datetime | None]:
    """Issue a new token. The still-valid old ones keep working until the new one is first used, or ``grace``.
    After a revocation (no valid token left) this simply issues a token and reconnects the cluster."""
    valid = [t for t in cluster.tokens if token_state(t, now) in VALID_TOKEN_STATES]
    expires_at = now + grace if valid else None
    for old in valid:
        old.expires_at = expires_at if old.expires_at is None else min(old.expires_at, now + grace)
    issued = _add_token(session, now, actor, cluster, existing)
    if valid:
        record(
            session, at=now, actor=actor, action=AuditAction.TOKEN_ROTATED, cluster=cluster.name,
            target=cluster.name,
            detail={
                "token_id": issued.token_id,
                "previous_token_ids": [t.token_id for t in valid],
                "previous_tokens_expire_at": expires_at.isoformat() if expires_at else None,
            },
        )
    else:
        record(session, at=now, actor=actor, action=AuditAction.TOKEN_CREATED, cluster=cluster.name,
               target=cluster.name, detail={"token_id": issued.token_id, "after_revocation": True})
    return issued, expires_at


def revoke_tokens(session: Session, now: datetime, actor: Actor, cluster: Cluster) -> list[str]:
    """R2.3: every token of the cluster stops working at once; the cluster shows as disconnected."""
    revoked = [t for t in cluster.tokens if t.revoked_at is None]
    for token in revoked:
        token.revoked_at = now
        token.revoked_by = actor.label
        token.revoked_reason = "revoked"
    cluster.revoked_at = now
    record(session, at=now, actor=actor, action=AuditAction.TOKEN_REVOKED, cluster=cluster.name,
           target=cluster.name, detail={"token_ids": [t.token_id for t in revoked]})
    return [t.token_id for t in revoked]


# ----- authentication -----


def authenticate_cluster(session: Session, now: datetime, presented: tokens.ParsedToken) -> Actor:
    token = session.scalar(select(ClusterToken).where(ClusterToken.token_id == presented.token_id))
    if token is None or not tokens.matches(presented.token, token.digest):
        raise Unauthorized("invalid cluster token: unknown or wrong secret")
    state = token_state(token, now)
    cluster = token.cluster
    if state == "revoked":
        raise Unauthorized(
            f"cluster token {token.token_id} of cluster {cluster.name!r} was revoked at "
            f"{_iso(token.revoked_at)} by {token.revoked_by}", code="token_revoked")
    if state == "superseded":
        raise Unauthorized(
            f"cluster token {token.token_id} of cluster {cluster.name!r} was replaced by a rotation and the new "
            f"token has been in use since {_iso(token.revoked_at)}", code="token_superseded")
    if state == "expired":
        raise Unauthorized(
            f"cluster token {token.token_id} of cluster {cluster.name!r} expired at {_iso(token.expires_at)} "
            "(it was replaced by a rotation)", code="token_expired")
    actor = Actor(kind=ActorKind.CLUSTER, name=cluster.name, key_id=token.token_id, cluster_id=cluster.id)
    if token.first_used_at is None:
        token.first_used_at = now
        older = [t for t in cluster.tokens if t.id < token.id and t.revoked_at is None]
        for old in older:
            expired = token_state(old, now) == "expired"
            old.revoked_at = now
            old.revoked_by = actor.label
            old.revoked_reason = "superseded"
            if not expired:
                record(session, at=now, actor=actor, action=AuditAction.TOKEN_SUPERSEDED, cluster=cluster.name,
                       target=cluster.name, detail={"token_id": old.token_id, "by_token_id": token.token_id})
    token.last_used_at = now
    cluster.last_seen_at = now
    return actor


def authenticate_api_key(session: Session, now: datetime, presented: tokens.ParsedToken) -> Actor:
    key = session.scalar(select(ApiKey).where(ApiKey.key_id == presented.token_id))
    if key is None or not tokens.matches(presented.token, key.digest):
        raise Unauthorized("invalid API key: unknown or wrong secret")
    if key.revoked_at is not None:
        raise Unauthorized(
            f"API key {key.key_id} of user {key.principal.name!r} was revoked at {_iso(key.revoked_at)} by "
            f"{key.revoked_by}", code="api_key_revoked")
    key.last_used_at = now
    return Actor(kind=ActorKind.USER, name=key.principal.name, key_id=key.key_id, role=Role(key.principal.role))


def _iso(value: datetime | None) -> str:
    return value.isoformat() if value else "?"


# ----- policies -----


@dataclass(frozen=True)
class PolicyWrite:
    policy: Policy
    created: bool
    changed: bool


def normalize_policy(name: str, document: Any) -> dict[str, Any]:
    """Validate with the optimizer's own model; return the stored form (camelCase, no status, metadata reduced
    to name, labels and annotations so it can be applied to any cluster). Raises ``Unprocessable``."""
    try:
        policy = parse_policy(document)
    except PolicyError as exc:
        # An unknown key "" at the top has the empty path: name the document instead.
        details = [(f or "(document)", m) for f, m in exc.errors]
        raise Unprocessable(f"invalid GpuPolicy: {exc}", details=details, code="invalid_policy") from None
    if policy.name != name:
        raise Unprocessable(
            f"invalid GpuPolicy: metadata.name {policy.name!r} does not match {name!r} in the path",
            details=[("metadata.name", f"must equal the name in the path ({name!r})")], code="invalid_policy",
        )
    doc = policy.model_dump(mode="json", by_alias=True, exclude_unset=True, exclude={"status"})
    doc["metadata"] = {k: v for k, v in doc["metadata"].items() if k in _METADATA_KEPT and v is not None}
    problems = list(_disallowed_in(doc, ""))
    if problems:
        raise Unprocessable("invalid GpuPolicy: " + "; ".join(f"{f}: {m}" for f, m in problems), details=problems,
                            code="invalid_policy")
    return doc


def _disallowed_in(value: Any, path: str) -> Iterator[tuple[str, str]]:
    """Every text of a stored document (keys too) holding a character the hub refuses, as (field, why)."""
    if isinstance(value, str):
        problem = disallowed_character(value)
        if problem:
            yield path or "(document)", problem
    elif isinstance(value, dict):
        for key, item in value.items():
            where = f"{path}.{key}" if path else str(key)
            problem = disallowed_character(str(key), multi_line=False)
            if problem:
                yield f"{path or '(document)'} key {key!r}", problem
                continue
            yield from _disallowed_in(item, where)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _disallowed_in(item, f"{path}[{index}]")


def put_policy(session: Session, now: datetime, actor: Actor, cluster: Cluster, name: str, document: Any
               ) -> PolicyWrite:
    doc = normalize_policy(name, document)
    policy = session.scalar(select(Policy).where(Policy.cluster_id == cluster.id, Policy.name == name))
    if policy is not None and policy.document == doc:
        return PolicyWrite(policy=policy, created=False, changed=False)
    cluster.policy_revision += 1
    revision = cluster.policy_revision
    created = policy is None
    if policy is None:
        policy = Policy(cluster_id=cluster.id, name=name, document=doc, created_at=now, created_by=actor.label,
                        updated_at=now, updated_by=actor.label, revision=revision)
        session.add(policy)
    else:
        policy.document = doc
        policy.updated_at = now
        policy.updated_by = actor.label
        policy.revision = revision
    session.flush()
    record(
        session, at=now, actor=actor,
        action=AuditAction.POLICY_CREATED if created else AuditAction.POLICY_CHANGED,
        cluster=cluster.name, target=name, detail={"revision": revision, "document": doc},
    )
    return PolicyWrite(policy=policy, created=created, changed=True)


def get_policy(session: Session, cluster: Cluster, name: str) -> Policy:
    policy = session.scalar(select(Policy).where(Policy.cluster_id == cluster.id, Policy.name == name))
    if policy is None:
        raise NotFound(f"cluster {cluster.name!r} has no policy {name!r}", code="policy_not_found")
    return policy


def delete_policy(session: Session, now: datetime, actor: Actor, cluster: Cluster, name: str) -> int:
    policy = get_policy(session, cluster, name)
    session.delete(policy)
    cluster.policy_revision += 1
    record(session, at=now, actor=actor, action=AuditAction.POLICY_DELETED, cluster=cluster.name, target=name,
           detail={"revision": cluster.policy_revision})
    return cluster.policy_revision


def list_policies(session: Session, cluster: Cluster) -> list[Policy]:
    return list(session.scalars(select(Policy).where(Policy.cluster_id == cluster.id).order_by(Policy.name)))


def policy_etag(cluster: Cluster) -> str:
    return f'"{cluster.uid[:16]}.{cluster.policy_revision}"'


# ----- approvals -----


def decide(session: Session, now: datetime, actor: Actor, cluster: Cluster, req: ApprovalCreate
           ) -> tuple[Approval, bool]:
    """Record a decision. The same decision again returns the stored one; a different one is a conflict. A
    decision bound to a plan other than the one the cluster proposes now is refused as stale."""
    if req.plan_id is not None:
        _check_plan_current(session, cluster, req.operation, req.plan_id)
    existing = session.scalar(
        select(Approval).where(Approval.cluster_id == cluster.id, Approval.operation == req.operation)
    )
    if existing is not None:
        if existing.decision == req.decision and existing.plan_id == req.plan_id:
            return existing, False
        raise Conflict(
            f"operation {req.operation!r} of cluster {cluster.name!r} was already decided: {existing.decision} "
            f"by {existing.decided_by} at {_iso(existing.decided_at)}", code="already_decided")
    _check_decidable(session, cluster, req.operation)
    approval = Approval(
        cluster_id=cluster.id, operation=req.operation, decision=req.decision, plan_id=req.plan_id,
        reason=req.reason, decided_by=actor.label, decided_at=now,
    )
    session.add(approval)
    session.flush()
    record(
        session, at=now, actor=actor,
        action=AuditAction.OPERATION_APPROVED if req.decision == "approve" else AuditAction.OPERATION_REJECTED,
        cluster=cluster.name, target=req.operation,
        detail={"approval_id": approval.id, "plan_id": req.plan_id, "reason": req.reason},
    )
    return approval, True


def current_proposal(session: Session, cluster: Cluster, operation: str) -> ActionReport | None:
    """The operation's latest ``proposed`` report: the plan a decision applies to."""
    return session.scalar(
        select(ActionReport)
        .where(ActionReport.cluster_id == cluster.id, ActionReport.operation == operation,
               ActionReport.action == "proposed")
        .order_by(ActionReport.id.desc()).limit(1)
    )


def _check_plan_current(session: Session, cluster: Cluster, operation: str, plan_id: str) -> None:
    """409 ``stale_plan`` when the cluster's latest proposal of ``operation`` names another plan (a page or a
    script still showing the old one). A proposal whose detail names no plan cannot be stale."""
    proposal = current_proposal(session, cluster, operation)
    plan = parse_plan(proposal.detail) if proposal is not None else None
    if plan is not None and plan.plan_id != plan_id:
        raise Conflict(
            f"plan {plan_id!r} is stale: cluster {cluster.name!r} now proposes plan {plan.plan_id!r} for operation "
            f"{operation!r} (reported {_iso(proposal.occurred_at if proposal else None)})"
            + (f": {plan.summary}" if plan.summary else ""),
            details=[("plan_id", f"stale: the current plan is {plan.plan_id!r}")], code="stale_plan",
        )


def _check_decidable(session: Session, cluster: Cluster, operation: str) -> None:
    """A decision is recorded only for an operation the cluster reported as ``proposed`` and not yet ended: one
    nothing could act on would otherwise stay in the hub for good. 404 before the proposal has arrived (the
    cluster delivers reports every poll: retry after it), 409 once the operation ended."""
    reports = session.execute(
        select(ActionReport.action, ActionReport.occurred_at)
        .where(ActionReport.cluster_id == cluster.id, ActionReport.operation == operation)
        .order_by(ActionReport.id)
    ).all()
    if not any(action == "proposed" for action, _ in reports):
        raise NotFound(
            f"cluster {cluster.name!r} has not proposed operation {operation!r}: only an operation the cluster "
            "reported as proposed can be approved or rejected (a new proposal arrives with the cluster's next "
            "poll; retry then)",
            details=[("operation", f"no 'proposed' report of {operation!r} from cluster {cluster.name!r}")],
            code="operation_not_proposed",
        )
    ended = next(((a, at) for a, at in reversed(reports) if a in ENDED_ACTIONS), None)
    if ended is not None:
        raise Conflict(
            f"operation {operation!r} of cluster {cluster.name!r} has already ended ({ended[0]} at "
            f"{_iso(ended[1])}): a decision could not act on it",
            details=[("operation", f"ended: {ended[0]}")], code="operation_ended",
        )


def approvals_after(session: Session, cluster: Cluster, after: int, limit: int) -> tuple[list[Approval], bool]:
    rows = list(session.scalars(
        select(Approval).where(Approval.cluster_id == cluster.id, Approval.id > after)
        .order_by(Approval.id).limit(limit + 1)
    ))
    return rows[:limit], len(rows) > limit


def approvals_etag(session: Session, cluster: Cluster, after: int, limit: int) -> str:
    last = session.scalar(select(func.max(Approval.id)).where(Approval.cluster_id == cluster.id)) or 0
    return f'"{cluster.uid[:16]}.a{last}.{after}.{limit}"'


# ----- action reports -----


def _same_report(row: ActionReport, req: ActionReportCreate) -> bool:
    return (
        row.operation, row.policy, row.action, row.location, row.instance, row.node, row.detail, row.occurred_at,
    ) == (req.operation, req.policy, req.action, req.location, req.instance, req.node, req.detail, req.occurred_at)


@dataclass(frozen=True)
class ReportAdded:
    report: ActionReport
    created: bool
    # The report's audit record does not fit the cluster's audit log as the hub has it (hub/chain.py): why.
    audit_problem: str | None = None


def add_report(session: Session, now: datetime, actor: Actor, cluster: Cluster, req: ActionReportCreate
               ) -> ReportAdded:
    """Store a report once per idempotency key, and check its audit record's place in the cluster's audit log
    chain (for a new report and a repeated one alike: another replica's log may hold the same record)."""
    chain.lock_cluster(session, cluster.name)  # appends to the cluster's chains are serial from here to commit
    report, created = _store_report(session, now, actor, cluster, req)
    problem = None
    if req.audit_chain is not None:
        assert req.audit_seq is not None and req.audit_hash is not None and req.audit_prev is not None
        problem = chain.observe_report(session, now, cluster, req.idempotency_key, req.audit_chain, req.audit_seq,
                                       req.audit_hash, req.audit_prev)
        # Written once per record: a retried delivery of the same report gets the answer, not a second event.
        if problem is not None and (created or (report.audit_chain, report.audit_seq) != (req.audit_chain,
                                                                                          req.audit_seq)):
            record(session, at=now, actor=actor, action=AuditAction.AUDIT_CHAIN_BROKEN, cluster=cluster.name,
                   target=req.idempotency_key,
                   detail={"report_id": report.id, "audit_chain": req.audit_chain, "audit_seq": req.audit_seq,
                           "audit_hash": req.audit_hash, "audit_prev": req.audit_prev, "problem": problem})
    return ReportAdded(report=report, created=created, audit_problem=problem)


def _store_report(session: Session, now: datetime, actor: Actor, cluster: Cluster, req: ActionReportCreate
                  ) -> tuple[ActionReport, bool]:
    """Store a report once per idempotency key. Returns (report, created)."""

    def existing() -> ActionReport | None:
        return session.scalar(select(ActionReport).where(
            ActionReport.cluster_id == cluster.id, ActionReport.idempotency_key == req.idempotency_key))

    def same_or_conflict(row: ActionReport) -> tuple[ActionReport, bool]:
        if _same_report(row, req):
            return row, False
        raise Conflict(
            f"idempotency key {req.idempotency_key!r} was already used (report {row.id}, received "
            f"{_iso(row.received_at)}) for a different report; use a new key for a new report",
            details=[("idempotency_key", "already used for a different report")], code="idempotency_key_reused")

    row = existing()
    if row is not None:
        return same_or_conflict(row)
    report = ActionReport(
        cluster_id=cluster.id, idempotency_key=req.idempotency_key, operation=req.operation, policy=req.policy,
        action=req.action, location=req.location, instance=req.instance, node=req.node, detail=req.detail,
        occurred_at=req.occurred_at, received_at=now, audit_chain=req.audit_chain, audit_seq=req.audit_seq,
        audit_hash=req.audit_hash, audit_prev=req.audit_prev,
    )
    try:
        with session.begin_nested():
            session.add(report)
    except IntegrityError:  # the same key arrived concurrently
        row = existing()
        if row is None:
            raise
        return same_or_conflict(row)
    if req.location is not None:
        record(
            session, at=now, actor=actor, action=AuditAction.BURST_NODE_LOCATION, cluster=cluster.name,
            target=req.node or req.instance or req.operation,
            detail={
                "report_id": report.id, "operation": req.operation, "policy": req.policy, "action": req.action,
                "location": req.location, "instance": req.instance, "node": req.node,
                "occurred_at": req.occurred_at.isoformat(),
            },
        )
    return report, True

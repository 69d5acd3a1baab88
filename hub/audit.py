"""Who acts (``Actor``) and the append-only audit log (each event chained as it is stored: ``hub/chain.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any

from sqlalchemy.orm import Session

from hub.db import AuditEvent


class Role(StrEnum):
    """What a person's or automation's API keys may do. Each role includes the ones below it."""

    VIEWER = "viewer"  # read clusters, policies, approvals, reports
    OPERATOR = "operator"  # + write policies, approve/reject operations
    ADMIN = "admin"  # + users, API keys, clusters and their tokens, the audit log

    def allows(self, needed: Role) -> bool:
        order = [Role.VIEWER, Role.OPERATOR, Role.ADMIN]
        return order.index(self) >= order.index(needed)


class ActorKind(StrEnum):
    USER = "user"
    CLUSTER = "cluster"
    BOOTSTRAP = "bootstrap"  # the bootstrap admin key
    SEED = "seed"  # the local-dev seed file


@dataclass(frozen=True)
class Actor:
    kind: ActorKind
    name: str
    key_id: str | None = None  # the API key or cluster token used
    role: Role | None = None  # people and automation only
    cluster_id: int | None = None  # cluster tokens only

    @property
    def label(self) -> str:
        return f"{self.kind.value}:{self.name}"


BOOTSTRAP_ACTOR = Actor(kind=ActorKind.BOOTSTRAP, name="admin", role=Role.ADMIN)
SEED_ACTOR = Actor(kind=ActorKind.SEED, name="seed-file", role=Role.ADMIN)


class AuditAction(StrEnum):
    USER_CREATED = "user.created"
    API_KEY_CREATED = "api_key.created"
    API_KEY_REVOKED = "api_key.revoked"
    CLUSTER_CREATED = "cluster.created"
    TOKEN_CREATED = "token.created"
    TOKEN_ROTATED = "token.rotated"
    TOKEN_SUPERSEDED = "token.superseded"  # the old token retired by the new one's first use
    TOKEN_REVOKED = "token.revoked"
    POLICY_CREATED = "policy.created"
    POLICY_CHANGED = "policy.changed"
    POLICY_DELETED = "policy.deleted"
    OPERATION_APPROVED = "operation.approved"
    OPERATION_REJECTED = "operation.rejected"
    BURST_NODE_LOCATION = "burst_node.location_reported"
    # A report's audit record does not fit the cluster's audit log chain as the hub has it (hub/chain.py).
    AUDIT_CHAIN_BROKEN = "audit.chain_broken"


def record(
    session: Session,
    *,
    at: datetime,
    actor: Actor,
    action: AuditAction,
    cluster: str | None = None,
    target: str | None = None,
    detail: dict[str, Any] | None = None,
) -> AuditEvent:
    event = AuditEvent(
        at=at,
        actor=actor.label,
        actor_key_id=actor.key_id,
        action=action.value,
        cluster=cluster,
        target=target,
        detail=detail or {},
    )
    session.add(event)
    return event

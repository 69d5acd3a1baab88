"""Request and response bodies of the hub API (snake_case JSON; GpuPolicy documents keep Kubernetes camelCase)."""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated
from typing import Any
from typing import Final
from typing import Literal
from typing import get_args

from pydantic import AfterValidator
from pydantic import AwareDatetime
from pydantic import BaseModel
from pydantic import ConfigDict
from pydantic import Field
from pydantic import StrictInt
from pydantic import StrictStr
from pydantic import model_validator

from hub.audit import Role
from models.audit_chain import CHAIN_ID_PATTERN
from models.audit_chain import HASH_PATTERN
from models.hub import ReportAction
from models.policy import RESOURCE_NAME_PATTERN
from models.policy import LocationName

NAME_PATTERN: Final = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
OPERATION_PATTERN: Final = r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$"
KEY_PATTERN: Final = r"^[\x21-\x7e]+$"  # printable ASCII, no spaces
# Ids (cursors) are 32-bit on every database the hub runs on (PostgreSQL `integer`); a larger cursor is refused.
MAX_ID: Final = 2**31 - 1
AUDIT_ACTION_PATTERN: Final = r"^[a-z][a-z0-9_.]*$"

# Refused in every text the hub stores or filters by, on SQLite and PostgreSQL alike: C0 controls (NUL among
# them: PostgreSQL text cannot hold it) and DEL/C1 controls, and lone UTF-16 surrogates (not encodable as UTF-8).
# Multi-line texts (reasons, report details) may hold tab, newline and carriage return; one-line texts a tab.
_MULTI_LINE_DISALLOWED: Final = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\ud800-\udfff]")
_ONE_LINE_DISALLOWED: Final = re.compile("[\x00-\x08\x0a-\x1f\x7f-\x9f\ud800-\udfff]")


def disallowed_character(value: str, *, multi_line: bool = True) -> str | None:
    """Why ``value`` cannot be stored (naming the first bad character and its position), or None."""
    found = (_MULTI_LINE_DISALLOWED if multi_line else _ONE_LINE_DISALLOWED).search(value)
    if found is None:
        return None
    return f"must not contain the control character U+{ord(found.group()):04X} (at position {found.start()})"


def _multi_line(value: str) -> str:
    problem = disallowed_character(value)
    if problem:
        raise ValueError(problem)
    return value


def _one_line(value: str) -> str:
    problem = disallowed_character(value, multi_line=False)
    if problem:
        raise ValueError(problem)
    return value


Text = Annotated[StrictStr, AfterValidator(_multi_line)]
Line = Annotated[StrictStr, AfterValidator(_one_line)]

Name = Annotated[StrictStr, Field(min_length=1, max_length=63, pattern=NAME_PATTERN)]
PolicyName = Annotated[StrictStr, Field(min_length=1, max_length=253, pattern=RESOURCE_NAME_PATTERN)]
OperationId = Annotated[StrictStr, Field(min_length=1, max_length=128, pattern=OPERATION_PATTERN)]
# R2.8's actions plus the other ends an operation can have (rejected, expired, withdrawn, cancelled) and a hold.
Action = ReportAction
ACTIONS: Final[tuple[str, ...]] = get_args(Action)
Decision = Literal["approve", "reject"]
ClusterStatus = Literal["pending", "connected", "disconnected"]
TokenState = Literal["active", "expiring", "superseded", "expired", "revoked"]


class _In(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Out(BaseModel):
    model_config = ConfigDict(from_attributes=True)


# ----- requests -----


class UserCreate(_In):
    name: Name = Field(description="lowercase DNS label; shown in the audit log as `user:<name>`")
    role: Role = Field(description="viewer < operator < admin")


class ApiKeyCreate(_In):
    description: Annotated[Line, Field(max_length=200)] = ""


class ClusterCreate(_In):
    name: Name
    description: Annotated[Line, Field(max_length=200)] = ""


class ApprovalCreate(_In):
    operation: OperationId = Field(description="the operation id, e.g. `op-1a2b3c4d5e6f`")
    decision: Decision
    plan_id: Annotated[Line, Field(min_length=1, max_length=128)] | None = Field(
        default=None, description="approve this plan only; the optimizer refuses a stale approval of an older plan"
    )
    reason: Annotated[Text, Field(max_length=2000)] = ""


class ActionReportCreate(_In):
    idempotency_key: Annotated[StrictStr, Field(min_length=1, max_length=200, pattern=KEY_PATTERN)] = Field(
        description="unique per report of this cluster; a retry with the same key and content is stored once"
    )
    operation: OperationId
    policy: PolicyName
    action: Action
    location: LocationName | None = Field(default=None, description="`<provider>/<region or pool>` of the node")
    instance: Annotated[Line, Field(min_length=1, max_length=253)] | None = None
    node: Annotated[Line, Field(min_length=1, max_length=253)] | None = None
    detail: Annotated[Text, Field(max_length=8192)] = ""
    occurred_at: AwareDatetime = Field(description="RFC 3339 with a time zone, e.g. `2025-01-31T12:00:00Z`")
    audit_chain: Annotated[StrictStr, Field(pattern=CHAIN_ID_PATTERN)] | None = Field(
        default=None, description="the ID of the worker's audit log (its hash chain) that holds this report's record")
    audit_seq: Annotated[StrictInt, Field(ge=1, le=MAX_ID)] | None = Field(
        default=None, description="the record's place in that chain")
    audit_hash: Annotated[StrictStr, Field(pattern=HASH_PATTERN)] | None = Field(
        default=None, description="the record's hash (sha256 hex of its canonical JSON)")
    audit_prev: Annotated[StrictStr, Field(pattern=HASH_PATTERN)] | None = Field(
        default=None, description="the hash of the record before it in the chain")

    @model_validator(mode="after")
    def _all_audit_fields_or_none(self) -> ActionReportCreate:
        given = [f for f in AUDIT_FIELDS if getattr(self, f) is not None]
        if given and len(given) != len(AUDIT_FIELDS):
            missing = ", ".join(f for f in AUDIT_FIELDS if f not in given)
            raise ValueError(f"the audit record's chain fields come together: {missing} missing")
        return self


AUDIT_FIELDS: Final = ("audit_chain", "audit_seq", "audit_hash", "audit_prev")


# ----- responses -----


class WhoAmI(BaseModel):
    kind: Literal["user", "bootstrap", "cluster", "seed"]
    name: str
    role: Role | None
    key_id: str | None
    cluster: str | None


class CredentialOut(BaseModel):
    """An issued secret (a person's API key, a pool's join token) as listed: its public id, who made it, when it
    was last used, and whether it was revoked, when and by whom."""

    id: str
    created_at: datetime
    created_by: str
    last_used_at: datetime | None
    revoked_at: datetime | None
    revoked_by: str | None
    active: bool


class ApiKeyOut(_Out, CredentialOut):
    description: str


class UserOut(BaseModel):
    name: str
    role: Role
    created_at: datetime
    created_by: str
    keys: list[ApiKeyOut]


class ApiKeyIssued(BaseModel):
    user: str
    id: str
    key: str = Field(description="the API key; shown only in this response, the hub keeps a hash")
    created_at: datetime


class TokenOut(BaseModel):
    id: str
    state: TokenState = Field(
        description="active; expiring (a newer token exists and was not used yet: this one works until "
        "`expires_at`); superseded (the newer token was used); expired; revoked"
    )
    created_at: datetime
    created_by: str
    first_used_at: datetime | None
    last_used_at: datetime | None
    expires_at: datetime | None
    revoked_at: datetime | None
    revoked_by: str | None


class ClusterOut(BaseModel):
    name: str
    description: str
    created_at: datetime
    created_by: str
    status: ClusterStatus = Field(
        description="pending (has a valid token, no call since it was issued), connected, or disconnected "
        "(no valid token: revoked)"
    )
    connected: bool
    last_seen: datetime | None = Field(description="time of the cluster's last authenticated call")
    policy_revision: int
    tokens: list[TokenOut]


class TokenIssued(BaseModel):
    cluster: str
    token_id: str
    token: str = Field(description="the cluster token; shown only in this response, the hub keeps a hash")
    previous_tokens_expire_at: datetime | None = Field(
        description="the tokens this one replaces keep working until it is first used, or until this time"
    )


class ClusterCreated(BaseModel):
    cluster: ClusterOut
    token: TokenIssued


class ClusterRevoked(BaseModel):
    cluster: ClusterOut
    revoked_tokens: list[str]


class PolicyOut(BaseModel):
    name: str
    revision: int = Field(description="the cluster's policy-set revision at this policy's last change")
    created_at: datetime
    created_by: str
    updated_at: datetime
    updated_by: str
    document: dict[str, Any] = Field(description="the GpuPolicy document (`gpu.kubeon.io/v1`)")


class PolicyList(BaseModel):
    cluster: str
    revision: int
    policies: list[PolicyOut]


class PolicyWritten(BaseModel):
    cluster: str
    revision: int = Field(description="the cluster's policy-set revision after this request")
    created: bool
    changed: bool = Field(description="false when the document equals the stored one (the revision is unchanged)")
    policy: PolicyOut


class PolicyDeleted(BaseModel):
    cluster: str
    name: str
    revision: int


class ClusterPolicySet(BaseModel):
    cluster: str
    revision: int = Field(description="bumped by every create, change or delete of one of the cluster's policies")
    etag: str = Field(description="same as the ETag header; send it back in If-None-Match")
    policies: list[dict[str, Any]] = Field(description="GpuPolicy documents, sorted by name")


class ClusterInfo(BaseModel):
    cluster: str
    token_id: str
    policy_revision: int


class ApprovalOut(BaseModel):
    id: int = Field(description="cursor: pull with `after=<id>` to get only later decisions")
    cluster: str
    operation: str
    decision: Decision
    plan_id: str | None
    reason: str
    decided_by: str
    decided_at: datetime


class ApprovalDecided(BaseModel):
    created: bool
    approval: ApprovalOut


class ApprovalPage(BaseModel):
    cluster: str
    approvals: list[ApprovalOut]
    cursor: int = Field(description="pass as `after` in the next pull (unchanged when there is nothing new)")
    more: bool = Field(description="true when `limit` cut the page short: pull again right away")


class ActionReportOut(BaseModel):
    id: int
    cluster: str
    idempotency_key: str
    operation: str
    policy: str
    action: Action
    location: str | None
    instance: str | None
    node: str | None
    detail: str
    occurred_at: datetime
    received_at: datetime
    chain_seq: int | None = Field(description="the report's place in the hub's chain of this cluster's reports "
                                  "(none: stored before the chain existed)")
    chain_prev: str | None
    chain_hash: str | None
    audit_chain: str | None = Field(description="the worker's audit log chain the report's record is in")
    audit_seq: int | None
    audit_hash: str | None
    audit_prev: str | None
    audit_problem: str | None = Field(
        default=None, description="in the answer to a report only: how its audit record does not fit the cluster's "
        "audit log as the hub has it (also written to the audit log as `audit.chain_broken`)")


class ActionReportPage(BaseModel):
    cluster: str
    reports: list[ActionReportOut]
    cursor: int
    more: bool


class AuditEventOut(BaseModel):
    id: int
    at: datetime
    actor: str = Field(description="`user:<name>`, `cluster:<name>`, `bootstrap:admin` or `seed:seed-file`")
    actor_key_id: str | None = Field(description="id of the API key or cluster token used")
    action: str
    cluster: str | None
    target: str | None
    detail: dict[str, Any]
    chain_seq: int | None = Field(description="the event's place in its chain (the cluster's, or the hub's for "
                                  "events of no cluster); none: stored before the chain existed")
    chain_prev: str | None
    chain_hash: str | None


class AuditPage(BaseModel):
    events: list[AuditEventOut]
    cursor: int
    more: bool


class ChainHeadOut(BaseModel):
    log: Literal["audit", "reports"] = Field(description="`audit`: the audit log (`/v1/audit`); `reports`: the "
                                             "cluster's action reports")
    chain: str = Field(description="the cluster's name; empty: the hub's own events (users, API keys)")
    seq: int
    hash: str
    updated_at: datetime


class ReportedHeadOut(BaseModel):
    cluster: str
    chain: str = Field(description="the ID of one worker audit log (a replica's file, or a file started afresh)")
    seq: int = Field(description="the highest record of that log the cluster reported")
    hash: str
    first_seq: int
    reports: int = Field(description="reports that named a record of that log")
    first_reported_at: datetime
    reported_at: datetime
    problem: str | None = Field(description="the first record that did not fit the log as the hub had it")
    problem_at: datetime | None


class AuditChains(BaseModel):
    chains: list[ChainHeadOut] = Field(description="the head of each of the hub's chains")
    reported: list[ReportedHeadOut] = Field(description="the head of each worker audit log, as its cluster reported")


class Health(BaseModel):
    status: Literal["ok"]

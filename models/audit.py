"""The append-only audit record of what happened to a burst node (R4.7), a link of its audit log's hash chain
(``models.audit_chain``)."""

from __future__ import annotations

from datetime import datetime

from models.base import Model


class AuditRecord(Model):
    """Append-only record of what happened to a burst node (R4.7)."""

    key: str  # idempotency: a retried activity writes the same record once
    at: datetime
    cluster: str
    policy: str
    operation: str
    action: str  # proposed, approved, launched, joined, verified, drained, removed, failed, ...
    location: str | None = None
    instance_id: str | None = None
    node_name: str | None = None
    approver: str | None = None
    detail: str = ""
    # Set by the audit log when it writes the record (the workflow leaves them empty): the log's chain ID, the
    # record's place in it, the previous record's hash and its own. Absent on records written before the chain.
    chain: str | None = None
    seq: int | None = None
    prev: str | None = None
    hash: str | None = None

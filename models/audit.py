"""The append-only audit record of what happened to a burst node (R4.7)."""

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
